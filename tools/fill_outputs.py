#!/usr/bin/env python
"""Run a notebook and save the outputs of its cells in it, for readers who open it on GitHub or Kaggle.

Cells run as `nbdev_test` runs them (in the notebook's folder, with `IN_TEST` set, `#| eval: false` cells and
cells flagged with a `tst_flags` flag that is not given skipped), so a cell flagged `bench` keeps no output: its
results are the JSON files under `nbs/results/` that the benchmark commands wrote, and the cells after it read and
plot those. Progress bars are left out: tqdm is disabled for the run (`TQDM_DISABLE=1`), and a stderr output that
is nothing but progress bars is dropped. Run `nbdev_clean` afterwards (this script does).

    python tools/fill_outputs.py nbs/06_benchmarks.ipynb [--flags slow]
"""

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell

ROOT = Path(__file__).resolve().parent.parent
# one tqdm bar as it prints itself: "desc:  40%|####      | 4/10 [00:01<00:02, 3.1it/s]"
PROGRESS = re.compile(r"^[^\n]*\d+%\|[^|]*\|[^\n]*$")


def test_flags() -> set[str]:
    "The flags that mark cells `nbdev_test` skips unless asked (`tst_flags` in settings.ini)."
    for line in (ROOT / "settings.ini").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "tst_flags":
            return set(value.split())
    return set()


def directives(src: str) -> dict[str, list[str]]:
    "The `#| name args` lines at the top of a cell."
    out = {}
    for line in src.splitlines():
        if not line.startswith("#|"):
            break
        name, *args = line[2:].split()
        out[name] = args
    return out


def skip(flags: set[str]):
    "nbdev_test's rule: skip what is not code, `nbdev_export()` calls, `eval: false` and flags not given."
    skipped = test_flags() - flags

    def f(cell) -> bool:
        if cell.cell_type != "code" or "nbdev_export" + "(" in cell.source:
            return True
        d = directives(cell.source)
        if d.get("eval:", [""])[0].lower() == "false":
            return True
        return bool(skipped & d.keys())

    return f


def is_progress(out: dict) -> bool:
    "A stderr stream output that holds only progress bars."
    if out.get("output_type") != "stream" or out.get("name") != "stderr":
        return False
    pieces = [p for p in re.split(r"[\r\n]+", "".join(out.get("text", ""))) if p.strip()]
    return all(PROGRESS.match(p) for p in pieces)


def run(path: Path, flags: set[str]) -> tuple[object, CaptureShell, bool]:
    "Run the notebook at `path` in memory as nbdev_test does; (the notebook with outputs, the shell, success)."
    nb = read_nb(path)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    os.environ["IN_TEST"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    shell, cwd = CaptureShell(path), os.getcwd()
    os.chdir(path.parent)
    try:
        shell.run_all(nb, exc_stop=True, preproc=skip(flags))
        ok = True
    except Exception:
        ok = False
    finally:
        os.chdir(cwd)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = [o for o in c.outputs if not is_progress(o)]
    return nb, shell, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", type=Path)
    ap.add_argument("--flags", nargs="*", default=[], help="flagged cells to run too (e.g. slow)")
    a = ap.parse_args()
    path = a.notebook.resolve()
    nb, shell, ok = run(path, set(a.flags))
    if not ok:
        sys.exit(shell.prettytb(fname=path) + f"\n{path.name}: a cell failed; nothing saved")
    write_nb(nb, path)
    subprocess.run(["nbdev_clean", "--fname", str(path)], check=True)
    print(f"{path.name}: outputs saved", file=sys.stderr)


if __name__ == "__main__":
    main()
