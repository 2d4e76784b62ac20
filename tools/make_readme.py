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

PERFORMANCE = "<!-- performance: generated from nbs/results by tools/make_readme.py -->"
CPU_RUNS = {"cpu_compare_avx2": "AVX2", "cpu_compare": "AVX-512, AVX512-BF16", "cpu_compare_amx": "AVX-512, AMX"}

def _x(v) -> str:
    "A ratio as the tables print it ('-' where there is none)."
    return "-" if v is None else f"{v:.2f}x"

def cpu_table(results: Path) -> list[str]:
    "float32 and int4 of each CPU run: ours over transformers (offline) and over llama-server (served)."
    from minivllm.bench import cpu_summary
    lines = ["| CPU (2 cores), run | mode | / transformers, c=1 | c=16 | c=64 | / llama-server, c=1 | c=16 | c=64 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, isa in CPU_RUNS.items():
        res = json.loads((results / f"{name}.json").read_text())
        m = res["machine"]
        rows = {(r["mode"], r["concurrency"]): r for r in cpu_summary(res)}
        for mode in ("float32", "int4"):
            cells = [_x(rows[mode, c]["vs_hf"]) for c in (1, 16, 64)] + [_x(rows[mode, c]["vs_llama"]) for c in (1, 16, 64)]
            lines.append(f"| {m['cpu']} ({isa}), {m['date'][:10]} | {mode} | " + " | ".join(cells) + " |")
    return lines

def gpu_table(results: Path) -> list[str]:
    "The GPU check: ours and transformers' generate on the same GPU and dtype, and nano-vllm's workload."
    res = json.loads((results / "gpu_check_h200.json").read_text())
    m, tp = res["machine"], res["throughput"]
    lines = [f"**{m['cuda']}** ({m['date'][:10]}, `tools/gpu_check.py`, a stand-in with the bundled model's shapes and "
             f"random weights, {tp['dtype']}, CUDA graphs; output tokens/s):", "",
             "| concurrent requests | mini-vLLM | transformers `generate` | ratio |", "|---|---|---|---|"]
    for r in tp["rows"]:
        hf = r["transformers"]["tok_s"] if "transformers" in r else r["transformers_tok_s"]  # both layouts of the check
        lines.append(f"| {r['concurrency']} | {r['ours']['tok_s']:,.0f} | {hf:,.0f} | {r['ratio']:.2f}x |")
    return lines

def speculative_line(results: Path) -> list[str]:
    "Speculative decoding (14) on and off, in one line: the ratio of each mode, workload and number of users."
    res = json.loads((results / "speculative.json").read_text())
    m, rows = res["machine"], res["rows"]
    parts = []
    for work in ("code edits", "free writing"):
        for users in (1, 16):
            got = [f"{r['mode']} {r['ratio']:.2f}x" for r in rows if r["workload"] == work and r["users"] == users]
            parts.append(f"{work}, {users} user{'s' if users > 1 else ''}: {', '.join(got)}")
    same, total = sum(r["identical"] for r in rows), sum(r["requests"] for r in rows)
    k = res["spec"]["num_speculative_tokens"]
    return [f"**Speculative decoding** (n-gram, up to {k} guessed tokens a step; off above 4 running sequences; "
            f"{m['cpu']}, {m['date'][:10]}; output tokens/s with over without, [14](nbs/14_speculative.ipynb)): "
            f"{'; '.join(parts)}; greedy outputs identical in {same} of {total} requests."]


def performance(results: Path = ROOT / "nbs" / "results") -> str:
    "The tables that replace PERFORMANCE in index.ipynb, from the committed results."
    return "\n".join(cpu_table(results) + [""] + speculative_line(results) + [""] + gpu_table(results))

def render(nb_path: Path = ROOT / "index.ipynb") -> str:
    "README.md's text for the notebook at `nb_path`."
    nb = json.loads(Path(nb_path).read_text(encoding="utf-8"))
    parts = [HEADER] + [md for md in map(cell_to_markdown, nb["cells"]) if md]
    text = "\n\n".join(parts) + "\n"
    return text.replace(PERFORMANCE, performance()) if PERFORMANCE in text else text

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
