#!/usr/bin/env python
"""The package's line rules: one statement per line (ruff's E701, E702, E703) and lines under 110 characters (E501).

`ruff check --select E701,E702,E703,E501 minivllm/`, less one kind of finding: the long lines of the `__all__`
lists that `nbdev_export` writes (it wraps them at 120 characters, and no notebook can change that).

    python tools/check_style.py [folder]     # default: minivllm/
"""

import json
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


def main() -> int:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "minivllm"
    found = findings(folder)
    for f in found:
        where = f"{Path(f['filename']).relative_to(ROOT)}:{f['location']['row']}"
        print(f"{where}: {f['code']} {f['message']}", file=sys.stderr)
    if found:
        print(f"{len(found)} line(s) break the package's line rules (one statement per line, lines under 110 characters)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
