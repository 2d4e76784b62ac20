#!/usr/bin/env python
"""The package's line rules: one statement per line (ruff's E701, E702, E703) and lines under 110 characters (E501).

`ruff check --select E701,E702,E703,E501 minivllm/`, less one kind of finding: the long lines of the `__all__`
lists that `nbdev_export` writes (it wraps them at 120 characters, and no notebook can change that).

And the book's prose rules, over the notebooks' Markdown cells, index.ipynb's included: every notebook it names
(`01b_weights`, `03a_runner`) exists, and no paragraph of a notebook appears twice in it (nor a sentence
in one paragraph).

    python tools/check_style.py [folder]     # default: minivllm/ (and the notebooks of nbs/)
"""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = "E701,E702,E703,E501"


def all_lines(path: Path) -> set[int]:
    "Line numbers (from 1) of the `__all__ = [...]` statement nbdev writes into a module."
    lines, rows, inside = path.read_text(encoding="utf-8").splitlines(), set(), False
    for n, line in enumerate(lines, 1):
        inside = inside or line.startswith("__all__ = [")
        if inside:
            rows.add(n)
            inside = not line.rstrip().endswith("]")
    return rows


def findings(folder: Path) -> list[dict]:
    "ruff's findings in `folder`, those on nbdev's `__all__` lines left out."
    cmd = ["ruff", "check", "--select", RULES, "--output-format", "json", "--exit-zero", str(folder)]
    found = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    keep = []
    for f in found:
        path = Path(f["filename"])
        if not (f["code"] == "E501" and f["location"]["row"] in all_lines(path)):
            keep.append(f)
    return keep


NOTEBOOK_NAME = re.compile(r"(?<![\w./-])(\d\d[a-z]?_[a-z][a-z0-9_]*[a-z0-9])(?![\w/-])")


def paragraphs(nb: Path) -> list[str]:
    "The Markdown paragraphs of a notebook, each with its whitespace folded (code fences and tables left out)."
    out = []
    for cell in json.loads(nb.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = re.sub(r"```.*?```", "", "".join(cell["source"]), flags=re.DOTALL)
        for para in re.split(r"\n\s*\n", text):
            if para.strip() and not para.lstrip().startswith(("|", "#")):
                out.append(" ".join(para.split()))
    return out


def prose_findings(nbs: Path, extra: list[Path] = ()) -> list[str]:
    "Notebooks named in prose that do not exist, and paragraphs that a notebook repeats."
    books = sorted(nbs.glob("*.ipynb")) + list(extra)
    names = {p.stem for p in nbs.glob("*.ipynb")}
    found = []
    for nb in books:
        seen = set()
        for para in paragraphs(nb):
            for name in NOTEBOOK_NAME.findall(para):
                if name not in names:
                    found.append(f"{nb.name}: names the notebook {name}, which does not exist: {para[:80]!r}")
            if para in seen and len(para) > 80:
                found.append(f"{nb.name}: repeats a paragraph: {para[:80]!r}")
            seen.add(para)
            sentences = [x for x in re.split(r"(?<=[.!?:])\s+", para) if len(x) > 60]
            for x in {x for x in sentences if sentences.count(x) > 1}:
                found.append(f"{nb.name}: repeats a sentence within a paragraph: {x[:80]!r}")
    return found


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "minivllm"
    found = findings(folder)
    for f in found:
        where = f"{Path(f['filename']).relative_to(ROOT)}:{f['location']['row']}"
        print(f"{where}: {f['code']} {f['message']}", file=sys.stderr)
    if found:
        print(f"{len(found)} line(s) break the package's line rules (one statement per line, lines under 110 characters)", file=sys.stderr)
    prose = prose_findings(ROOT / "nbs", [ROOT / "index.ipynb"]) if len(sys.argv) == 1 else []
    for p in prose:
        print(p, file=sys.stderr)
    if prose:
        print(f"{len(prose)} finding(s) in the notebooks' prose (a notebook named that does not exist, a paragraph twice)", file=sys.stderr)
    return 1 if found or prose else 0


if __name__ == "__main__":
    sys.exit(main())
