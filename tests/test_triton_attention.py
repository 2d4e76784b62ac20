"""The Triton paged-attention decode kernel against its plain-PyTorch twin, on the CPU (Triton's interpreter).

TRITON_INTERPRET=1 has to be set before triton is first imported (triton decides at import whether its kernels
compile or run in the interpreter), so it is set here, before minivllm.triton_attention imports triton. Shapes
stay small: the interpreter runs every program of the grid in numpy.

Tolerances: float32 within 1e-5 of the reference; float16 and bfloat16 within one unit in the last place
of the output (rtol = the dtype's eps) plus 1e-5. The reference computes in float32 and rounds once, as the
kernel does; they can still differ by one unit where the two float32 results round to different neighbours,
and in bfloat16 often do: the interpreter converts float32 to bfloat16 by truncation, where a GPU rounds to
nearest.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported; CUDA is not needed for the tests

from minivllm.paged_cache import paged_decode_attention, padded_decode_attention  # noqa: E402
from minivllm.triton_attention import (  # noqa: E402
    HAS_TRITON,
    decode_attention_reference,
    interpreting,
    paged_decode_attention_triton,
    random_decode_batch,
)

INTERPRETED = interpreting()  # triton's real mode in this process, not what the variable says now

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS = [(14, 2), (4, 4), (5, 1)]  # (Hq, Hkv): the bundled model's GQA, MHA, MQA


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    "The kernel tests need triton's interpreter: a triton imported earlier without it cannot run on the CPU."
    if HAS_TRITON and not INTERPRETED:
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: set it in the environment")


def tolerance(dtype: torch.dtype) -> dict:
    "atol/rtol for kernel against reference: 1e-5 in float32, one unit in the last place in 16-bit dtypes."
    rtol = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    return dict(atol=1e-5, rtol=rtol)


def boundary_lens(bs: int) -> list[int]:
    "Context lengths on both sides of block boundaries, mixed in one batch."
    return sorted({1, max(bs - 1, 1), bs, bs + 1, 2 * bs, 3 * bs + 2})


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("bs", [1, 7, 16])
def test_kernel_matches_reference(bs, heads, dtype):
    # the pools hold NaN in every slot outside the contexts and the tables are padded with an all-NaN block:
    # one read past a context would turn the output into NaN
    q, k_pool, v_pool, tables, lens = random_decode_batch(boundary_lens(bs), bs, *heads, 32, dtype, seed=bs)
    out = paged_decode_attention_triton(q, k_pool, v_pool, tables, lens)
    ref = decode_attention_reference(q, k_pool, v_pool, tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


@needs_triton
def test_kernel_matches_the_eager_paths():
    # the project's eager decode attentions multiply zero weights by what unused slots hold: zeros here
    lens = [1, 5, 7, 12, 20]
    q, k_pool, v_pool, tables, ctx = random_decode_batch(lens, 4, 14, 2, 64, fill=0.0, seed=1)
    out = paged_decode_attention_triton(q, k_pool, v_pool, tables, ctx)
    padded = padded_decode_attention(q, k_pool, v_pool, tables.long(), ctx.long())
    torch.testing.assert_close(out, padded, atol=1e-5, rtol=0)
    need = [-(-n // 4) for n in lens]
    block_ids = torch.cat([tables[b, : need[b]] for b in range(len(lens))]).long()  # [P]
    block_row = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(need))  # [P]
    first_pos = torch.cat([torch.arange(n) * 4 for n in need])  # [P] position of each block's first slot
    valid = first_pos[:, None] + torch.arange(4)[None, :] < ctx.long()[block_row][:, None]  # [P, bs]
    paged = paged_decode_attention(q, k_pool, v_pool, block_ids, block_row, valid)
    torch.testing.assert_close(out, paged, atol=1e-5, rtol=0)


def test_reference_matches_padded_decode_attention():
    q, k_pool, v_pool, tables, lens = random_decode_batch([3, 9, 16], 8, 6, 2, 16, fill=0.0, seed=2)
    ref = decode_attention_reference(q, k_pool, v_pool, tables, lens)
    torch.testing.assert_close(ref, padded_decode_attention(q, k_pool, v_pool, tables.long(), lens.long()))


@needs_triton
def test_padding_entries_are_never_read():
    # a padding entry past the pool's end would fault, or read garbage, if the kernel ever followed it
    q, k_pool, v_pool, tables, lens = random_decode_batch([1, 6, 17], 4, 4, 2, 16, seed=3)
    need = (lens + 3) // 4
    past_end = torch.arange(tables.shape[1])[None, :] >= need[:, None]  # [B, max_blocks]
    tables = tables.masked_fill(past_end, k_pool.shape[0] + 10**6)
    out = paged_decode_attention_triton(q, k_pool, v_pool, tables, lens)
    ref = decode_attention_reference(q, k_pool, v_pool, tables, lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@needs_triton
def test_empty_context_gives_zeros():
    # a batch padded with empty rows (as a captured graph's batch is) gets zeros there, not NaN from 0/0
    q, k_pool, v_pool, tables, lens = random_decode_batch([5, 0, 9], 4, 4, 4, 16, seed=4)
    out = paged_decode_attention_triton(q, k_pool, v_pool, tables, lens)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = decode_attention_reference(q, k_pool, v_pool, tables, lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@needs_triton
def test_head_dim_not_a_power_of_two_and_a_sliced_query():
    q, k_pool, v_pool, tables, lens = random_decode_batch([2, 11], 4, 6, 3, 24, seed=5)
    q_big = torch.cat([torch.randn_like(q), q])  # [2B, Hq, D]: the decode rows follow other rows
    out = paged_decode_attention_triton(q_big[2:], k_pool, v_pool, tables, lens)
    ref = decode_attention_reference(q, k_pool, v_pool, tables, lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_bad_shapes_are_refused():
    # checked before triton is needed: these hold with or without it
    q, k_pool, v_pool, tables, lens = random_decode_batch([3], 4, 6, 4, 16, seed=6)
    with pytest.raises(ValueError, match="do not split evenly"):
        paged_decode_attention_triton(q, k_pool, v_pool, tables, lens)
    with pytest.raises(ValueError, match="head size"):
        paged_decode_attention_triton(q[..., :8], k_pool, v_pool, tables, lens)
    q, k_pool, v_pool, tables, lens = random_decode_batch([3], 4, 4, 2, 16, seed=6)
    with pytest.raises(ValueError, match="contiguous"):
        q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hq, D], D not contiguous
        paged_decode_attention_triton(q_strided, k_pool, v_pool, tables, lens)


def test_module_imports_without_triton():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"  # as if triton were not installed
        "from minivllm.triton_attention import HAS_TRITON, paged_decode_attention_triton as attend\n"
        "from minivllm.triton_attention import random_decode_batch\n"
        "assert not HAS_TRITON\n"
        "try:\n"
        "    attend(*random_decode_batch([3], 4, 2, 1, 8))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "pip install triton" in res.stdout


def test_empty_batch():
    q, k_pool, v_pool, tables, lens = random_decode_batch([3], 4, 4, 2, 16, seed=7)
    if HAS_TRITON:
        out = paged_decode_attention_triton(q[:0], k_pool, v_pool, tables[:0], lens[:0])
        assert out.shape == (0, 4, 16)
    assert decode_attention_reference(q[:0], k_pool, v_pool, tables[:0], lens[:0]).shape == (0, 4, 16)


COMPILE = """
import os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.triton_attention import _merge_splits_kernel, _paged_decode_kernel

arch, dtype, G, D, BS, split = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:])
p2 = triton.next_power_of_2
sig = {name: f"*{dtype}" for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}
sig |= {"part_ptr": "*fp32", "ml_ptr": "*fp32", "tables_ptr": "*i32", "lens_ptr": "*i64"}
sig |= {name: "i32" for name in ("sq_b", "sq_h", "so_b", "so_h", "skv_n", "skv_t", "skv_h", "st_b", "sl_b")}
sig |= {"scale": "fp32", "blocks_per_split": "i32"}
consts = dict(G=G, D=D, BS=BS, G_P=p2(G), D_P=p2(D), BS_P=p2(BS), SPLIT=bool(split))
sig |= {name: "constexpr" for name in consts}
merge_sig = {"o_ptr": f"*{dtype}", "part_ptr": "*fp32", "ml_ptr": "*fp32", "lens_ptr": "*i64"}
merge_sig |= {name: "i32" for name in ("so_b", "so_h", "sl_b", "blocks_per_split", "num_splits")}
merge_consts = dict(D=D, BS=BS, D_P=p2(D))
merge_sig |= {name: "constexpr" for name in merge_consts}
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for fn, s, c, warps in ((_paged_decode_kernel, sig, consts, 4), (_merge_splits_kernel, merge_sig, merge_consts, 1)):
    kernel = triton.compile(ASTSource(fn, s, constexprs=c), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    os.unlink(f.name)
    print(fn.__name__, re.search(r"REG:\\d+ STACK:\\d+ SHARED:\\d+ LOCAL:\\d+", usage.stdout).group(0))
"""


@needs_triton
@pytest.mark.parametrize("split", [0, 1], ids=["one-pass", "split-K"])
@pytest.mark.parametrize(
    "arch,dtype", [(75, "fp16"), (80, "bf16"), (90, "bf16")], ids=["T4-fp16", "A100-bf16", "H200-bf16"]
)
def test_kernel_compiles_for_a_gpu_without_one(arch, dtype, split):
    # the interpreter runs Python, so it accepts code the compiler refuses. Compile to a cubin for a T4
    # (sm_75, float16), an A100 (sm_80) and an H200 (sm_90) in bfloat16 with triton's own ptxas, at the bundled
    # model's shapes (G=7, D=64, bs=16), both kernels of split-K: no GPU is needed for that
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-c", COMPILE, str(arch), dtype, "7", "64", "16", str(split)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    print(res.stdout)
    assert res.stdout.count("LOCAL:0") == 2, f"registers spill to local memory: {res.stdout}"


LATE_IMPORT = r"""
import os, sys
import pytest, torch
import triton  # as transformers does: before anything set TRITON_INTERPRET
os.environ["TRITON_INTERPRET"] = "1"  # as an earlier notebook of the same worker did: too late
from minivllm.triton_attention import NOT_INTERPRETING, interpreting, paged_decode_attention_triton, random_decode_batch
from minivllm.runner import make_decoder
from minivllm.paged_cache import KVCache
from minivllm.qwen2 import Qwen2Config
assert not interpreting()
with pytest.raises(RuntimeError, match="imported triton without TRITON_INTERPRET"):
    paged_decode_attention_triton(*random_decode_batch([3, 9], 4, 4, 2))
cache = KVCache(Qwen2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
                8, 4, torch.float32, torch.device("cpu"))
with pytest.raises(ValueError, match="imported triton without TRITON_INTERPRET"):
    make_decoder("triton", cache)
print("refused")
"""


@needs_triton
def test_a_process_that_imported_triton_first_is_told_not_misled():
    "The variable set after triton's import (as an earlier notebook's setdefault did) is not taken for the mode."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", LATE_IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "refused" in r.stdout, r.stderr[-3000:]


BOOK_IN_ONE_PROCESS = r"""
import sys
from pathlib import Path
from nbdev.test import test_nb
results = [test_nb(Path(nb).absolute())[0] for nb in sys.argv[1:]]
print("passed:", results)
sys.exit(0 if all(results) else 1)
"""


@needs_triton
def test_notebooks_sharing_a_process_pass_whatever_came_first():
    """nbdev_test runs several notebooks in one worker: 01 imports triton (through transformers) without the
    interpreter, then 08 sets TRITON_INTERPRET=1, then 09 ran the kernel in compiled mode on the CPU and failed."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    nbs = ["01_qwen2.ipynb", "08_triton_attention.ipynb", "09_cuda_graphs.ipynb"]
    r = subprocess.run([sys.executable, "-c", BOOK_IN_ONE_PROCESS, *nbs], env=env, capture_output=True, text=True,
                       timeout=900, cwd=root / "nbs")
    assert r.returncode == 0 and "passed: [True, True, True]" in r.stdout, (r.stdout + r.stderr)[-3000:]


# The prefill kernel: every prompt of a step in one launch, its context read from the pool through its table

def prefill_step(bs, heads, dtype, news, cached, D=16, seed=0, nan_outside=False):
    "Pools with random K/V in every prompt's context (NaN elsewhere if asked), a step's items, q/k/v."
    from minivllm.paged_cache import BlockManager, KVCache
    from minivllm.qwen2 import Qwen2Config

    Hq, Hkv = heads
    g = torch.Generator().manual_seed(seed)
    cfg = Qwen2Config(hidden_size=Hq * D, num_hidden_layers=1, num_attention_heads=Hq, num_key_value_heads=Hkv)
    blocks = sum(-(-(c + n) // bs) for n, c in zip(news, cached)) + 3
    kv, bm = KVCache(cfg, blocks, bs, dtype, torch.device("cpu")), BlockManager(blocks, bs)
    if nan_outside:
        kv.k.fill_(float("nan")), kv.v.fill_(float("nan"))
    items = []
    for n, c in zip(news, cached):
        t = bm.new_table()
        bm.append(t, c + n)
        slots = torch.tensor(t.slots(0, c), dtype=torch.long)  # the cached prefix: K/V already in the pool
        kv.k[0].view(-1, Hkv, D)[slots] = torch.randn(c, Hkv, D, generator=g).to(dtype)
        kv.v[0].view(-1, Hkv, D)[slots] = torch.randn(c, Hkv, D, generator=g).to(dtype)
        items.append((t, c, n))
    q, k, v = (torch.randn(sum(news), h, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    return kv, items, q, k, v


def both_prefills(kv, items, q, k, v):
    "The step's prompts through TritonDecode (the kernel) and the reference backend: the two outputs."
    from minivllm.paged_cache import DecodeAttention, PagedBatch
    from minivllm.triton_attention import TritonDecode

    cpu = torch.device("cpu")
    return [PagedBatch.build(kv, items, len(items), cpu, b).attend(0, q, k, v) for b in (TritonDecode(), DecodeAttention())]


PREFILL_CASES = [(1, (4, 2), torch.float32), (7, (5, 1), torch.float16), (16, (14, 2), torch.bfloat16),
                 (16, (4, 4), torch.float16), (16, (4, 2), torch.float32)]  # (block size, heads, dtype)


@needs_triton
@pytest.mark.parametrize("bs,heads,dtype", PREFILL_CASES, ids=lambda c: str(c))
def test_prefill_kernel_matches_the_reference(bs, heads, dtype):
    # prompts fresh and after a cached prefix (chunked prefill, prefix caching), of 1 to 19 new tokens: more than
    # one tile of 8 or 16 rows, tiles that end inside a prompt, a prompt of one token; tl.dot in float16 at bs 16
    news, cached = [5, 19, 1], [0, 2 * bs + 1, 9]
    out, ref = both_prefills(*prefill_step(bs, heads, dtype, news, cached, seed=bs))
    assert out.dtype == dtype and out.shape == ref.shape == (sum(news), heads[0], 16)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@needs_triton
def test_prefill_kernel_reads_nothing_outside_the_contexts():
    # every slot outside the prompts' contexts holds NaN: one read there and a row turns NaN
    kv, items, q, k, v = prefill_step(4, (4, 2), torch.float32, [6, 3], [5, 0], nan_outside=True)
    out, ref = both_prefills(kv, items, q, k, v)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_triton
def test_prefill_is_one_launch_for_all_prompts(monkeypatch):
    import minivllm.triton_attention as ta

    launches = []
    real = ta.paged_prefill_attention_triton
    monkeypatch.setattr(ta, "paged_prefill_attention_triton", lambda *a, **kw: launches.append(a) or real(*a, **kw))
    out, ref = both_prefills(*prefill_step(16, (4, 2), torch.float16, [9, 20, 3], [0, 16, 7]))
    assert len(launches) == 1 and launches[0][4].tolist() == [[0, 9, 29], [9, 20, 3], [9, 36, 10]]
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
