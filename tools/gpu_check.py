#!/usr/bin/env python
"""One command that proves mini-vLLM's GPU path and prints one JSON (issue: "a GPU check ready to run").

    python tools/gpu_check.py [--out PATH] [--sections parity,throughput,...] [--mode gpu|t4|cpu|quick] [--t4]

On a CUDA machine (mode gpu) it measures, on the bundled model's shapes (a stand-in with random weights and
the real tokenizer, built from `.gpu/` or `../shared/gpu/`; bfloat16 from capability 8.0, float16 below):
- parity: greedy tokens of our engine against transformers' `generate` in float32 on tiny random Qwen2s
  (4 configs x block sizes 1 and 16), per engine variant: attention backend torch / triton, graphs on / off;
- two_engines: an engine dropped and another built (default memory sizing), then two alive, fixed budgets;
- long_prompt: one 16,384-token prompt through the engine, and the peak memory;
- throughput: output tokens/s at 1, 16, 64 and 256 concurrent requests, ours and transformers' on the same
  GPU and dtype (and ours with graphs off at 1 and 64);
- nano_vllm_workload: nano-vllm's workload (256 requests, prompt and output lengths uniform in 100..1024);
- decode_step: kernels and launch calls per decode step, the share of a step the GPU is busy (torch.profiler);
- prefill_kernel: a layer's attention over a step's prompts (fresh, one long, after a cached prefix) through
  08's prefill kernel and through the reference's SDPA path: milliseconds each, and their largest difference;
- compile_targets: every Triton kernel compiled for sm_75, sm_80, sm_90 and this GPU (tools/triton_targets.py);
- overlap: async scheduling (09a) on and off, greedy: the same tokens, and the output tokens/s of each;
- book: `nbdev_test` over every notebook with default flags, here (installing nbdev and the server's wheels
  from `.gpu/wheels/` first where they are missing: `tools/gpu_wheels.sh` fills it on a machine with PyPI).
The T4 proxy (--t4; mode t4 = gpu's sizes under it): float16, flash SDPA off (a T4 has only the
memory-efficient kernel), every KV budget within 15 GiB and the process capped at 15 GiB of GPU memory.
Without CUDA (mode cpu, or quick for the test) it runs the same sections small on a tiny model with the
bundled vocabulary (the Triton kernel in its interpreter), so that it is tried before a GPU is at hand. A
section's failure is recorded in the JSON (`{"error": ..., "trace": [...]}`) and the others still run.
Progress goes to stderr; stdout holds only the JSON.
"""

import argparse
import dataclasses
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
from dataclasses import dataclass
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: its kernels run on the CPU

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minivllm import engine as engine_module  # noqa: E402
from minivllm.bench import BenchRequest, machine_info, run_hf, run_ours  # noqa: E402
from minivllm.engine import EngineArgs, LLMEngine, SamplingParams, parse_bytes  # noqa: E402
from minivllm.weights import load_model  # noqa: E402

T0 = time.perf_counter()
# cheap ones first
SECTIONS = ("compile_targets", "parity", "two_engines", "long_prompt", "decode_step", "prefill_kernel", "throughput",
            "overlap", "nano_vllm_workload", "book")  # fmt: skip
T4_MEMORY = 15 * 2**30  # what a T4 (16 GB) leaves a process
ALIASES = {"nano_vllm": "nano_vllm_workload"}  # the name of the first H200 run's section
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
PARITY_CONFIGS = [  # on top of TINY; the bundled vocabulary
    dict(num_key_value_heads=2),  # GQA
    dict(num_key_value_heads=4, tie_word_embeddings=True),  # MHA, the LM head tied to the embeddings
    dict(num_key_value_heads=1),  # MQA
    dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2),  # wider, 6 heads (head_dim stays 64)
]
# host calls that launch work on the GPU
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                "cudaGraphLaunch")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    "Every size the sections use, in one place per mode."

    full_model: bool  # the stand-in at the bundled model's shapes, else TINY with the bundled vocabulary
    parity_configs: int  # the first n of PARITY_CONFIGS
    parity_prompts: tuple[int, ...]  # prompt lengths, run as one batch
    parity_new: int  # greedy tokens per prompt
    long_prompt: int  # tokens
    concurrency: tuple[int, ...]  # throughput: 2c requests at each
    eager_at: tuple[int, ...]  # throughput: concurrencies also run with enforce_eager=True
    output_tokens: int  # throughput: per request, ours and transformers'
    hf_at_1: tuple[int, int]  # throughput: transformers' requests and output tokens at concurrency 1
    nano: tuple[int, int, int]  # requests, shortest and longest prompt and output
    decode_batches: tuple[int, ...]
    decode_steps: int  # steps profiled
    kv: dict  # KV cache budget per section
    overlap: tuple[int, int, int]  # requests, shortest and longest prompt and output
    book: tuple[str, ...]  # notebooks nbdev_test runs (empty: the whole book)


PLANS = {
    "gpu": Plan(True, 4, (5, 17, 33, 2), 16, 16384, (1, 16, 64, 256), (1, 64), 128, (2, 64), (256, 100, 1024),
                (1, 64), 10, dict(throughput="16GiB", nano="24GiB", long="8GiB", decode="4GiB", two="2GiB"),
                (64, 100, 300), ()),
    "t4": Plan(True, 4, (5, 17, 33, 2), 16, 16384, (1, 64), (1,), 128, (2, 64), (256, 100, 1024),
               (1, 64), 10, dict(throughput="10GiB", nano="12GiB", long="6GiB", decode="4GiB", two="2GiB"),
               (64, 100, 300), ()),
    "cpu": Plan(False, 4, (2, 5, 11), 4, 2048, (1, 4, 8), (1, 8), 16, (2, 16), (16, 16, 64), (1, 8), 5,
                dict(throughput="256MiB", nano="512MiB", long="256MiB", decode="128MiB", two="64MiB"),
                (8, 16, 48), ()),
    "quick": Plan(False, 1, (2, 5), 3, 256, (1, 4), (4,), 8, (2, 8), (8, 8, 24), (1, 4), 3,
                  dict(throughput="64MiB", nano="64MiB", long="64MiB", decode="64MiB", two="32MiB"),
                  (6, 8, 20), ("nbs/00a_utils.ipynb",)),
}  # fmt: skip


@dataclass
class Ctx:
    "What every section reads: the plan, the device, the stand-in's dtype and folder, a scratch folder."

    plan: Plan
    dev: str
    dtype: str
    tmp: Path
    standin: Path | None = None  # built on first use


def say(msg: str) -> None:
    "A progress line on stderr, with the seconds since the start."
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def gpu_dir() -> Path:
    "The folder with make_model.py, bundled_config.json and the bundled model's tokenizer."
    for d in (ROOT / ".gpu", ROOT.parent / "shared" / "gpu"):
        if (d / "bundled_config.json").exists():
            return d
    raise FileNotFoundError(f"no {ROOT / '.gpu'} or {ROOT.parent / 'shared/gpu'} with bundled_config.json")


def save_model(folder: Path, cfg: dict, dtype: torch.dtype, seed: int = 0, init: float = 0.05) -> Path:
    "A random Qwen2 saved by transformers with the bundled model's tokenizer (as make_model.py builds it)."
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen2ForCausalLM(Qwen2Config(**cfg, initializer_range=init)).to(dtype)
    hf.save_pretrained(folder, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpu_dir() / "tokenizer" / f, folder / f)
    return folder


def bundled_config(full: bool) -> dict:
    "The bundled model's shapes, or TINY with its vocabulary."
    cfg = json.loads((gpu_dir() / "bundled_config.json").read_text())
    return cfg if full else cfg | TINY


def standin(ctx: Ctx) -> Path:
    "The stand-in's folder: the one given by --standin if it holds a model, else built there (once)."
    if ctx.standin is None or not (ctx.standin / "config.json").exists():
        folder = ctx.standin or ctx.tmp / "standin"
        folder.mkdir(parents=True, exist_ok=True)
        save_model(folder, bundled_config(ctx.plan.full_model), getattr(torch, ctx.dtype))
        ctx.standin = folder
        say(f"stand-in model built in {folder}")
    return ctx.standin


def engine_kw(**kw) -> dict:
    "Engine options, less those this checkout's EngineArgs lacks (so the script runs on older checkouts)."
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    return {k: v for k, v in kw.items() if k in names}


def uses_graphs(dev: str, **kw) -> bool | None:
    "Whether an engine with these options replays decode steps from CUDA graphs (None: can't tell)."
    fn = getattr(engine_module, "uses_cuda_graphs", None)
    return None if fn is None else fn(EngineArgs(**engine_kw(**kw)), torch.device(dev))


def free() -> None:
    "Give back what dropped engines and models held."
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def random_requests(n: int, prompt: tuple[int, int], out: tuple[int, int], seed: int) -> list[BenchRequest]:
    "n requests of random token ids, prompt and output lengths uniform in the given ranges."
    rng = random.Random(seed)
    lens = [(rng.randint(*prompt), rng.randint(*out)) for _ in range(n)]
    return [BenchRequest([rng.randrange(1000, 100000) for _ in range(p)], o) for p, o in lens]


def generate(eng: LLMEngine, reqs: list[BenchRequest], **params) -> dict:
    "Every request through the engine at once (ignore_eos, greedy unless `params` say): outputs, seconds."
    ids = []
    for r in reqs:
        sp = SamplingParams(**{"temperature": 0, "max_tokens": r.max_tokens, "ignore_eos": True, **params})
        ids.append(eng.add_request({"prompt_token_ids": r.prompt_token_ids}, sp))
    done, t0 = {}, time.perf_counter()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    if CUDA:
        torch.cuda.synchronize()
    outs = [done[i] for i in ids]
    return {"outputs": outs, "seconds": time.perf_counter() - t0, "tokens": sum(map(len, outs))}


# ------------------------------------------------------------------------------------------------------------
def variants() -> list[dict]:
    "Parity's engine variants: attention backend torch / triton x graphs off / on, as far as EngineArgs goes."
    out = [dict(attention_backend=b, enforce_eager=e) for b in ("torch", "triton") for e in (True, False)]
    seen = []
    for v in out:
        v = engine_kw(**v)
        if v not in seen:
            seen.append(v)  # an older checkout without the fields: one variant, the default
    return seen


def _variant_name(v: dict) -> str:
    "'attention_backend=triton,enforce_eager=False', or 'default'."
    return ",".join(f"{k}={x}" for k, x in v.items()) or "default"


def _hf_greedy(folder: Path, reqs: list[BenchRequest], dev: str) -> list[list[int]]:
    "transformers' greedy tokens in float32, prompt by prompt (no padding), EOS ignored."
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dev).eval()
    want = []
    for r in reqs:
        with torch.inference_mode():
            ids, n = torch.tensor([r.prompt_token_ids], device=dev), r.max_tokens  # [1, L]
            out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)  # fmt: skip
        want.append(out[0, len(r.prompt_token_ids) :].tolist())
    return want


def _parity_one(ctx: Ctx, folder: Path, reqs: list[BenchRequest], want: list, res: dict) -> None:
    "Our engine's tokens on one tiny model, per variant and block size, tallied into res['per_variant']."
    model, tok = load_model(str(folder), "float32", ctx.dev)
    for v in variants():
        r = res["per_variant"].setdefault(_variant_name(v), {"identical": 0, "total": 0})
        r["graphs"] = uses_graphs(ctx.dev, **v)
        for bs in (1, 16):
            try:
                eng = LLMEngine(model, tok, **engine_kw(block_size=bs, num_kv_blocks=4096 // bs, **v))
                got = generate(eng, reqs)["outputs"]
                r["identical"] += sum(g == w for g, w in zip(got, want))
            except Exception as e:  # one variant failing leaves the others to run
                r.setdefault("errors", []).append(f"block {bs}: {type(e).__name__}: {e}"[:400])
            r["total"] += len(reqs)
            eng = None
            free()


def parity(ctx: Ctx) -> dict:
    "Greedy tokens identical to transformers in float32 on tiny random Qwen2s, per engine variant."
    p = ctx.plan
    rng = random.Random(0)
    reqs = [BenchRequest([rng.randrange(1000, 100000) for _ in range(n)], p.parity_new)
            for n in p.parity_prompts]  # fmt: skip
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    res = {"variants": [_variant_name(v) for v in variants()],
           "engine_fields": {k: k in fields for k in ("attention_backend", "enforce_eager")},
           "configs": PARITY_CONFIGS[: p.parity_configs], "block_sizes": [1, 16],
           "prompt_lengths": list(p.parity_prompts), "new_tokens": p.parity_new,
           "per_variant": {}}  # fmt: skip
    for ci, extra in enumerate(PARITY_CONFIGS[: p.parity_configs]):
        cfg = bundled_config(False) | extra | dict(max_position_embeddings=512)
        folder = save_model(ctx.tmp / f"tiny{ci}", cfg, torch.float32, seed=ci, init=0.2)
        want = _hf_greedy(folder, reqs, ctx.dev)
        _parity_one(ctx, folder, reqs, want, res)
        shutil.rmtree(folder, ignore_errors=True)
        say(f"parity: config {ci} done")
    res["identical"] = sum(r["identical"] for r in res["per_variant"].values())
    res["total"] = sum(r["total"] for r in res["per_variant"].values())
    return res


# ------------------------------------------------------------------------------------------------------------
def _build_and_generate(model, tok, prompt: list[BenchRequest], **kw) -> tuple[dict, LLMEngine | None]:
    "An engine built and run on `prompt`: a record of it, and the engine (None when it failed)."
    try:
        eng = LLMEngine(model, tok, **engine_kw(max_num_seqs=8, **kw))
        out = generate(eng, prompt)["outputs"]
        return {"ok": True, "num_blocks": eng.block_manager.num_blocks, "tokens": out}, eng
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}, None


def two_engines(ctx: Ctx) -> dict:
    "An engine dropped and another built with default memory sizing; then two alive with fixed budgets."
    model, tok = load_model(str(standin(ctx)), ctx.dtype, ctx.dev)
    prompt, res = random_requests(1, (32, 32), (8, 8), seed=2), {}
    for step in ("first", "second_after_drop"):
        res[step], eng = _build_and_generate(model, tok, prompt)
        del eng  # dropped, then collected: its pool must go back before the next engine sizes its own
        free()
    budget = parse_bytes(ctx.plan.kv["two"])
    r1, e1 = _build_and_generate(model, tok, prompt, kv_cache_memory=budget)
    r2, e2 = _build_and_generate(model, tok, prompt, kv_cache_memory=budget)
    res["two_alive_fixed_budgets"] = {"ok": r1["ok"] and r2["ok"], "budget": ctx.plan.kv["two"],
                                      "same_tokens": r1.get("tokens") == r2.get("tokens"),
                                      "errors": [r["error"] for r in (r1, r2) if not r["ok"]]}  # fmt: skip
    del e1, e2, model
    free()
    for r in res.values():
        r.pop("tokens", None)
    res["ok"] = all(r["ok"] for r in res.values())
    return res


def long_prompt(ctx: Ctx) -> dict:
    "One long prompt through the engine on the stand-in: it finishes, and the peak memory."
    n = ctx.plan.long_prompt
    model, tok = load_model(str(standin(ctx)), ctx.dtype, ctx.dev)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    eng = LLMEngine(model, tok, **engine_kw(max_num_seqs=4, kv_cache_memory=parse_bytes(ctx.plan.kv["long"])))
    r = generate(eng, random_requests(1, (n, n), (8, 8), seed=1))
    out = {"prompt_tokens": n, "new_tokens": r["tokens"], "seconds": round(r["seconds"], 2),
           "ok": r["tokens"] == 8}  # fmt: skip
    if CUDA:
        out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    del eng, model
    free()
    return out


# ------------------------------------------------------------------------------------------------------------
def _ours(ctx: Ctx, model, tok, reqs: list[BenchRequest], c: int, **kw) -> dict:
    "bench.run_ours on `reqs`, at most `c` running, after an untimed run of c short ones on another engine."
    kw = engine_kw(kv_cache_memory=parse_bytes(ctx.plan.kv["throughput"]), **kw)
    run_ours(model, tok, [BenchRequest(r.prompt_token_ids, 4) for r in reqs[:c]], c, **kw)  # kernels, shapes
    free()
    r = run_ours(model, tok, reqs, c, **kw)
    free()
    return {"tok_s": round(r["tok_per_s"], 1), "seconds": round(r["seconds"], 2), "tokens": r["tokens"],
            "steps": r["steps"], "preemptions": r["preemptions"],
            "graphs": uses_graphs(ctx.dev, **kw)}  # fmt: skip


def _hf_rows(ctx: Ctx, folder: Path, rows: list[dict]) -> None:
    "transformers' generate on each row's requests (fewer at concurrency 1: it is slow there), into the rows."
    from minivllm.bench import _hf_model

    p = ctx.plan
    hf = _hf_model(folder, getattr(torch, ctx.dtype), ctx.dev)
    run_hf(hf, [BenchRequest([1000] * 8, 4)], 1, pad_id=0)  # warm-up
    for row in rows:
        c = row["concurrency"]
        n, new = p.hf_at_1 if c == 1 else (2 * c, p.output_tokens)
        h = run_hf(hf, random_requests(n, (32, 64), (new, new), seed=c), c, pad_id=0)
        row["transformers"] = {"tok_s": round(h["tok_per_s"], 1), "seconds": round(h["seconds"], 2),
                               "requests": n, "output_tokens": new}  # fmt: skip
        row["ratio"] = round(row["ours"]["tok_s"] / h["tok_per_s"], 2)
        say(f"throughput c={c}: transformers {row['transformers']['tok_s']} tok/s, ratio {row['ratio']}")
    del hf
    free()


def throughput(ctx: Ctx) -> dict:
    "Ours and transformers' output tokens/s at each concurrency, same device and dtype, prompts 32-64 tokens."
    p, folder = ctx.plan, standin(ctx)
    model, tok = load_model(str(folder), ctx.dtype, ctx.dev)
    rows = []
    for c in p.concurrency:
        reqs = random_requests(2 * c, (32, 64), (p.output_tokens, p.output_tokens), seed=c)
        row = {"concurrency": c, "requests": len(reqs), "output_tokens": p.output_tokens}
        row["ours"] = _ours(ctx, model, tok, reqs, c)
        if c in p.eager_at:
            row["ours_eager"] = _ours(ctx, model, tok, reqs, c, enforce_eager=True)
        rows.append(row)
        say(f"throughput c={c}: ours {row['ours']['tok_s']} tok/s")
    del model
    free()
    _hf_rows(ctx, folder, rows)
    return {"dtype": ctx.dtype, "prompt_tokens": [32, 64], "rows": rows}


def step_breakdown(eng: LLMEngine) -> dict:
    "Where a run's steps went: pure decode steps (graphs replay these) against steps with prefill rows (eager)."
    decode = [s for s in eng.step_log if s.prefill_tokens == 0]
    mixed = [s for s in eng.step_log if s.prefill_tokens > 0]
    ms = lambda xs: round(1e3 * sum(s.seconds for s in xs) / max(len(xs), 1), 2)  # noqa: E731
    return {"decode_steps": len(decode), "decode_s": round(sum(s.seconds for s in decode), 2), "decode_ms": ms(decode),
            "decode_rows_mean": round(sum(s.decode_seqs for s in decode) / max(len(decode), 1), 1),
            "prefill_steps": len(mixed), "prefill_s": round(sum(s.seconds for s in mixed), 2), "prefill_ms": ms(mixed)}  # fmt: skip


def nano_vllm_workload(ctx: Ctx) -> dict:
    "nano-vllm's bench.py workload: 256 requests, prompt and output lengths uniform in 100..1024, seed 0."
    n, lo, hi = ctx.plan.nano
    reqs = random_requests(n, (lo, hi), (lo, hi), seed=0)
    model, tok = load_model(str(standin(ctx)), ctx.dtype, ctx.dev)
    kw = engine_kw(max_num_seqs=n, kv_cache_memory=parse_bytes(ctx.plan.kv["nano"]))
    generate(LLMEngine(model, tok, **kw), [BenchRequest(r.prompt_token_ids[:64], 4) for r in reqs])  # warm-up
    free()
    res = {"requests": n, "lengths": [lo, hi], "seed": 0, "ignore_eos": True}
    for sampling in ({"temperature": 0.6}, {"temperature": 0}):  # nano-vllm's; greedy where sampling fails
        try:
            eng = LLMEngine(model, tok, **kw, log_steps=True)
            r = generate(eng, reqs, **sampling)
            res |= {"sampling": sampling, "output_tok_s": round(r["tokens"] / r["seconds"], 1),
                    "seconds": round(r["seconds"], 2), "output_tokens": r["tokens"], "steps": step_breakdown(eng)}  # fmt: skip
            del eng
            break
        except Exception as e:
            res["sampling_error"] = f"{sampling}: {type(e).__name__}: {e}"[:600]
            free()
    if "async_scheduling" in engine_kw(async_scheduling=True):  # the same run with the next step launched early
        try:
            eng = LLMEngine(model, tok, **kw, async_scheduling=True, log_steps=True)
            r = generate(eng, reqs, **res.get("sampling", {}))
            res["async_scheduling"] = {"output_tok_s": round(r["tokens"] / r["seconds"], 1),
                                       "seconds": round(r["seconds"], 2), "steps": step_breakdown(eng)}  # fmt: skip
            del eng
        except Exception as e:
            res["async_scheduling"] = {"error": f"{type(e).__name__}: {e}"[:600]}
        free()
    res["graphs"] = uses_graphs(ctx.dev, **kw)
    del model
    free()
    return res


# ------------------------------------------------------------------------------------------------------------
def _profile_steps(eng: LLMEngine, steps: int) -> tuple[list, float]:
    "torch.profiler's events over `steps` engine steps, and the wall seconds of one step."
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        if CUDA:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    return list(prof.events()), wall


def _step_row(evts: list, wall: float, steps: int) -> dict:
    "Per step: GPU kernels, host launch calls and the GPU's busy share (CUDA), or aten ops (CPU)."
    row = {"step_ms": round(wall * 1e3, 2)}
    if not CUDA:
        return row | {"aten_ops_per_step": sum(e.name.startswith("aten::") for e in evts) / steps}
    kernels = [e for e in evts if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time for e in kernels) / steps
    return row | {"kernels_per_step": len(kernels) / steps,
                  "launch_calls_per_step": sum(e.name in LAUNCH_CALLS for e in evts) / steps,
                  "graph_launches_per_step": sum(e.name == "cudaGraphLaunch" for e in evts) / steps,
                  "gpu_busy_ms": round(busy_us / 1e3, 3),
                  "gpu_busy": round(busy_us / (wall * 1e6), 3)}  # fmt: skip


def decode_step(ctx: Ctx) -> dict:
    "Kernels launched per decode step and the share of the step's wall time the GPU is busy (torch.profiler)."
    p = ctx.plan
    model, tok = load_model(str(standin(ctx)), ctx.dtype, ctx.dev)
    res = {"steps_profiled": p.decode_steps}
    for B in p.decode_batches:
        for eager in (False, True):
            kw = engine_kw(max_num_seqs=B, enforce_eager=eager, kv_cache_memory=parse_bytes(p.kv["decode"]))
            eng = LLMEngine(model, tok, **kw)
            sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            for i in range(B):
                eng.add_request({"prompt_token_ids": [1000 + i] * 64}, sp)
            for _ in range(8):  # the prefill, then decode steps to warm up
                eng.step()
            row = _step_row(*_profile_steps(eng, p.decode_steps), p.decode_steps)
            row["graphs"] = uses_graphs(ctx.dev, **kw)
            res[f"batch {B}" + (" eager" if eager else "")] = row
            say(f"decode_step B={B} eager={eager}: {row}")
            eng = None
            free()
    del model
    free()
    return res


def prefill_kernel(ctx: Ctx) -> dict:
    "A layer's attend (store + prefill) through 08's kernels and the reference's (SDPA): ms and max diff."
    from minivllm.paged_cache import BlockManager, DecodeAttention, KVCache, PagedBatch
    from minivllm.qwen2 import Qwen2Config
    from minivllm.triton_attention import TritonDecode

    dt, dev = getattr(torch, ctx.dtype), torch.device(ctx.dev)
    heads = (14, 2, 64) if ctx.plan.full_model else (4, 2, 16)  # the bundled model's attention, or a tiny one
    cases = {"8 fresh x 512": ([512] * 8, [0] * 8), "1 fresh x 4096": ([4096], [0]),
             "4 x 256 after 2048 cached": ([256] * 4, [2048] * 4)} if ctx.plan.full_model else \
        {"3 fresh x 12": ([12] * 3, [0] * 3), "2 x 5 after 20 cached": ([5, 5], [20, 20])}  # fmt: skip
    cfg = Qwen2Config(hidden_size=heads[0] * heads[2], num_hidden_layers=1, num_attention_heads=heads[0],
                      num_key_value_heads=heads[1])  # fmt: skip
    res = {"heads": heads, "dtype": ctx.dtype}
    for name, (news, cached) in cases.items():
        blocks = sum(-(-(n + c) // 16) for n, c in zip(news, cached)) + 1
        kv, bm = KVCache(cfg, blocks, 16, dt, dev), BlockManager(blocks, 16)
        kv.k.normal_(), kv.v.normal_()
        items = [(bm.new_table(), c, n) for n, c in zip(news, cached)]
        for t, c, n in items:
            bm.append(t, c + n)
        q, k, v = (torch.randn(sum(news), h, heads[2], dtype=dt, device=dev) for h in heads[:1] + heads[1:2] * 2)
        row, outs = {}, []
        for backend in (TritonDecode(), DecodeAttention()):
            meta = PagedBatch.build(kv, items, len(items), dev, backend)
            outs.append(meta.attend(0, q, k, v))  # compiles, and warms up
            reps = 20 if CUDA else 1
            sync = torch.cuda.synchronize if CUDA else (lambda: None)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                meta.attend(0, q, k, v)
            sync()
            row[f"{backend.name}_ms"] = round(1000 * (time.perf_counter() - t0) / reps, 3)
        row["max_diff"] = (outs[0].float() - outs[1].float()).abs().max().item()
        res[name] = row
        say(f"prefill_kernel {name}: {row}")
    return res


def overlap(ctx: Ctx) -> dict:
    "Async scheduling (09a) off and on, greedy on the stand-in: identical tokens, and each one's output tok/s."
    n, lo, hi = ctx.plan.overlap
    if "async_scheduling" not in engine_kw(async_scheduling=True):
        return {"skipped": "this checkout's EngineArgs has no async_scheduling"}
    reqs = random_requests(n, (lo, hi), (lo, hi), seed=3)
    model, tok = load_model(str(standin(ctx)), ctx.dtype, ctx.dev)
    kw = engine_kw(max_num_seqs=n, kv_cache_memory=parse_bytes(ctx.plan.kv["nano"]))
    generate(LLMEngine(model, tok, **kw), [BenchRequest(r.prompt_token_ids[:32], 4) for r in reqs])  # warm-up
    free()
    res, outs = {"requests": n, "lengths": [lo, hi]}, {}
    for on in (False, True):
        eng = LLMEngine(model, tok, **kw, async_scheduling=on, log_steps=True)
        r = generate(eng, reqs)
        outs[on] = r["outputs"]
        res["on" if on else "off"] = {"output_tok_s": round(r["tokens"] / r["seconds"], 1),
                                      "seconds": round(r["seconds"], 2), "steps": step_breakdown(eng)}  # fmt: skip
        del eng
        free()
    res["identical"] = sum(a == b for a, b in zip(outs[False], outs[True]))
    res["ratio"] = round(res["on"]["output_tok_s"] / res["off"]["output_tok_s"], 3)
    if CUDA:  # what in a launch waits for the GPU (it should not: the launch is what overlaps)
        res["syncs_per_launch"] = _launch_syncs(model, tok, reqs[:8], kw)
    del model
    free()
    return res


def _launch_syncs(model, tok, reqs: list[BenchRequest], kw: dict) -> dict:
    "torch.cuda's sync debug mode over each overlapped launch: the synchronizing calls it warns of, counted."
    import warnings

    from minivllm.overlap import OverlapLoop

    launch, seen, counts = OverlapLoop.launch, {}, []

    def watched(self, batch, last):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return launch(self, batch, last)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counts.append(len(caught))
                for w in caught:
                    key = f"{Path(w.filename).name}:{w.lineno}"  # the line that waited
                    seen[key] = seen.get(key, 0) + 1

    OverlapLoop.launch = watched
    try:
        generate(LLMEngine(model, tok, **kw, async_scheduling=True), reqs)
    finally:
        OverlapLoop.launch = launch
    return {"launches": len(counts), "with_a_sync": sum(c > 0 for c in counts), "warnings": seen}


def compile_targets(ctx: Ctx) -> dict:
    "tools/triton_targets.py: each Triton kernel compiled for sm_75, 80, 90 (and this GPU's capability)."
    caps = {75, 80, 90} | ({int("".join(map(str, torch.cuda.get_device_capability())))} if CUDA else set())
    cmd = [sys.executable, str(ROOT / "tools" / "triton_targets.py"), "--targets", ",".join(map(str, sorted(caps)))]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if p.returncode != 0:
        return {"error": p.stderr[-1000:]}
    res = json.loads(p.stdout)
    failed = {t: [k for k, v in r["kernels"].items() if not v["ok"]] for t, r in res["targets"].items()}
    return {"triton": res["triton"], "launches": res["launches"],
            "targets": {t: [r["compiled"], r["total"]] for t, r in res["targets"].items()},
            "failed": {t: f for t, f in failed.items() if f}}  # fmt: skip


BOOK_WHEELS = ("nbdev==2.4.14", "execnb<0.2", "fastcore<2", "fastapi", "uvicorn", "pydantic", "llguidance", "gguf",
               "jsonschema", "matplotlib", "openai")  # fmt: skip


def book(ctx: Ctx) -> dict:
    "nbdev_test (default flags) over the book here; nbdev and the server's packages from .gpu/wheels if missing."
    res, wheels = {}, ROOT / ".gpu" / "wheels"
    if shutil.which("nbdev_test") is None and wheels.is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), *BOOK_WHEELS]
        p = subprocess.run(pip, capture_output=True, text=True)
        res["installed"] = p.returncode == 0 or p.stderr[-600:]
    exe = shutil.which("nbdev_test")
    if exe is None:
        return res | {"error": "nbdev is not installed (run tools/gpu_wheels.sh where PyPI is, carry .gpu/wheels)"}
    paths = [a for path in ctx.plan.book for a in ("--path", path)]
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    p = subprocess.run([exe, "--n_workers", str(min(8, os.cpu_count() or 1)), *paths], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=1800)  # fmt: skip
    out = (p.stdout + p.stderr).splitlines()
    failed = sorted({w for line in out for w in line.replace(":", " ").split() if w.endswith(".ipynb")})
    return res | {"ok": p.returncode == 0, "seconds": round(time.perf_counter() - t0, 1),
                  "notebooks": list(ctx.plan.book) or "all", "failed": failed if p.returncode else [],
                  "tail": out[-12:]}  # fmt: skip


def t4_proxy() -> dict:
    "A T4's limits on this GPU: flash SDPA off (sm_75 has only the memory-efficient kernel), 15 GiB of memory."
    torch.backends.cuda.enable_flash_sdp(False)
    res = {"flash_sdp": torch.backends.cuda.flash_sdp_enabled(), "dtype": "float16"}
    if CUDA:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, T4_MEMORY / total))
        res["memory_cap_gib"] = round(min(total, T4_MEMORY) / 2**30, 1)
    return res


# ------------------------------------------------------------------------------------------------------------
def machine() -> dict:
    "bench.machine_info() (CPU model, cores, torch, date), the GPU's name, capability, memory; versions."
    import transformers

    m = machine_info() | {"transformers": transformers.__version__, "python": sys.version.split()[0]}
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        m["triton"] = None
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        m |= {"device": props.name, "capability": list(torch.cuda.get_device_capability()),
              "gpu_memory_gb": round(props.total_memory / 1e9, 1),
              "cuda_runtime": torch.version.cuda}  # fmt: skip
    else:
        m["device"] = "cpu"
    return m


def run_section(name: str, ctx: Ctx) -> dict:
    "One section, its failure recorded rather than raised, and its seconds."
    say(f"section {name}")
    t0 = time.perf_counter()
    try:
        res = globals()[name](ctx)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}"[:1000], "trace": traceback.format_exc().splitlines()[-8:]}
        free()
    res["section_seconds"] = round(time.perf_counter() - t0, 1)
    say(f"section {name} done: {json.dumps(res)[:300]}")
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    "The command line, checked: known sections, a mode this machine can run."
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the JSON to this path (nothing is written by default)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of " + ",".join(SECTIONS))
    p.add_argument("--mode", choices=list(PLANS), default="gpu" if CUDA else "cpu",
                   help="sizes: gpu (the default with CUDA), t4 (gpu's under --t4's limits), cpu (small, the "
                        "default without), quick (tests)")  # fmt: skip
    p.add_argument("--t4", action="store_true",
                   help="a T4 proxy: float16, flash SDPA off, KV budgets within and the process capped at 15 GiB")
    p.add_argument("--dtype", help="the stand-in's dtype (default: bfloat16 from capability 8.0, else "
                                   "float16; float32 on the CPU)")  # fmt: skip
    p.add_argument("--standin", type=Path,
                   help="the stand-in's folder: used if it holds a model, else built there "
                        "(default: a scratch folder, removed at the end)")  # fmt: skip
    p.add_argument("--deadline", type=float, default=330.0 if CUDA else None,
                   help="seconds after which no section starts (default: 330 with CUDA, none without)")
    a = p.parse_args(argv)
    a.sections = [ALIASES.get(s.strip(), s.strip()) for s in a.sections.split(",") if s.strip()]
    unknown = [s for s in a.sections if s not in SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}: choose from {', '.join(SECTIONS)}")
    if a.mode in ("gpu", "t4") and not CUDA:
        p.error(f"--mode {a.mode} needs CUDA (torch.cuda.is_available() is False): use --mode cpu")
    a.t4 = a.t4 or a.mode == "t4"
    if a.t4 and a.dtype not in (None, "float16"):
        p.error(f"--t4 runs float16 (a T4 has no bfloat16), not {a.dtype}")
    return a


def default_dtype() -> str:
    "bfloat16 on GPUs from capability 8.0, float16 below (a T4), float32 on the CPU."
    if not CUDA:
        return "float32"
    return "bfloat16" if torch.cuda.get_device_capability() >= (8, 0) else "float16"


def write(res: dict, out: str | None) -> str:
    "The record as JSON text, also written to `out` if given (after each section: a killed run keeps part)."
    text = json.dumps(res, indent=1)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text


def run(a: argparse.Namespace) -> dict:
    "Every asked-for section in turn, into one record; those that would start past --deadline are skipped."
    t4 = t4_proxy() if a.t4 else None
    ctx = Ctx(PLANS[a.mode], "cuda" if CUDA else "cpu", "float16" if a.t4 else a.dtype or default_dtype(),
              Path(tempfile.mkdtemp(prefix="gpu-check-")), a.standin)  # fmt: skip
    res = {"machine": machine(), "mode": a.mode, "dtype": ctx.dtype, "plan": dataclasses.asdict(ctx.plan),
           "sections": a.sections, "deadline_s": a.deadline, "t4_proxy": t4}  # fmt: skip
    try:
        for name in a.sections:
            late = a.deadline is not None and time.perf_counter() - T0 > a.deadline
            res[name] = {"skipped": f"past the deadline, {a.deadline} s"} if late else run_section(name, ctx)
            res["total_seconds"] = round(time.perf_counter() - T0, 1)
            write(res, a.out)
    finally:
        shutil.rmtree(ctx.tmp, ignore_errors=True)
    res["errors"] = [n for n in a.sections if "error" in res[n]]
    res["skipped"] = [n for n in a.sections if "skipped" in res[n]]
    return res


def main(argv: list[str] | None = None) -> dict:
    "Run the check; the JSON on stdout (and in --out), everything else (C libraries' output too) on stderr."
    a = parse_args(argv)
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # whatever prints to stdout while sections run goes to stderr: stdout holds only the JSON
    try:
        res = run(a)
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    print(write(res, a.out), flush=True)
    say(f"done in {res['total_seconds']} s; errors: {res['errors']}; skipped: {res['skipped']}")
    return res


if __name__ == "__main__":
    main()
