#!/usr/bin/env python
"""Run a notebook as `nbdev_test` does, and fail when a cell that shows something carries no committed output.

The notebook runs once, in memory (the file is not written), with the rules of `tools/fill_outputs.py`: in its
folder, `IN_TEST` set, progress bars off, `#| eval: false` cells and cells flagged with a `tst_flags` flag that is
not given skipped. It fails

* when a cell raises, as `nbdev_test` does (the traceback is printed);
* when a cell printed to stdout, displayed something or returned a value in this run, but the notebook as
  committed holds no output for it: run `python tools/fill_outputs.py NOTEBOOK --flags slow` and commit.

    python tools/check_outputs.py nbs/04_engine.ipynb [--flags slow]
"""

import argparse
import sys
from pathlib import Path

from execnb.nbio import read_nb

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fill_outputs import run  # noqa: E402  (the same runner, so the two cannot disagree on what runs)

SHOWN = {"display_data", "execute_result"}


def shows(outputs: list) -> bool:
    "Whether outputs hold something a reader sees: stdout, a display or a cell's value."
    return any(o.get("output_type") in SHOWN or o.get("name") == "stdout" for o in outputs)


def missing_outputs(committed, ran) -> list[int]:
    "Indices of the code cells that show something in `ran` and have no output in `committed`."
    pairs = zip(committed.cells, ran.cells)
    return [i for i, (c, r) in enumerate(pairs) if c.cell_type == "code" and shows(r.outputs) and not c.outputs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--flags", nargs="*", default=[], help="flagged cells to run too (e.g. slow)")
    a = ap.parse_args()
    path = a.notebook.resolve()
    ran, shell, ok = run(path, set(a.flags))
    if not ok:
        print(shell.prettytb(fname=path), file=sys.stderr)
        print(f"{path.name}: a cell failed", file=sys.stderr)
        return 1
    missing = missing_outputs(read_nb(path), ran)
    for i in missing:
        first = ran.cells[i].source.strip().splitlines()[0][:70]
        print(f"{path.name}: cell {i} shows output but none is committed: {first}", file=sys.stderr)
    if missing:
        print(f"run `python tools/fill_outputs.py {a.notebook} --flags slow` and commit the outputs", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
