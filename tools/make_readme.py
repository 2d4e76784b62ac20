#!/usr/bin/env python
"""Write README.md from index.ipynb, the front page of mini-vLLM.

Markdown cells are copied as they are; a code cell becomes a ```python block followed by its text output
(cells marked `#| hide` are left out). No Quarto and no nbconvert template: the output depends on the
notebook alone, so the check below cannot drift with a tool's version.

    python tools/make_readme.py           # write README.md
    python tools/make_readme.py --check   # write nothing; exit 1 if README.md is not what index.ipynb gives
"""
import argparse, json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ("<!-- Generated from index.ipynb by tools/make_readme.py: edit the notebook, "
          "then run `python tools/make_readme.py`. -->")

def cell_to_markdown(cell: dict) -> str:
    "One cell as markdown ('' for cells that show nothing)."
    src = "".join(cell["source"]).strip("\n")
    if cell["cell_type"] == "markdown": return src
    if cell["cell_type"] != "code": return ""
    lines = src.splitlines()
    if any(l.replace(" ", "") in ("#|hide", "#|include:false") for l in lines): return ""
    code = "\n".join(l for l in lines if not l.startswith("#|")).strip("\n")
    blocks = [f"```python\n{code}\n```"] if code else []
    for out in cell.get("outputs", []):
        text = out.get("text") if out["output_type"] == "stream" else out.get("data", {}).get("text/plain")
        if text: blocks.append("```\n" + "".join(text).rstrip("\n") + "\n```")
    return "\n\n".join(blocks)

def render(nb_path: Path = ROOT / "index.ipynb") -> str:
    "README.md's text for the notebook at `nb_path`."
    nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
    parts = [HEADER] + [md for md in map(cell_to_markdown, nb["cells"]) if md]
    return "\n\n".join(parts) + "\n"

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what index.ipynb gives")
    args = p.parse_args(argv)
    readme, text = ROOT / "README.md", render()
    if args.check:
        if readme.is_file() and readme.read_text(encoding="utf-8") == text: return 0
        print("README.md is out of date with index.ipynb: run `python tools/make_readme.py`", file=sys.stderr)
        return 1
    readme.write_text(text, encoding="utf-8")
    return 0

if __name__ == "__main__": sys.exit(main())
