#!/usr/bin/env python
"""Run a notebook and save the outputs of its cells in it, for readers who open it on GitHub or Kaggle.

Cells run as `nbdev_test` runs them (in the notebook's folder, `#| eval: false` and flagged cells skipped), so a
cell flagged `bench` keeps no output: its results are the JSON files under `nbs/results/` that the benchmark
commands wrote, and the cells after it read and plot those. Run `nbdev_clean` afterwards (this script does).

    python tools/fill_outputs.py nbs/06_benchmarks.ipynb [--flags slow]
"""
import argparse, os, subprocess, sys
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

SKIP = {"slow", "bench"}


def directives(src: str) -> dict[str, list[str]]:
    "The `#| name args` lines at the top of a cell."
    out = {}
    for line in src.splitlines():
        if not line.startswith("#|"): break
        name, *args = line[2:].split()
        out[name] = args
    return out


def skip(flags: set[str]):
    def f(cell) -> bool:
        if cell.cell_type != "code": return True
        d = directives(cell.source)
        if d.get("eval:", [""])[0].lower() == "false": return True
        return bool((SKIP - flags) & d.keys())
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--flags", nargs="*", default=[], help="flagged cells to run too (e.g. slow)")
    a = ap.parse_args()
    path = a.notebook.resolve()
    nb = read_nb(path)
    for c in nb.cells:
        if c.cell_type == "code": c.outputs, c.execution_count = [], None
    os.environ["IN_TEST"] = "1"
    cwd = os.getcwd()
    os.chdir(path.parent)
    try: CaptureShell(path).run_all(nb, exc_stop=True, preproc=skip(set(a.flags)))
    finally: os.chdir(cwd)
    write_nb(nb, path)
    subprocess.run(["nbdev_clean", "--fname", str(path)], check=True)
    print(f"{path.name}: outputs saved", file=sys.stderr)


if __name__ == "__main__":
    main()
