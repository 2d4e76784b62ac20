#!/usr/bin/env python
"""One command that proves mini-vLLM's GPU path and prints one JSON (issue: "a GPU check ready to run").

    python tools/gpu_check.py [--out nbs/results/gpu_check.json] [--sections parity,throughput,...]

On a CUDA machine it measures, on the bundled model's shapes (a stand-in with random weights built by
`.gpu/make_model.py` or `../shared/gpu/make_model.py`, bfloat16 where the GPU has it, float16 below):
- parity: greedy tokens of our engine against transformers' `generate` in float32 on tiny random Qwen2s
  (4 configs x block sizes 1 and 16), with the reference and the Triton decode backend, CUDA graphs on and off;
- two_engines: an engine dropped and another built (default memory sizing), then two alive with fixed budgets;
- long_prompt: one 16,384-token prompt through the engine, and the peak memory;
- throughput: output tokens/s at 1, 16, 64 and 256 concurrent requests, ours and transformers' on the same GPU and
  dtype (and ours with graphs off at 1 and 64);
- nano_vllm: nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024, seed 0);
- decode_step: kernels per decode step and the share of a step the GPU is busy (torch.profiler), at 1 and 64.
Without CUDA it runs the same sections small on the CPU (the Triton kernel in its interpreter), so that it is
tried before a GPU is at hand. Each section's failure is recorded in the JSON, and the others still run.
"""

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on the CPU

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minivllm.bench import BenchRequest, machine_info, run_hf  # noqa: E402
from minivllm.engine import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from minivllm.qwen2 import Tokenizer, load_model  # noqa: E402

T0 = time.perf_counter()
SECTIONS = ("parity", "decode_step", "throughput", "nano_vllm", "long_prompt", "two_engines")


def say(msg: str) -> None:
    "A progress line on stderr, with the seconds since the start."
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def gpu_dir() -> Path:
    "The folder with make_model.py, bundled_config.json and the bundled model's tokenizer."
    for d in (ROOT / ".gpu", ROOT.parent / "shared" / "gpu"):
        if (d / "bundled_config.json").exists():
            return d
    raise FileNotFoundError("no .gpu/ or ../shared/gpu/ with bundled_config.json")


def save_model(folder: Path, cfg: dict, dtype: torch.dtype, seed: int = 0, init: float = 0.05) -> Path:
    "A random Qwen2 saved by transformers with the bundled model's tokenizer: the stand-in or a tiny one."
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg, initializer_range=init)).to(dtype)
    hf.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpu_dir() / "tokenizer" / f, folder / f)
    return folder


def standin_config(small: bool) -> dict:
    "The bundled model's shapes, or (on the CPU) a tiny model with its vocabulary."
    cfg = json.loads((gpu_dir() / "bundled_config.json").read_text())
    if small:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)  # fmt: skip
    return cfg


def engine_kw(**kw) -> dict:
    "Engine options, without those this checkout's EngineArgs does not have (so the script runs on older ones)."
    names = set(EngineArgs.__dataclass_fields__)
    return {k: v for k, v in kw.items() if k in names}


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, params: dict | None = None) -> dict:
    "Every prompt (token ids) through the engine at once: outputs in order, seconds, output tokens."
    sp = SamplingParams(**{"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True, **(params or {})})
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p in prompts]
    done, t0 = {}, time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    if CUDA:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    outs = [done[i] for i in ids]
    return {"outputs": outs, "seconds": dt, "tokens": sum(map(len, outs))}


def variants() -> list[dict]:
    "The engine variants parity checks: the reference backend eager, Triton eager, Triton with CUDA graphs."
    out = [dict(attention_backend="torch", enforce_eager=True), dict(attention_backend="triton", enforce_eager=True),
           dict(attention_backend="triton", enforce_eager=False)]  # fmt: skip
    return [v for v in out if engine_kw(**v) == v] or [{}]


def free() -> None:
    "Give back what dropped engines held."
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
def parity(a, dev: str, tmp: Path) -> dict:
    "Greedy tokens identical to transformers in float32, per engine variant."
    from transformers import AutoModelForCausalLM

    base = standin_config(True) | dict(max_position_embeddings=512)
    configs = [
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2),  # GQA
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4),  # MHA
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1),  # MQA
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False),
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 100000) for _ in range(n)] for n in (5, 17, 33, 2)]
    new = 16 if CUDA else 8
    res = {"per_variant": {}, "configs": len(configs), "block_sizes": [1, 16], "prompts": len(prompts)}
    for ci, extra in enumerate(configs):
        folder = save_model(tmp / f"tiny{ci}", base | extra, torch.float32, seed=ci, init=0.2)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
        want = []
        for p in prompts:
            out = hf.generate(torch.tensor([p], device=dev), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            want.append(out[0, len(p):].tolist())
        del hf
        model, tok = load_model(str(folder), "float32", dev)
        for v in variants():
            for bs in (1, 16):
                eng = LLMEngine(model, tok, **engine_kw(block_size=bs, num_kv_blocks=4096 // bs, **v))
                got = generate(eng, prompts, new)["outputs"]
                key = ",".join(f"{k}={x}" for k, x in v.items()) or "default"
                r = res["per_variant"].setdefault(key, {"identical": 0, "total": 0, "graphs": None})
                r["identical"] += sum(g == w for g, w in zip(got, want))
                r["total"] += len(prompts)
                r["graphs"] = getattr(eng.runner, "graphs", None) is not None
                del eng
        del model
        free()
        say(f"parity: config {ci} done")
    return res


def two_engines(a, dev: str, folder: Path, dtype: str) -> dict:
    "An engine dropped and another built with default memory sizing; then two alive with fixed budgets."
    res = {}
    model, tok = load_model(str(folder), dtype, dev)
    prompt = [[1000 + i for i in range(32)]]
    for step in ("first", "second_after_drop"):
        try:
            eng = LLMEngine(model, tok, **engine_kw(max_num_seqs=8))
            generate(eng, prompt, 8)
            res[step] = {"ok": True, "num_blocks": eng.block_manager.num_blocks}
        except Exception as e:
            res[step] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        eng = None
        free()
    try:
        budget = "2GiB" if CUDA else "64MiB"
        e1 = LLMEngine(model, tok, **engine_kw(max_num_seqs=8, kv_cache_memory=_bytes(budget)))
        e2 = LLMEngine(model, tok, **engine_kw(max_num_seqs=8, kv_cache_memory=_bytes(budget)))
        same = generate(e1, prompt, 8)["outputs"] == generate(e2, prompt, 8)["outputs"]
        res["two_alive_fixed_budgets"] = {"ok": True, "budget": budget, "same_tokens": same}
    except Exception as e:
        res["two_alive_fixed_budgets"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    e1 = e2 = model = None
    free()
    return res


def _bytes(s: str) -> int:
    "'2GiB' -> bytes."
    from minivllm.engine import parse_bytes

    return parse_bytes(s)


def long_prompt(a, dev: str, folder: Path, dtype: str) -> dict:
    "One long prompt through the engine: no out-of-memory, and the peak memory."
    n = 16384 if CUDA else 2048
    model, tok = load_model(str(folder), dtype, dev)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    eng = LLMEngine(model, tok, **engine_kw(max_num_seqs=4, kv_cache_memory=_bytes("8GiB" if CUDA else "256MiB")))
    rng = random.Random(1)
    r = generate(eng, [[rng.randrange(1000, 100000) for _ in range(n)]], 8)
    out = {"prompt_tokens": n, "new_tokens": r["tokens"], "seconds": round(r["seconds"], 2), "ok": r["tokens"] == 8}
    if CUDA:
        out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    del eng, model
    free()
    return out


def _requests(n: int, prompt_len: tuple[int, int], out_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    "n requests of random token ids, lengths uniform in the given ranges."
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(1000, 100000) for _ in range(rng.randint(*prompt_len))],
                         rng.randint(*out_len)) for _ in range(n)]  # fmt: skip


def _ours(model, tok, reqs: list[BenchRequest], c: int, **kw) -> dict:
    "Our engine on `reqs` with at most `c` running; output tokens/s."
    eng = LLMEngine(model, tok, **engine_kw(max_num_seqs=c, **kw))
    generate(eng, [reqs[0].prompt_token_ids], 4)  # warm-up: first calls set up kernels
    sp = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    ids = [eng.add_request({"prompt_token_ids": r.prompt_token_ids}, p) for r, p in zip(reqs, sp)]
    done, t0 = {}, time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    if CUDA:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(done[i]) for i in ids)
    graphs = getattr(eng.runner, "graphs", None) is not None
    del eng
    free()
    return {"tok_s": round(tokens / dt, 1), "seconds": round(dt, 2), "tokens": tokens, "graphs": graphs}


def throughput(a, dev: str, folder: Path, dtype: str) -> dict:
    "Ours and transformers' at each concurrency, same GPU and dtype, prompts 32-64 tokens, outputs fixed."
    from transformers import AutoModelForCausalLM

    conc = (1, 16, 64, 256) if CUDA else (1, 4, 8)
    new = 128 if CUDA else 16
    kv = _bytes("16GiB" if CUDA else "256MiB")
    model, tok = load_model(str(folder), dtype, dev)
    rows = []
    for c in conc:
        reqs = _requests(2 * c, (32, 64), (new, new), seed=c)
        row = {"concurrency": c, "requests": len(reqs), "output_tokens": new, "ours": _ours(model, tok, reqs, c, kv_cache_memory=kv)}
        if c in (1, 64) or (not CUDA and c == conc[-1]):
            row["ours_eager"] = _ours(model, tok, reqs, c, kv_cache_memory=kv, enforce_eager=True)
        rows.append(row)
        say(f"throughput c={c}: ours {row['ours']['tok_s']} tok/s")
    del model
    free()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(dev).eval()
    run_hf(hf, [BenchRequest([1000] * 8, 4)], 1, pad_id=0)  # warm-up
    for row in rows:
        c = row["concurrency"]
        reqs = _requests(2 * c, (32, 64), (new, new), seed=c)
        h = run_hf(hf, reqs, c, pad_id=0)
        row["transformers_tok_s"] = round(h["tok_per_s"], 1)
        row["ratio"] = round(row["ours"]["tok_s"] / h["tok_per_s"], 2)
        say(f"throughput c={c}: transformers {row['transformers_tok_s']} tok/s, ratio {row['ratio']}")
    del hf
    free()
    return {"dtype": dtype, "rows": rows}


def nano_vllm(a, dev: str, folder: Path, dtype: str) -> dict:
    "nano-vllm's bench.py workload: 256 requests, prompt and output lengths uniform in 100..1024, seed 0."
    n, lo, hi = (256, 100, 1024) if CUDA else (16, 16, 64)
    reqs = _requests(n, (lo, hi), (lo, hi), seed=0)
    model, tok = load_model(str(folder), dtype, dev)
    r = _ours(model, tok, reqs, n, kv_cache_memory=_bytes("24GiB" if CUDA else "512MiB"))
    del model
    free()
    return {"requests": n, "lengths": [lo, hi], "sampling": "greedy, ignore_eos", "output_tok_s": r["tok_s"],
            "seconds": r["seconds"], "output_tokens": r["tokens"], "graphs": r["graphs"]}  # fmt: skip


def decode_step(a, dev: str, folder: Path, dtype: str) -> dict:
    "Kernels launched per decode step and the share of the step's wall time the GPU is busy (torch.profiler)."
    from torch.profiler import ProfilerActivity, profile

    model, tok = load_model(str(folder), dtype, dev)
    res = {}
    for B in (1, 64) if CUDA else (1, 8):
        for eager in (False, True):
            eng = LLMEngine(model, tok, **engine_kw(max_num_seqs=B, enforce_eager=eager, kv_cache_memory=_bytes("4GiB" if CUDA else "128MiB")))
            sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            for i in range(B):
                eng.add_request({"prompt_token_ids": [1000 + i] * 64}, sp)
            for _ in range(8):  # prefill, then a few decode steps to warm up
                eng.step()
            steps = 10
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
            with profile(activities=acts) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                if CUDA:
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / steps
            evts = prof.events()
            if CUDA:
                kernels = [e for e in evts if e.device_type == torch.autograd.DeviceType.CUDA]
                busy_us = sum(e.device_time for e in kernels) / steps
                graph_launches = sum(1 for e in evts if e.name == "cudaGraphLaunch") / steps
                row = {"kernels_per_step": len(kernels) / steps, "graph_launches_per_step": graph_launches,
                       "step_ms": round(wall * 1e3, 2), "gpu_busy": round(busy_us / (wall * 1e6), 3)}  # fmt: skip
            else:
                ops = [e for e in evts if e.name.startswith("aten::")]
                row = {"aten_ops_per_step": len(ops) / steps, "step_ms": round(wall * 1e3, 2)}
            row["graphs"] = getattr(eng.runner, "graphs", None) is not None
            res[f"batch {B}" + (" eager" if eager else "")] = row
            say(f"decode_step B={B} eager={eager}: {row}")
            del eng
            free()
    del model
    free()
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the JSON to this path")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--dtype", help="dtype of the stand-in runs (default: bfloat16 from capability 8.0, else float16; float32 on the CPU)")
    a = p.parse_args(argv)
    dev = "cuda" if CUDA else "cpu"
    dtype = a.dtype or (("bfloat16" if torch.cuda.get_device_capability() >= (8, 0) else "float16") if CUDA else "float32")
    res = {"machine": machine_info(), "mode": "gpu" if CUDA else "cpu (small)", "dtype": dtype}
    if CUDA:
        res["machine"]["capability"] = list(torch.cuda.get_device_capability())
    try:
        import triton

        res["machine"]["triton"] = triton.__version__
    except ImportError:
        res["machine"]["triton"] = None
    import transformers

    res["machine"]["transformers"] = transformers.__version__
    tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    folder = None
    for name in a.sections.split(","):
        say(f"section {name}")
        t0 = time.perf_counter()
        try:
            if name != "parity" and folder is None:
                folder = save_model(tmp / "standin", standin_config(not CUDA), getattr(torch, dtype))
                say(f"stand-in model in {folder}")
            fn = globals()[name]
            res[name] = fn(a, dev, tmp) if name == "parity" else fn(a, dev, folder, dtype)
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc().splitlines()[-8:]}
            free()
        res.setdefault(name, {})
        if isinstance(res[name], dict):
            res[name]["section_seconds"] = round(time.perf_counter() - t0, 1)
        say(f"section {name} done: {json.dumps(res[name])[:300]}")
    res["total_seconds"] = round(time.perf_counter() - T0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return res


if __name__ == "__main__":
    main()
