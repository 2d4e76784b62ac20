#!/usr/bin/env python
"""Every Triton kernel of mini-vLLM compiled for the GPUs readers have, without one: prints one JSON.

    python tools/triton_targets.py [--out PATH] [--targets 75,80,90]

Triton compiles for a GPU it is not running on (`triton.compile(ASTSource(...), target=GPUTarget(...))`: it
needs its compiler, not a driver). The kernels are found by running each operator that launches one (08's paged
decode attention, with and without split-K, its K/V store and its prefill attention (bfloat16 also as a GPU
runs it: the interpreter takes the sums instead of tl.dot); 08a's residual add + RMSNorm, SiLU-and-multiply
and rotary) in Triton's interpreter on the bundled model's shapes and Qwen3-0.6B's, in float32, float16 and bfloat16, recording
every launch's arguments; then each launch is compiled, in a fresh process that does not interpret, for each
target: sm_75 (the T4: float32 and float16, it has no bfloat16), sm_80 (A100) and sm_90 (H100, H200). Recorded
per kernel and target: compiled or the error, the shared memory it asks for against the target's limit, warps.
Compiling is not running: a GPU still has to run the kernels (tests/test_fused_kernels.py and
tests/test_triton_attention.py on CUDA) and time them.
"""

import argparse
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

RECORD = "--record" in sys.argv
if RECORD:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launches run on the CPU
else:
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

SHARED_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes a block may use, opt-in max
NO_BF16 = {75}  # no bfloat16 hardware: Triton refuses or emulates; a T4 runs float16
SHAPES = {  # the bundled model's (Qwen2.5-0.5B), and nano-vllm's benchmark model's (Qwen3-0.6B: head size 128)
    "qwen2.5-0.5b": dict(hidden=896, intermediate=4864, heads=14, kv_heads=2, head_dim=64, block_size=16),
    "qwen3-0.6b": dict(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128, block_size=16),
}
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_OF = {"*fp32": "float32", "*fp16": "float16", "*bf16": "bfloat16"}


def _kind(v) -> str | None:
    "A launch argument's Triton type (None for a constexpr or None value)."
    if isinstance(v, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
                      torch.int32: "i32", torch.bool: "i1"}[v.dtype]  # fmt: skip
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    return None


def record() -> list[dict]:
    "Run every launching operator in the interpreter; each distinct launch as {kernel, module, signature, ...}."
    from triton.runtime.jit import KernelInterface

    from minivllm import fused_kernels as fk
    from minivllm import triton_attention as ta
    from minivllm.qwen2 import RMSNorm

    seen, specs, getitem = set(), [], KernelInterface.__getitem__

    def launcher(kernel, grid):
        run = getitem(kernel, grid)

        def launch(*args, **kwargs):
            params = list(inspect.signature(kernel.fn).parameters.values())
            bound = dict(zip([p.name for p in params], args)) | {k: v for k, v in kwargs.items() if k in
                                                                 {p.name for p in params}}  # fmt: skip
            sig, consts = {}, {}
            for p in params:
                v = bound.get(p.name, p.default)
                if "constexpr" in str(p.annotation) or _kind(v) is None:
                    sig[p.name], consts[p.name] = "constexpr", v
                else:
                    sig[p.name] = _kind(v)
            opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
            spec = {"kernel": kernel.fn.__name__, "module": kernel.fn.__module__, "signature": sig,
                    "constexprs": consts, "options": opts}  # fmt: skip
            key = json.dumps(spec, sort_keys=True)
            if key not in seen:
                seen.add(key)
                specs.append(spec)
            return run(*args, **kwargs)

        return launch

    KernelInterface.__getitem__ = launcher
    try:
        for s, name in ((s, name) for s in SHAPES.values() for name in DTYPES):
            dt = getattr(torch, name)
            T, H, D = 3, s["heads"], s["head_dim"]
            norm = RMSNorm(s["hidden"]).to(dt)
            x = torch.randn(T, s["hidden"], dtype=dt)
            fk.add_rms_norm(x, None, norm)
            fk.add_rms_norm(x, x.clone(), norm)
            fk.silu_and_mul(torch.randn(T, 2 * s["intermediate"], dtype=dt))
            qkv = torch.randn(T, (H + 2 * s["kv_heads"]) * D, dtype=dt)
            cos, sin = torch.randn(T, D // 2), torch.randn(T, D // 2)  # float32, as 01's rotary keeps them
            fk.rotary(qkv[:, : H * D].view(T, H, D), cos, sin)
            for ctx, splits in ((20, None), (1000, 4)):  # a short context (a program per head), a long one split
                q, kp, vp, tables, lens = ta.random_decode_batch([ctx, 7], s["block_size"], H, s["kv_heads"], D,
                                                                 dtype=dt, fill=0.0)  # fmt: skip
                ta.paged_decode_attention_triton(q, kp, vp, tables, lens, num_splits=splits)
                k, v = torch.randn(T, s["kv_heads"], D, dtype=dt), torch.randn(T, s["kv_heads"], D, dtype=dt)
                ta.store_kv_triton(k, v, kp, vp, torch.arange(T))
                new = [min(ctx, 20), 2]  # two prompts' rows over the same pools: one cached before, one not
                spans = torch.tensor([[0, new[0]], new, [ctx, 7]], dtype=torch.int32)  # [3, P]
                q = torch.randn(sum(new), H, D, dtype=dt)
                ta.paged_prefill_attention_triton(q, kp, vp, tables.to(torch.int32), spans, max(new))
    finally:
        KernelInterface.__getitem__ = getitem
    for spec in [s for s in specs if s["kernel"] == "_paged_prefill_kernel"]:  # the plan a GPU takes, not the
        c, dt = spec["constexprs"], DTYPE_OF[spec["signature"]["q_ptr"]]  # interpreter (08: prefill_plan)
        c["DOT"], c["M"], c["N"] = ta.prefill_plan(getattr(torch, dt), c["D"], interpreted=False)
    return specs


def compile_one(spec: dict, cap: int) -> dict:
    "One recorded launch compiled for sm_<cap>: its shared memory and warps, or the error."
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"])
    try:
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=spec["options"] or None)
    except Exception as e:  # the compiler's message, first lines
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
    shared = k.metadata.shared
    return {"ok": shared <= SHARED_LIMIT.get(cap, 49152), "shared_bytes": shared, "num_warps": k.metadata.num_warps}


def dtype_of(spec: dict) -> str:
    "The floating type of a launch's first floating pointer (what the kernel computes in)."
    return DTYPE_OF[next(v for v in spec["signature"].values() if v in DTYPE_OF)]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--targets", default="75,80,90", help="compute capabilities, comma-separated")
    p.add_argument("--record", action="store_true", help=argparse.SUPPRESS)  # the child: print the launches
    a = p.parse_args(argv)
    if a.record:
        print(json.dumps(record()))
        return {}
    child = subprocess.run([sys.executable, __file__, "--record"], capture_output=True, text=True, cwd=ROOT)
    if child.returncode != 0:
        raise SystemExit(f"recording the launches failed:\n{child.stderr[-3000:]}")
    specs = json.loads(child.stdout.strip().splitlines()[-1])
    import triton

    res = {"triton": triton.__version__, "shapes": SHAPES, "launches": len(specs), "targets": {}}
    for cap in [int(c) for c in a.targets.split(",")]:
        rows = {}
        for spec in specs:
            dt = dtype_of(spec)
            if cap in NO_BF16 and dt == "bfloat16":
                continue
            consts = ",".join(f"{k}={v}" for k, v in spec["constexprs"].items() if v is not None)
            rows[f"{spec['kernel']}[{dt}; {consts}]"] = compile_one(spec, cap)
        res["targets"][f"sm_{cap}"] = {"compiled": sum(r["ok"] for r in rows.values()), "total": len(rows),
                                       "kernels": rows}  # fmt: skip
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)
    return res


if __name__ == "__main__":
    main()
