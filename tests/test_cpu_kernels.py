"""CPU kernels (07_cpu_kernels): int8/int4 linear layers against their dequantized float reference, kernels
chosen per shape, `prepare_linears` and `load_prepared(quantization=...)` on tiny models, and `dtype="auto"`."""
import functools
import ctypes
import json
import logging
import re
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm.cpu_kernels as ck
import minivllm.paged_cache as pc
from minivllm.cpu_kernels import (
    Int4Linear,
    Int8Linear,
    dequantize_int4,
    dequantize_int8,
    int4_group_size,
    int4_supported,
    kernel_candidates,
    prepare_linears,
    quantize_int4,
    quantize_int8,
)
from minivllm.cpu_kernels import packing_supported, PackedLinear
from minivllm.qwen2 import ContiguousKVCache, Qwen2Config, Qwen2ForCausalLM
from minivllm.runner import load_prepared
from minivllm.weights import load_safetensors_model, resolve_dtype

# Float32 kernels against a float32 reference: rounding only. bfloat16 runs: bfloat16 rounding of the outputs.
TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


ROWS4 = (1, 8, 32, 256)  # the made-up timings of these tests are at these row counts (07 times 2 rows too)
plan_at = functools.partial(ck.plan_of, rows=ROWS4)


@pytest.fixture(autouse=True)
def four_timed_row_counts(monkeypatch):
    "Plans chosen from timings at ROWS4 (the head's at its first three), as the made-up timings below are."
    monkeypatch.setattr(ck, "TIME_ROWS", ROWS4)
    monkeypatch.setattr(ck, "HEAD_ROWS", ROWS4[:3])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    "max |a - b| relative to max |b|."
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def tiny(seed=0, dtype=torch.float32, **kw) -> Qwen2ForCausalLM:
    "A tiny random Qwen2 (tied head unless told), with non-zero biases."
    torch.manual_seed(seed)
    cfg = dict(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfg |= dict(num_key_value_heads=2, tie_word_embeddings=True) | kw
    m = Qwen2ForCausalLM(Qwen2Config(**cfg))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return m.to(dtype).eval()


def kinds(layer: nn.Module) -> set[type]:
    "The kernel classes a layer computes with: its own, or those its `RowBuckets` / `ByRows` hold."
    return {type(k) for k in ck.kernels_of(layer)}


def logits(model, ids):
    meta = ContiguousKVCache(model.config.num_hidden_layers).batch([0], [len(ids)])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta))


IDS = torch.randint(0, 261, (33,), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------------------------------------
# dtype auto


def test_dtype_auto_follows_the_cpu():
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32  # exact-parity paths stay float32
    want = torch.bfloat16 if ck.cpu_has_bf16() else torch.float32
    assert resolve_dtype("auto", cpu) == want
    if ck.cpu_flags() & {"amx_bf16", "avx512_bf16"}:
        assert ck.cpu_has_bf16()


# ----------------------------------------------------------------------------------------------------------
# int8 and int4 layers against the dequantized reference


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int8_round_trip_within_half_a_step(n, k, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 3
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((dequantize_int8(q, scale) - w).abs() <= scale[:, None] / 2 + 1e-5).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 64), (40, 48), (1, 7), (896, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_matches_dequantized_reference(dtype, shape, bias):
    out_f, in_f = shape
    lin = nn.Linear(in_f, out_f, bias=bias).to(dtype)
    x = torch.randn(2, 3, in_f).to(dtype)
    ql = Int8Linear.from_linear(lin)
    with torch.no_grad():
        b = None if lin.bias is None else lin.bias.float()
        ref = F.linear(x.float(), dequantize_int8(ql.qweight, ql.scales), b)
        got = ql(x)
    assert got.shape == (2, 3, out_f) and got.dtype == dtype
    assert rel(got, ref) <= TOL[dtype]


def test_int4_group_size_rule():
    assert [int4_group_size(k, 128) for k in (896, 4864, 96, 64, 48, 16)] == [128, 128, 32, 64, None, None]
    assert int4_group_size(896, 32) == 32
    assert int4_supported(128, 896) and not int4_supported(261, 64) and not int4_supported(64, 48)
    with pytest.raises(ValueError, match="out % 16"):
        Int4Linear.from_linear(nn.Linear(64, 261))


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 20), groups=st.integers(1, 4), g=st.sampled_from([32, 64]), seed=st.integers(0, 2**16))
def test_int4_round_trip_no_worse_than_the_first_range(n, groups, g, seed):
    w = torch.randn(n, groups * g, generator=torch.Generator().manual_seed(seed))
    w[0, 0] = 6.0  # an outlier: the refit should tighten its group's steps
    q, scale, zero = quantize_int4(w, g)
    assert q.min() >= 0 and q.max() <= 15
    sq = (dequantize_int4(q, scale, zero) - w).pow(2).reshape(n, groups, g).sum(-1)
    part = w.reshape(n, groups, g)
    lo, hi = part.amin(-1, keepdim=True), part.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    first = (torch.round((part - lo) / step) * step + lo - part).pow(2).sum(-1)  # min to max in 15 steps
    assert (sq <= first * (1 + 1e-5) + 1e-9).all()
    # a flat group (every weight equal) comes back exactly
    flat = torch.full((16, 32), 0.25)
    assert torch.allclose(dequantize_int4(*quantize_int4(flat, 32)), flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,group", [((48, 64), 64), ((32, 96), 64), ((896, 128), 128), ((16, 256), 32)])
def test_int4_linear_matches_dequantized_reference(dtype, shape, group):
    out_f, in_f = shape
    lin = nn.Linear(in_f, out_f).to(dtype)
    x = torch.randn(5, in_f).to(dtype)
    ql = Int4Linear.from_linear(lin, group_size=group)
    assert ql.group_size == int4_group_size(in_f, group)
    q, scale, zero = quantize_int4(lin.weight, ql.group_size)
    with torch.no_grad():
        ref = F.linear(x.float(), dequantize_int4(q, scale.to(dtype), zero.to(dtype)), lin.bias.float())
        got = ql(x)
    assert got.dtype == dtype and rel(got, ref) <= TOL[dtype]
    assert ql.qweight.numel() == out_f * in_f // 2  # two weights a byte


# ----------------------------------------------------------------------------------------------------------
# int8 x int8 on oneDNN, activations split in two bytes


@given(rows=st.integers(1, 5), scale=st.floats(1e-3, 1e3), outlier=st.floats(-500, 500))
@settings(max_examples=30, deadline=None)
def test_split_rows_round_trip(rows, scale, outlier):
    x = torch.randn(rows, 96) * scale
    x[:, 7] = outlier * scale
    parts, s = ck.split_rows(x)
    assert parts.dtype == torch.uint8 and parts.shape == (2 * rows, 96) and s.shape == (rows, 1)
    assert (parts[:rows] >= 1).all() and (parts[rows:] >= 64).all() and (parts[rows:] <= 192).all()
    back = ck.join_rows(parts.float() - 128, s)
    # half a step, plus float32's roundings in x / s and back (each 2^-24 of |x|, up to 32767 steps): a value
    # a hair from a half step may round either way
    assert ((back - x).abs() <= s / 2 + x.abs() * 2**-22 + 1e-30).all()


def test_split_rows_keeps_non_finite_rows_non_finite():
    x = torch.tensor([[1.0, 2.0], [float("nan"), 1.0], [float("inf"), 1.0], [0.0, 0.0]])
    parts, s = ck.split_rows(x)
    assert (parts[[3, 7]] == 128).all()  # a row of zeros: both bytes at zero
    y = ck.join_rows(torch.ones(8, 3), s)
    assert not y[1].isfinite().any() and not y[2].isfinite().any() and y[0].isfinite().all() and y[3].isfinite().all()


@pytest.mark.skipif(not ck.onednn_int8_supported(), reason="no VNNI/AMX int8 product on this CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_f,out_f", [(64, 48), (40, 24), (896, 300)])
def test_onednn_int8_linear_matches_dequantized(dtype, in_f, out_f):
    torch.manual_seed(in_f)
    lin = nn.Linear(in_f, out_f).to(dtype)
    ql = ck.Int8OneDNNLinear.from_linear(lin)
    x = (torch.randn(3, 7, in_f) * 3).to(dtype)
    q, scale = quantize_int8(lin.weight)
    with torch.no_grad():
        ref = F.linear(x.float(), dequantize_int8(q, scale), lin.bias.float())
        got = ql(x)
    assert got.shape == (3, 7, out_f) and got.dtype == dtype
    assert rel(got, ref) <= {torch.float32: 1e-3, torch.bfloat16: 2e-2}[dtype]
    # against the bfloat16 int8 kernel, which rounds the activations to bfloat16: the split is closer
    if dtype == torch.float32 and in_f % 16 == 0:
        bf = Int8Linear(q, scale, lin.bias, torch.bfloat16)
        with torch.no_grad():
            assert rel(got, ref) < rel(bf(x.bfloat16()), ref)


def test_onednn_int8_probe_is_a_bool():
    assert isinstance(ck.onednn_int8_supported(), bool)
    if not ck.cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        assert not ck.onednn_int8_supported()  # without VNNI the u8 x s8 pairs can saturate: never offered


# ----------------------------------------------------------------------------------------------------------
# the LM head's shortlist


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7])
def test_shortlist_head_gives_int8_scores_to_the_best(dtype, bias, rows):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 1024, bias=bias).to(dtype)
    head, int8 = ck.ShortlistHead.from_linear(lin, k=8), Int8Linear.from_linear(lin)
    x = torch.randn(2, rows, 96, dtype=dtype)  # leading dimensions kept
    with torch.no_grad():
        got, want, coarse = head(x), int8(x), head.coarse(x)
    assert got.shape == (2, rows, 1024) and got.dtype == dtype
    got, want, coarse = (t.reshape(-1, 1024).float() for t in (got, want, coarse))
    short = coarse.topk(8, -1).indices  # [2 * rows, 8]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(got.gather(1, short), want.gather(1, short)) <= tol
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, short, False)
    assert torch.equal(got[rest], coarse[rest])  # the others keep int4's scores
    best = want.argmax(-1, keepdim=True)  # [2 * rows, 1] int8's best token
    inside = (best == short).any(-1)  # rows where it made the shortlist: there it is the best, to rounding
    gap = got.amax(-1) - got.gather(1, best)[:, 0]
    assert inside.any() and (gap[inside] <= tol * want.abs().max()).all()
    # the int8 table is read k rows at a time: not a parameter
    assert {n for n, _ in head.named_parameters()} == {f"coarse.{n}" for n, _ in head.coarse.named_parameters()}


def test_shortlist_head_small_vocabulary():
    lin = nn.Linear(64, 16)
    head = ck.ShortlistHead.from_linear(lin, k=64)  # a shortlist longer than the vocabulary: all of it
    assert head.k == 16
    with torch.no_grad():
        x = torch.randn(3, 64)
        assert rel(head(x), Int8Linear.from_linear(lin)(x)) <= 1e-5  # every token scored by int8


def forward_argmax(head, x):
    "What the sampler takes from `head`'s full scores: each row's first best token, None where not finite."
    best, tok = head(x).float().max(-1)
    return [int(t) if torch.isfinite(b) else None for b, t in zip(best, tok)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_shortlist_heads_argmax_is_its_scores_argmax(dtype, bias):
    torch.manual_seed(3)
    lin = nn.Linear(96, 1024, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight[700] = lin.weight[300]  # two tokens that always tie: the first one wins, as `max` has it
        if bias:
            lin.bias[700] = lin.bias[300]
    head = ck.ShortlistHead.from_linear(lin, k=8)
    x = torch.randn(40, 96, dtype=dtype)
    x[5] = lin.weight[300].detach() * 3  # a row whose best is the tied pair
    with torch.no_grad():
        got, want = head.argmax(x), forward_argmax(head, x)
        assert got == want and got[5] == 300
        x[7, 3] = float("nan")  # a row without finite scores: None, as the sampler says
        assert head.argmax(x)[7] is None and forward_argmax(head, x)[7] is None
        head.fine.scales.mul_(1e-3)  # int8's scores far below int4's: every row falls back to the whole row
        assert head.argmax(x[:6]) == forward_argmax(head, x[:6])


def test_the_engine_takes_greedy_tokens_from_the_shortlist_heads_argmax(tiny_folder, monkeypatch):
    from minivllm.engine import LLMEngine, SamplingParams
    from minivllm.weights import Tokenizer

    # the head's int4 shortlists (1.0) beat its int8 kernels (9.0); a vocabulary the int4 kernel takes: 272 = 17 x 16
    fake = dict.fromkeys(("int8", "int8/bf16", "int8/onednn"), [9.0] * 4)
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [1.0] * 4) for n in mods})
    m = tiny(dtype=torch.bfloat16, vocab_size=272, tie_word_embeddings=False)
    prepare_linears(m, "int4")
    assert type(m.lm_head) is ck.ShortlistHead
    eng = LLMEngine(m, Tokenizer.from_folder(tiny_folder), kv_cache_memory=2**24)
    assert eng.runner.argmax == m.lm_head.argmax

    def run() -> list[list[int]]:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        ids = [eng.add_request({"prompt_token_ids": p}, greedy) for p in ([3, 14, 15, 92], [65, 35])]
        done = {}
        while eng.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished}
        return [done[i] for i in ids]

    fast = run()
    eng.runner.argmax = None  # the sampler over the whole scores instead
    assert run() == fast and len(fast[0]) == 12


@pytest.mark.parametrize("one_row", [0.1, 1.05])  # faster at one row, or a tie there that reads fewer bytes
def test_prepared_model_runs_the_shortlist_head_at_one_row(monkeypatch, one_row):
    # the head's plan forced: the shortlist at one row, int8 from 8 rows
    fake = {"int4+int8": [one_row, 9.0, 9.0], "int8": [1.0, 1.0, 1.0]}
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [5.0] * 3) for n in mods})
    m = tiny(dtype=torch.bfloat16, vocab_size=4096, tie_word_embeddings=False)
    plain = Int8Linear.from_linear(m.lm_head)
    report = prepare_linears(m, "int4")
    assert report.choices["4096x64"] == "int4+int8 then int8 from 8 rows"
    head = m.lm_head
    assert type(head) is ck.ByRows and type(head.few) is ck.ShortlistHead and type(head.many) is Int8Linear
    assert m.lm_head.weight.dtype == torch.bfloat16  # still answers the dtype
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(head(x).argmax(-1), head.few(x).argmax(-1))
        assert rel(head(x).float().amax(-1), plain(x).float().amax(-1)) <= 1e-2  # the best score: int8's
        ids = torch.randint(0, 4096, (1,))
        meta = ContiguousKVCache(2).batch([0], [1])
        assert m.compute_logits(m(ids, torch.arange(1), meta)).shape == (1, 4096)


# ----------------------------------------------------------------------------------------------------------
# int4 weights x int8 activations: our C kernels, on AVX-512 VNNI and AVX2

OURS = ck.int4_int8_supported(80, 96)  # the ones this CPU runs, best first
NO_OURS = "neither AVX-512 VNNI nor AVX2 here, or no C compiler"
ISAS = OURS or [pytest.param("vnni", marks=pytest.mark.skip(reason=NO_OURS))]


def int4_int8_reference(x, q, scale, zero, bias) -> torch.Tensor:
    "The kernels' arithmetic in float64: activations rounded to int8 per group of 32, scales in bfloat16."
    groups = x.float().reshape(x.shape[0], -1, 32)  # [M, G, 32]
    amax = groups.abs().amax(-1)
    levels = torch.round(groups * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))[..., None]).double()
    d = (amax / 127).double()  # [M, G]
    n, k = q.shape
    dots = torch.einsum("mgk,ngk->mng", levels, q.double().reshape(n, k // 32, 32))  # [M, N, G]
    s, m = scale.bfloat16().double(), (zero - 8 * scale).bfloat16().double()
    y = (dots * s * d[:, None]).sum(-1) + (levels.sum(-1) * d) @ m.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_int8_matches_its_arithmetic(isa, dtype, rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 80, bias=bias)  # 5 blocks of 16 channels (unequal shares for two threads), 3 groups
    q, scale, zero = quantize_int4(lin.weight, 32)
    layer = ck.Int4Int8Linear(q, scale, zero, lin.bias, isa)
    x = torch.randn(rows, 96).to(dtype)
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    want = int4_int8_reference(x, q, scale, zero, lin.bias)
    if dtype == torch.float32:
        assert rel(got, want) <= 1e-5
    else:  # the kernel rounds its float32 result once: within a bfloat16 rounding of the exact one
        assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    exact = F.linear(x.float(), dequantize_int4(q, scale, zero), lin.bias)
    assert rel(got, exact) <= 0.03  # what the int8 activations cost on top of the int4 weights


@pytest.mark.skipif(len(OURS) < 2, reason="this CPU runs fewer than two of our int4 kernels")
def test_int4_int8_kernels_agree_exactly():
    lin = nn.Linear(128, 64)
    x = torch.randn(11, 128)
    with torch.no_grad():  # the same integer sums and the same float steps in the same order: the same bits
        outs = [ck.Int4Int8Linear.from_linear(lin, isa=isa)(x) for isa in OURS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("isa", ISAS)
def test_int4_int8_shapes_and_other_dtypes(isa):
    lin = nn.Linear(64, 32)
    layer = ck.Int4Int8Linear.from_linear(lin, isa=isa)
    with torch.no_grad():
        x = torch.randn(2, 3, 64)
        assert layer(x).shape == (2, 3, 32)
        assert layer(torch.randn(0, 64)).shape == (0, 32)
        half = layer(x.half())  # float16 goes through float32 and comes back float16
        assert half.dtype == torch.float16 and rel(half, layer(x)) <= 1e-2  # x rounded to float16 first
        assert rel(layer(x[:, :1].contiguous()), layer(x)[:, :1]) <= 1e-6  # a row is computed alike alone
        strided = x.transpose(0, 1)  # not contiguous
        assert torch.equal(layer(strided), layer(strided.contiguous()))


def test_int4_int8_refuses_other_groups_shapes_and_kernels():
    with pytest.raises(ValueError, match="groups of 32"):
        ck.Int4Int8Linear.from_linear(nn.Linear(128, 48), group_size=64)
    q, scale, zero = quantize_int4(torch.randn(40, 64), 32)
    with pytest.raises(ValueError, match="out % 16"):
        ck.Int4Int8Linear(q, scale, zero, None)
    q, scale, zero = quantize_int4(torch.randn(48, 64), 32)
    with pytest.raises(ValueError, match="no int4 kernel 'sse'"):
        ck.Int4Int8Linear(q, scale, zero, None, "sse")


FAMILY_LIBRARIES = (ck.int4_library, ck.f32_library, ck.norm_library, ck.head_library)


@pytest.fixture
def fresh_int4(monkeypatch, tmp_path):
    "Our C library asked anew by every family, with its cache in tmp_path; forgotten again afterwards."
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    for library in FAMILY_LIBRARIES:
        library.cache_clear()
    yield tmp_path
    for library in FAMILY_LIBRARIES:
        library.cache_clear()


def built(cache) -> list:
    return sorted((cache / "kernels").glob("*")) if (cache / "kernels").exists() else []


def passed_here() -> set[str]:
    "The self-tests (`kind:isa`) kept as passed for our C library on this CPU (as `cpu_flags` says it is)."
    return ck.passed_selftests(ck.c_library(ck.c_compiler()))


def corrupt(monkeypatch, folder, file: str, old: str, new: str) -> None:
    "Our C sources copied into `folder` with `old` replaced by `new` in `file`; the builder reads that copy."
    src = folder / "csrc"
    shutil.copytree(ck.CSRC, src)
    text = (src / file).read_text()
    assert text.count(old) == 1
    (src / file).write_text(text.replace(old, new))
    monkeypatch.setattr(ck, "CSRC", src)


def test_int4_int8_not_offered_without_the_flags(monkeypatch, fresh_int4):
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"sse2", "avx"})
    assert ck.int4_library() is None and ck.int4_int8_supported(48, 64) == []
    assert list(kernel_candidates(nn.Linear(64, 48).bfloat16(), "int4")) == ["int4"]
    assert built(fresh_int4) == []  # nothing compiled


@pytest.mark.skipif("avx2" not in OURS, reason="this CPU has no AVX2 or there is no C compiler")
def test_int4_int8_on_a_cpu_with_avx2_only(monkeypatch, fresh_int4):
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"avx", "avx2", "fma"})  # an AVX2-only CPU, as Zen 3
    assert ck.int4_int8_supported(48, 64) == ["avx2"]
    assert list(kernel_candidates(nn.Linear(64, 48).bfloat16(), "int4")) == ["int4", "int4/avx2"]
    assert passed_here() == {"int4:avx2"}  # self-tested for AVX2 alone


@pytest.mark.parametrize("cc", ["no-such-compiler", "false"])
def test_int4_int8_without_a_working_compiler(monkeypatch, fresh_int4, caplog, cc):
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert ck.int4_library() is None
    assert "our int4 kernels are not candidates" in caplog.text or "no C compiler" in caplog.text
    assert not [f for f in built(fresh_int4) if f.suffix == ".so"]


@pytest.mark.skipif(not OURS, reason=NO_OURS)
def test_int4_int8_built_once_into_the_cache(fresh_int4, caplog):
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert ck.int4_library() is not None
    assert "built our C kernels" in caplog.text and "our int4 kernels passed their self-tests" in caplog.text
    first = built(fresh_int4)
    assert sorted(f.suffix for f in first) == [".passed", ".so"]  # the library and its tests, nothing else
    ck.int4_library.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert ck.int4_library() is not None  # as a new process would: loaded from the cache, not built
    assert "built" not in caplog.text and "self-tests" not in caplog.text and built(fresh_int4) == first


@pytest.mark.skipif(not OURS, reason=NO_OURS)
def test_int4_int8_self_test_turns_down_a_wrong_build(monkeypatch, fresh_int4, caplog):
    corrupt(monkeypatch, fresh_int4, "linear_int4.c", "q << 4", "q << 5")  # the self-test's own packing
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert ck.int4_library() is None
    assert "our int4 kernels are not candidates: its self-test failed (exit status 1)" in caplog.text
    assert ck.norm_library() is not None  # the other families of the one library still serve
    assert not [t for t in passed_here() if t.startswith("int4:")]  # not kept as passed
    ck.int4_library.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert ck.int4_library() is None  # the next start tries again, on the library already built
    assert "self-test failed" in caplog.text and "built" not in caplog.text


@pytest.mark.skipif(not OURS, reason=NO_OURS)
def test_prepared_model_runs_our_int4_kernel(monkeypatch):
    fake = {f"int4/{OURS[-1]}": [0.1, 0.1, 0.1]}
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [5.0] * 3) for n in mods})
    ref = tiny(dtype=torch.bfloat16)
    m = tiny(dtype=torch.bfloat16)
    report = prepare_linears(m, "int4")
    assert report.choices["128x64"] == f"int4/{OURS[-1]}"
    layer = m.model.layers[0].mlp.gate_proj
    assert kinds(layer) == {ck.Int4Int8Linear} and layer.isa == OURS[-1]
    assert rel(logits(m, IDS), logits(ref, IDS)) <= 0.15  # int4 weights: close, not equal


# ----------------------------------------------------------------------------------------------------------
# float32: our register-tiled kernels, on AVX-512 and AVX2

F32_OURS = ck.f32_supported(16)
F32_ISAS = F32_OURS or [pytest.param("avx512", marks=pytest.mark.skip(reason="no AVX-512 or AVX2, or no C compiler"))]


def f32_bound(x, w, b) -> torch.Tensor:
    "What float32 rounding may cost: about K * 2^-24 of the sum of |products| (plus the bias)."
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    return (x.shape[-1] + 2) * 2**-24 * mag + 1e-30


@pytest.mark.parametrize("isa", F32_ISAS)
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_f32_is_float32_arithmetic(isa, rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(300, 80, bias=bias)  # a panel of 4 blocks of 16 and a lone block; K not a multiple of 16
    x = torch.randn(rows, 300)
    with torch.no_grad():
        got = ck.F32Linear.from_linear(lin, isa)(x)
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    assert ((got.double() - want).abs() <= f32_bound(x, lin.weight, lin.bias)).all()


@pytest.mark.skipif(len(F32_OURS) < 2, reason="this CPU runs fewer than two of our float32 kernels")
def test_f32_kernels_agree_exactly():
    lin = nn.Linear(200, 96)
    x = torch.randn(9, 200)
    with torch.no_grad():  # the same products added in the same order: the same bits
        outs = [ck.F32Linear.from_linear(lin, isa)(x) for isa in F32_OURS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("isa", F32_ISAS)
def test_f32_shapes_and_other_dtypes(isa):
    lin = nn.Linear(64, 32)
    layer = ck.F32Linear.from_linear(lin, isa)
    with torch.no_grad():
        x = torch.randn(2, 3, 64)
        assert layer(x).shape == (2, 3, 32) and layer(torch.randn(0, 64)).shape == (0, 32)
        assert torch.equal(layer(x[:, :1].contiguous()), layer(x)[:, :1])  # a row alone: the same bits
        strided = x.transpose(0, 1)
        assert torch.equal(layer(strided), layer(strided.contiguous()))
        half = layer(x.bfloat16())  # other dtypes go through float32 and come back
        assert half.dtype == torch.bfloat16 and rel(half, layer(x)) <= 2e-2


def test_f32_refuses_other_shapes_and_kernels():
    with pytest.raises(ValueError, match="out % 16"):
        ck.F32Linear.from_linear(nn.Linear(64, 40))
    with pytest.raises(ValueError, match="no float32 kernel 'sse'"):
        ck.F32Linear.from_linear(nn.Linear(64, 48), "sse")
    assert ck.f32_supported(40) == []
    assert not any(n.startswith("f32/") for n in kernel_candidates(nn.Linear(64, 40)))


def test_f32_not_offered_without_the_flags(monkeypatch, fresh_int4):
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"sse2", "avx"})
    assert ck.f32_library() is None and ck.f32_supported(48) == []
    assert not any(n.startswith("f32/") for n in kernel_candidates(nn.Linear(64, 48)))
    assert built(fresh_int4) == []


@pytest.mark.skipif("avx2" not in F32_OURS, reason="this CPU has no AVX2 or there is no C compiler")
def test_f32_on_a_cpu_with_avx2_only(monkeypatch, fresh_int4):
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"avx", "avx2", "fma"})
    assert ck.f32_supported(48) == ["avx2"]
    assert [n for n in kernel_candidates(nn.Linear(64, 48)) if n.startswith("f32/")] == ["f32/avx2"]
    assert passed_here() == {"f32:avx2"}  # self-tested for AVX2 alone


def test_kernels_this_cpu_lacks_are_refused_not_run(monkeypatch):
    "On an AVX2-only CPU, asking for an AVX-512 kernel is a clear error (running it would kill the process)."
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"avx", "avx2", "fma"})
    lin = nn.Linear(64, 48)
    with pytest.raises(ValueError, match="cannot run our float32 kernel 'avx512': it lacks avx512f"):
        ck.F32Linear.from_linear(lin, "avx512")
    with pytest.raises(ValueError, match="cannot run our int4 kernel 'vnni'"):
        ck.Int4Int8Linear.from_linear(lin, isa="vnni")
    assert ck.F32Linear.from_linear(lin).isa == "avx2"  # no isa named: the best this CPU runs
    assert ck.Int4Int8Linear.from_linear(lin).isa == "avx2"
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"sse2"})
    with pytest.raises(ValueError, match="runs none of our float32 kernels"):
        ck.F32Linear.from_linear(lin)


@pytest.mark.skipif(not F32_OURS, reason="no AVX-512 or AVX2, or no C compiler")
def test_f32_built_once_and_a_wrong_build_turned_down(monkeypatch, fresh_int4, caplog):
    with caplog.at_level(logging.INFO, logger="minivllm"):
        assert ck.f32_library() is not None
    assert "built our C kernels" in caplog.text and "our f32 kernels passed their self-tests" in caplog.text
    assert {t for t in passed_here() if t.startswith("f32:")} == {f"f32:{isa}" for isa in F32_OURS}
    ck.f32_library.cache_clear()
    corrupt(monkeypatch, fresh_int4, "linear_f32.c", "% 11 - 5) / 8. *", "% 11 - 4) / 8. *")  # its reference
    assert ck.f32_library() is None and "our f32 kernels are not candidates: its self-test failed" in caplog.text
    assert not [t for t in passed_here() if t.startswith("f32:")]  # a new library: nothing passed for it


@pytest.mark.skipif(not F32_OURS, reason="no AVX-512 or AVX2, or no C compiler")
def test_prepared_model_runs_our_f32_kernel(monkeypatch):
    fake = {f"f32/{F32_OURS[-1]}": [0.1, 0.1, 0.1]}
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [5.0] * 3) for n in mods})
    ref, m = tiny(), tiny()
    report = prepare_linears(m)
    assert report.choices["128x64"] == f"f32/{F32_OURS[-1]}"
    assert kinds(m.model.layers[0].mlp.gate_proj) == {ck.F32Linear}
    assert not report.choices["261x64"].startswith("f32/")  # 261 outputs, not a multiple of 16: not ours
    assert rel(logits(m, IDS), logits(ref, IDS)) <= 1e-5  # float32 both: roundings apart


# ----------------------------------------------------------------------------------------------------------
# candidates and the choice


def test_candidates_per_format():
    lin = nn.Linear(64, 48)
    float_names = set(kernel_candidates(lin))
    assert ("onednn" in float_names) == packing_supported(torch.float32) and len(float_names) >= 1
    assert len(kernel_candidates(lin, pack=False)) == 1
    assert [n for n in kernel_candidates(lin) if n.startswith("f32/")] == [f"f32/{isa}" for isa in F32_OURS]
    assert not any(n.startswith("f32/") for n in kernel_candidates(nn.Linear(64, 48).bfloat16()))  # float32 only
    if packing_supported(torch.float32):
        assert list(kernel_candidates(lin, pack=True)) == ["onednn"]  # pack says which: ours not asked
    onednn = ["int8/onednn"] if ck.onednn_int8_supported() else []  # int8 x int8 where VNNI or AMX
    assert list(kernel_candidates(lin, "int8")) == ["int8", "int8/bf16", *onednn]  # float32: bf16 compute too
    ours = [f"int4/{isa}" for isa in OURS]  # our int4 x int8 kernels, where the CPU has VNNI or AVX2
    assert list(kernel_candidates(lin.bfloat16(), "int4")) == ["int4", *ours]
    assert list(kernel_candidates(nn.Linear(64, 48), "int4")) == ["int4", "int4/bf16", *ours]
    assert list(kernel_candidates(lin.bfloat16(), "int4", group_size=64)) == ["int4"]  # groups of 64: not VNNI's
    assert list(kernel_candidates(nn.Linear(64, 40), "int4")) == ["int8", "int8/bf16", *onednn]  # refused: int8
    # the LM head, int8: the int4 shortlist too, where the int4 kernel takes the shape
    shortlists = ["int4+int8", *(f"{name}+int8" for name in ours)]
    assert list(kernel_candidates(nn.Linear(64, 48), "int8", head=True)) == ["int8", "int8/bf16", *onednn, *shortlists]
    assert "int4+int8" not in kernel_candidates(nn.Linear(64, 40), "int8", head=True)
    assert "int4+int8" not in kernel_candidates(nn.Linear(64, 48), head=True)  # a float head: float kernels
    if not packing_supported(torch.bfloat16):
        with pytest.raises(ValueError, match="oneDNN cannot pack bfloat16"):
            kernel_candidates(lin.bfloat16(), pack=True)


def test_choice_is_the_fastest_measured(monkeypatch):
    fake = {"int8": [3.0, 4.0, 5.0], "int8/bf16": [1.0, 2.0, 3.0]}
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [9.0] * 3) for n in mods})
    plan, secs, mods = ck.choose_kernel(nn.Linear(64, 48), "int8")
    assert plan == [(1, "int8/bf16")] and secs["int8"] == fake["int8"] and set(mods) == set(secs)
    fake = {"int8": [0.5, 4.0, 9.0], "int8/bf16": [1.0, 2.0, 3.0]}  # one wins at one row, the other at 8 and 32
    assert ck.choose_kernel(nn.Linear(64, 48), "int8")[0] == [(1, "int8"), (8, "int8/bf16")]
    assert ck.choose_kernel(nn.Linear(64, 48), "int8", two=False)[0] == [(1, "int8/bf16")]  # least summed
    plan, secs, mods = ck.choose_kernel(nn.Linear(64, 48), pack=False)
    assert secs == {} and len(mods) == 1  # one candidate: nothing timed


def test_a_tie_at_one_row_goes_to_fewer_bytes():
    secs = {"a": [1.0, 2.0, 3.0], "b": [1.05, 1.0, 1.0], "c": [2.0, 9.0, 9.0]}
    assert plan_at(secs) == [(1, "b")]  # a tie at one row: the batch's winner, one layout
    assert plan_at(secs, nbytes={"a": 10, "b": 20, "c": 1}) == [(1, "a"), (8, "b")]  # c is no tie: too slow
    assert plan_at(secs, nbytes={"a": 20, "b": 20, "c": 1}) == [(1, "b")]  # same bytes: the batch's winner
    assert plan_at(secs, nbytes={"a": 10, "b": 20}, two=False) == [(1, "b")]  # one layout: least time summed
    assert plan_at({"a": [1.0, 1.0, 9.0], "b": [1.05, 2.0, 1.0]}, nbytes={"a": 1, "b": 2}) == [(1, "a"), (32, "b")]
    lin = nn.Linear(64, 48)
    assert ck.weight_bytes(Int8Linear.from_linear(lin)) == 64 * 48 + 2 * 48 * 4  # int8 weights, float32 scales, bias
    assert ck.weight_bytes(ck.ShortlistHead.from_linear(lin)) == ck.weight_bytes(Int4Linear.from_linear(lin))


def test_time_kernels_gives_every_candidate_a_score():
    lin = nn.Linear(64, 2000)
    mods = {n: make(lin) for n, make in kernel_candidates(lin, "int8").items()}
    secs = ck.time_kernels(mods, 64, torch.float32, ck.TIME_ROWS)
    assert {"int8", "int8/bf16"} <= set(secs) and all(len(v) == len(ck.TIME_ROWS) for v in secs.values())
    assert all(0 < min(v[i] for v in secs.values()) < float("inf") for i in range(len(ck.TIME_ROWS)))


def test_two_layouts_by_rows():
    torch.manual_seed(0)
    m = tiny()
    x = torch.randn(40, 64)
    ref = {r: m.model.layers[0].mlp.up_proj(x[:r]) for r in (1, 40)}
    plan = [(1, "int8"), (8, "mkl")]
    mods = {"int8": ck.Int8Linear.from_linear(m.model.layers[0].mlp.up_proj), "mkl": m.model.layers[0].mlp.up_proj}
    layer = ck._build(plan, mods, torch.float32)  # MKL's float32 GEMM: exact row counts
    assert type(layer) is ck.ByRows and layer.rows == 8 and layer.many is mods["mkl"]
    assert [n for n, _ in layer.named_parameters()] == ["few.qweight", "few.scales"]  # the second layout: not counted
    with torch.no_grad():
        assert rel(layer(x[:1]), ref[1]) <= 0.03 and (layer(x[:1]) != ref[1]).any()  # 1 row: int8
        assert torch.equal(layer(x), ref[40])  # 40 rows: the float layer itself
    m2 = tiny()
    report = prepare_linears(m2, "int8", two_layouts=False)
    assert not any(type(x) is ck.ByRows for x in m2.modules()) and "then" not in report.line


def test_a_plan_of_three_kernels_is_a_chain_of_two_layouts(monkeypatch):
    torch.manual_seed(0)
    lin = tiny().model.layers[0].mlp.up_proj
    x = torch.randn(40, 64)
    mods = {"mkl": lin, "int8": ck.Int8Linear.from_linear(lin)}
    layer = ck._build([(1, "mkl"), (8, "int8"), (32, "mkl")], mods, torch.float32)
    assert type(layer) is ck.ByRows and type(layer.many) is ck.ByRows and layer.many.many is lin
    assert ck.kernels_of(layer) == [lin, mods["int8"], lin]
    assert [n for n, _ in layer.named_parameters()] == ["few.weight"]  # the int8 layout: held outside
    with torch.no_grad():
        for rows, used in ((1, lin), (7, lin), (8, mods["int8"]), (31, mods["int8"]), (32, lin), (40, lin)):
            assert torch.equal(layer(x[:rows]), used(x[:rows]))
    # int8 and int8/bf16 read one copy of the int8 weights; int8/onednn its own: a plan of four kernels, two layouts
    secs = {"int8": [1.0, 9.0, 9.0, 9.0], "int8/bf16": [3.0, 1.0, 9.0, 1.0], "int8/onednn": [5.0, 5.0, 1.0, 5.0]}
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: secs[n] for n in mods})
    plan, _, got = ck.choose_kernel(nn.Linear(64, 48), "int8")
    if "int8/onednn" in got:
        assert plan == [(1, "int8"), (8, "int8/bf16"), (32, "int8/onednn"), (256, "int8/bf16")]
    assert ck.layout_of(got["int8"]) == ck.layout_of(got["int8/bf16"])
    assert plan_at(secs) == [(1, "int8"), (8, "int8/bf16")]  # each its own layout: no third


# ----------------------------------------------------------------------------------------------------------
# whole models


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measured_float_kernels_keep_the_logits(dtype):
    ref = logits(tiny(dtype=dtype), IDS)
    m = tiny(dtype=dtype)
    report = prepare_linears(m)
    kernels = (nn.Linear, PackedLinear, ck.F32Linear, ck.ByRows, ck.RowBuckets)
    assert all(type(x) in kernels + (ck.GreedyHead,) for x in m.modules() if hasattr(x, "in_features"))
    assert rel(logits(m, IDS), ref) <= {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    greedy = {"261x64 greedy"} if dtype == torch.float32 and ck.head_library() is not None else set()
    assert set(report.choices) == {"64x64", "32x64", "128x64", "64x128", "261x64"} | greedy
    bucketed = [k for x in m.modules() if type(x) is ck.RowBuckets for k in ck.kernels_of(x)]
    assert all(any(k is x for k in bucketed) for x in m.modules() if type(x) is PackedLinear)  # oneDNN: bucketed


def test_onednn_layers_meet_only_bucketed_row_counts(monkeypatch):
    ref, m = tiny(), tiny()
    prepare_linears(m, pack=True)  # oneDNN for every layer: each builds code per row count it meets
    layers = [x for x in m.modules() if hasattr(x, "in_features") and type(x) is not PackedLinear]
    assert layers and all(type(x) is ck.RowBuckets and kinds(x) == {PackedLinear} for x in layers)
    seen = set()
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: seen.add(x.numel() // self.in_features) or forward(self, x))
    for n in (1, 5, 9, 17, 23, 37, 61):
        ids = torch.randint(0, 261, (n,))
        assert rel(logits(m, ids), logits(ref, ids)) <= 1e-5  # padding rows never reach a real row's result
    assert seen == {ck.row_bucket(n) for n in (1, 5, 9, 17, 23, 37, 61)} == {1, 5, 10, 20, 24, 40, 64}


@pytest.mark.parametrize("quantization,limit", [("int8", 0.03), ("int4", 0.15)])
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_model_close_to_float(quantization, limit, tied, caplog):
    ref = logits(tiny(tie_word_embeddings=tied), IDS)
    m = tiny(tie_word_embeddings=tied)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        report = prepare_linears(m, quantization)
    got = logits(m, IDS)
    assert rel(got, ref) <= limit
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    int8 = {Int8Linear, ck.Int8OneDNNLinear}
    layers = {Int4Linear, ck.Int4Int8Linear} if quantization == "int4" else int8
    assert kinds(m.model.layers[0].mlp.down_proj) <= layers and kinds(m.model.layers[1].self_attn.k_proj) <= layers
    # an int8 head, tied or not; the embedding keeps the float table, and `weight` still answers the dtype
    assert kinds(m.lm_head) <= int8 and m.lm_head.weight.dtype == torch.float32
    assert m.lm_head.weight.shape == m.model.embed_tokens.weight.shape
    assert all(p is not m.lm_head.weight for p in m.parameters())
    assert m.model.embed_tokens.weight.dtype == torch.float32
    assert f"linear kernels (cpu, float32, {quantization})" in caplog.text and "261x64" in caplog.text
    assert report.line in caplog.text


def test_quantized_bfloat16_model_and_bytes():
    from minivllm.bench import decode_bytes_per_step

    bf = tiny(dtype=torch.bfloat16, vocab_size=4096)
    ref = logits(bf, IDS)
    sizes = {None: decode_bytes_per_step(bf)}
    for q in ("int8", "int4"):
        m = tiny(dtype=torch.bfloat16, vocab_size=4096)
        prepare_linears(m, q)
        assert rel(logits(m, IDS), ref) <= 0.15
        sizes[q] = decode_bytes_per_step(m)
    assert sizes[None] > sizes["int8"] > sizes["int4"]


def test_unknown_quantization_refused(tiny_folder):
    with pytest.raises(ValueError, match="use int8 or int4"):
        prepare_linears(tiny(), "fp8")
    with pytest.raises(ValueError, match="use int8 or int4"):
        load_prepared(tiny_folder, quantization="q4_k")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_load_model_quantizes_and_the_engine_runs(tiny_folder, quantization):
    from minivllm.engine import LLMEngine, SamplingParams

    plain = load_safetensors_model(tiny_folder, "float32", "cpu")
    m, tok = load_prepared(tiny_folder, "float32", "cpu", quantization=quantization)
    assert rel(logits(m, IDS), logits(plain, IDS)) <= 0.15
    assert any(type(x) in (Int8Linear, Int4Linear, ck.Int8OneDNNLinear) for x in m.modules())
    eng = LLMEngine(m, tok, num_kv_blocks=16)
    assert eng.cache.k.dtype == torch.float32  # the KV cache in the activations' dtype, not int8
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 5


def test_load_model_gguf_quantized(tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_qwen2 import tiny_hf, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(0), "Q8_0")
    plain, _ = load_prepared(path, "float32", "cpu", pack=False)
    m, _ = load_prepared(path, "float32", "cpu", quantization="int8")
    assert kinds(m.model.layers[0].mlp.gate_up_proj) <= {Int8Linear, ck.Int8OneDNNLinear}  # merged at load
    assert m.model.layers[0].mlp.up_proj is None and m.model.layers[0].self_attn.q_proj is None
    assert rel(logits(m, IDS % 256), logits(plain, IDS % 256)) <= 0.03
    assert gguf is not None


def test_report_is_json_friendly():
    r = prepare_linears(tiny(), "int8")
    assert json.loads(json.dumps(r.choices)) == r.choices and r.seconds_building >= 0


# ----------------------------------------------------------------------------------------------------------
# the greedy head: float32's arg-max from a bfloat16 pass

needs_head = pytest.mark.skipif(ck.head_library() is None, reason="no C compiler for the head's shortlist")


def full_argmax(head: nn.Module, x: torch.Tensor) -> list[int | None]:
    "The arg-max of the full float32 logits, None where the row's largest is not finite."
    with torch.no_grad():
        best, idx = head(x).float().max(-1)
    return [i if ok else None for i, ok in zip(idx.tolist(), torch.isfinite(best).tolist())]


@needs_head
@pytest.mark.parametrize("kernel", ["linear", "f32"])
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.01, 1.0, 30.0, 1e3]), k=st.sampled_from([1, 4, 16]))
@settings(max_examples=15, deadline=None)
def test_greedy_head_gives_the_logits_argmax(kernel, seed, scale, k):
    torch.manual_seed(seed)
    lin = nn.Linear(96, 1040, bias=False)
    if kernel == "f32":
        if not ck.f32_supported(1040):
            pytest.skip("no float32 kernel of ours here")
        lin = ck.F32Linear.from_linear(lin)
    head = ck.GreedyHead(lin, k=k)
    x = torch.randn(37, 96) * scale
    x[3] = 0.0  # every token ties: the shortlist overflows, the logits answer (the first token)
    x[4, 7] = float("nan")  # not finite: None
    x[5, 2] = float("inf")
    got, want = head.argmax(x), full_argmax(lin, x)
    assert got[3] == 0 and got[4] is None and got[5] is None
    assert got == want


@needs_head
def test_greedy_head_takes_the_logits_for_what_its_shortlist_cannot_settle(monkeypatch):
    torch.manual_seed(0)
    lin = nn.Linear(32, 300, bias=False)
    with torch.no_grad():
        lin.weight[17] = lin.weight[200]  # tokens 17 and 200 always tie exactly
    head = ck.GreedyHead(lin, k=1)
    calls = []
    forward = lin.forward
    monkeypatch.setattr(lin, "forward", lambda x: calls.append(len(x)) or forward(x))
    x = torch.randn(6, 32)
    got = head.argmax(x)
    assert got == full_argmax(lin, x)
    tied = [i for i, t in enumerate(got) if t == 17]  # where the pair wins, the first of the two is the answer
    assert sum(calls) >= len(tied) and all(t != 200 for t in got)
    head.from_rows = 7  # fewer rows than that: the logits, for every row
    calls.clear()
    assert head.argmax(x) == got and calls == [6]


def test_greedy_head_refuses_a_head_it_cannot_read():
    with pytest.raises(ValueError, match="float32 head without a bias"):
        ck.GreedyHead(nn.Linear(16, 32))  # a bias
    with pytest.raises(ValueError, match="float32 head without a bias"):
        ck.GreedyHead(nn.Linear(16, 32, bias=False).bfloat16())


@needs_head
@pytest.mark.parametrize("wins,start", [([1.0, 1.0, 1.0], None), ([2.0, 0.5, 0.5], 8), ([0.5, 2.0, 0.5], 32)])
def test_use_greedy_head_follows_the_timing(monkeypatch, wins, start):
    def timed(mods, *a, **k):  # greedy's seconds: `wins` times the logits' (1 ms)
        assert set(mods) == {"logits", "greedy"}
        return {"logits": [1e-3] * 3, "greedy": [w * 1e-3 for w in wins]}

    m = tiny()
    monkeypatch.setattr(ck, "time_kernels", timed)
    report = ck.KernelReport(torch.float32, None)
    ck.use_greedy_head(m, report)
    assert report.choices["261x64 greedy"] == (f"bf16 shortlist from {start} rows" if start else "logits")
    assert (type(m.lm_head) is ck.GreedyHead) == (start is not None)
    if start is not None:
        assert m.lm_head.from_rows == start and ck.kernels_of(m.lm_head) == [m.lm_head.inner]
    for q in ("int8", None):  # quantized, or a bfloat16 model: left alone
        other = tiny(dtype=torch.bfloat16 if q is None else torch.float32)
        ck.use_greedy_head(other, ck.KernelReport(other.lm_head.weight.dtype, q))
        assert type(other.lm_head) is nn.Linear


def greedy_engine(tiny_folder, monkeypatch=None):
    "An engine on the tiny model in float32 whose head is a `GreedyHead` (from 1 row)."
    from minivllm.engine import LLMEngine

    m, tok = load_prepared(tiny_folder, "float32", "cpu", pack=False)
    m.lm_head = ck.GreedyHead(m.lm_head)
    m.lm_head.weight = m.lm_head.inner.weight
    return LLMEngine(m, tok, num_kv_blocks=256, block_size=4)


@needs_head
def test_the_engine_takes_greedy_steps_through_the_head_and_gives_the_same_tokens(tiny_folder, monkeypatch):
    from minivllm.engine import LLMEngine, ModelRunner, SamplingParams

    plain_model, tok = load_prepared(tiny_folder, "float32", "cpu", pack=False)
    eng, plain = greedy_engine(tiny_folder), LLMEngine(plain_model, tok, num_kv_blocks=256, block_size=4)
    steps = {"argmax": 0, "logits": 0}
    for name in ("run_argmax", "run"):
        f = getattr(ModelRunner, name)
        key = "argmax" if name == "run_argmax" else "logits"
        monkeypatch.setattr(ModelRunner, name, lambda self, b, f=f, key=key: steps.__setitem__(key, steps[key] + 1) or f(self, b))
    prompts = [[1, 2, 3], [5, 9, 11, 4, 4, 8], [7] * 13]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for e in (eng, plain):
        ids = [e.add_request({"prompt_token_ids": p}, greedy) for p in prompts]
        done = {}
        while e.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0].token_ids for o in e.step() if o.finished}
        outs[e is eng] = [done[i] for i in ids]
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])
    assert steps["argmax"] > 0
    # a row with logprobs (or sampled) in the step: the whole step takes the logits
    steps.update(argmax=0, logits=0)
    eng.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    while eng.has_unfinished_requests():
        got = [o for o in eng.step() if o.finished]
    assert steps == {"argmax": 0, "logits": 4} and len(got[0].outputs[0].logprobs) == 4


@needs_head
def test_a_non_finite_greedy_row_fails_only_its_request(tiny_folder, monkeypatch):
    from minivllm.engine import ModelRunner, SamplingParams

    eng = greedy_engine(tiny_folder)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad, good = (eng.add_request({"prompt_token_ids": ids}, p) for ids in ([1, 2, 3], [4, 5, 6]))
    hidden = ModelRunner.sample_hidden

    def spoil(self, batch, feed=None):
        h = hidden(self, batch, feed).clone()
        for i, s in enumerate(batch.sampling):
            if s.request_id == bad and s.num_output_tokens >= 2:
                h[i] = float("nan")
        return h

    monkeypatch.setattr(ModelRunner, "sample_hidden", spoil)
    finals = {}
    while eng.has_unfinished_requests():
        finals |= {o.request_id: o for o in eng.step() if o.finished}
    assert finals[bad].outputs[0].finish_reason == "error" and "not finite" in finals[bad].error
    assert len(finals[bad].outputs[0].token_ids) == 2
    assert finals[good].error is None and len(finals[good].outputs[0].token_ids) == 6


def test_blocks_reader_reads_rows_by_index_and_by_slice():
    w = torch.randn(64, 5)
    blocks = w.view(4, 16, 5).transpose(1, 2).contiguous()  # F32Linear's layout [N/16, in, 16]
    rows = ck._blocks_reader(blocks)
    idx = torch.tensor([0, 17, 63, 5, 5])
    assert torch.equal(rows(idx), w[idx]) and torch.equal(rows(slice(16, 48)), w[16:48])
    with pytest.raises(ValueError, match="whole blocks"):
        rows(slice(8, 32))


# ----------------------------------------------------------------------------------------------------------
# plans kept for the next start, and one weight layout for every instruction set of ours


def no_timing(*a, **k):
    raise AssertionError("timed although a kept plan was there")


def test_kept_plans_are_built_without_timing_and_give_the_same_model(monkeypatch, tmp_path):
    fake = {"mkl": [2.0, 9.0, 9.0], "onednn": [1.0, 1.0, 1.0]}  # oneDNN where it packs: a plan to find again
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [5.0] * 3) for n in mods})
    kept = ck.PlanCache(tmp_path / "plans.json")
    first = tiny()
    report = prepare_linears(first, kept=kept)
    assert report.remembered == [] and report.timings and kept.path.exists()
    monkeypatch.setattr(ck, "time_kernels", no_timing)
    again = tiny()
    second = prepare_linears(again, kept=ck.PlanCache(kept.path))  # a later start reads the file
    assert second.choices == report.choices and second.timings == {}
    assert second.remembered == list(report.choices)  # every shape (and the greedy head, if any)
    assert "as measured at an earlier start" in second.line
    assert torch.equal(logits(again, IDS), logits(first, IDS))
    with pytest.raises(AssertionError, match="timed although"):  # without the cache: measured again
        prepare_linears(tiny())


def test_a_plan_for_other_candidates_or_options_is_measured_anew(monkeypatch, tmp_path):
    kept = ck.PlanCache(tmp_path / "plans.json")
    prepare_linears(tiny(), "int8", kept=kept)
    monkeypatch.setattr(ck, "time_kernels", no_timing)
    prepare_linears(tiny(), "int8", kept=ck.PlanCache(kept.path))  # the same: kept
    with pytest.raises(AssertionError, match="timed although"):
        prepare_linears(tiny(), "int8", group_size=64, kept=ck.PlanCache(kept.path))  # another option
    lin = nn.Linear(64, 48)
    with_ours = ck.plan_key(lin, None, None, 32, True, False, ["mkl", "onednn", "f32/avx2"])
    assert with_ours != ck.plan_key(lin, None, None, 32, True, False, ["mkl", "onednn"])  # no compiler now
    assert with_ours != ck.plan_key(lin.bfloat16(), None, None, 32, True, False, ["mkl", "onednn", "f32/avx2"])


def test_plan_cache_survives_a_broken_or_unwritable_file(tmp_path, caplog):
    bad = tmp_path / "plans.json"
    bad.write_text('{"plans": {"x": {"plan": "not a plan"}}}')
    assert ck.PlanCache(bad).get("x") is None
    bad.write_text("[1, 2")
    assert ck.PlanCache(bad).plans == {}
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be
    kept = ck.PlanCache(blocked / "plans.json")
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        report = prepare_linears(tiny(), kept=kept)
    assert report.choices and caplog.text.count("cannot be kept") == 1  # said once, not for every shape


def test_plan_files_are_per_machine(monkeypatch):
    here = ck.machine_key()
    monkeypatch.setattr(ck, "cpu_flags", lambda: {"avx2", "fma"})
    assert ck.machine_key() != here  # another CPU: measured anew
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert len({here, ck.machine_key()}) == 2


def test_load_model_keeps_its_plans_and_retime_measures_anew(tiny_folder, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.delenv("MINIVLLM_RETIME", raising=False)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        load_prepared(tiny_folder, "float32", "cpu")
    assert "earlier start" not in caplog.text
    assert [p.parent.name for p in tmp_path.rglob("*.json")] == ["plans"]
    caplog.clear()
    monkeypatch.setattr(ck, "time_kernels", no_timing)
    with caplog.at_level(logging.INFO, logger="minivllm"):
        load_prepared(tiny_folder, "float32", "cpu")  # a restart: nothing timed
    assert "as measured at an earlier start on this machine" in caplog.text
    monkeypatch.setenv("MINIVLLM_RETIME", "1")
    with pytest.raises(AssertionError, match="timed although"):
        load_prepared(tiny_folder, "float32", "cpu")
    monkeypatch.undo()  # the real timing again: with MINIVLLM_RETIME every shape is measured, none read back
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("MINIVLLM_RETIME", "1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minivllm"):
        load_prepared(tiny_folder, "float32", "cpu")
    assert "linear kernels" in caplog.text and "earlier start" not in caplog.text


@needs_head
def test_the_greedy_heads_choice_is_kept_too(monkeypatch, tmp_path):
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {"logits": [1.0] * 3, "greedy": [0.5] * 3}
                        if set(mods) == {"logits", "greedy"} else {n: [1.0] * 3 for n in mods})
    m, kept = tiny(), ck.PlanCache(tmp_path / "plans.json")
    report = ck.KernelReport(torch.float32, None)
    ck.use_greedy_head(m, report, kept)
    assert type(m.lm_head) is ck.GreedyHead and m.lm_head.from_rows == 1
    monkeypatch.setattr(ck, "time_kernels", no_timing)
    again, report = tiny(), ck.KernelReport(torch.float32, None)
    ck.use_greedy_head(again, report, ck.PlanCache(kept.path))
    assert type(again.lm_head) is ck.GreedyHead and again.lm_head.from_rows == 1
    assert report.remembered == ["261x64 greedy"] and report.choices["261x64 greedy"] == "bf16 shortlist from 1 rows"


@pytest.mark.skipif(len(F32_OURS) < 2, reason="this CPU runs fewer than two of our float32 kernels")
def test_our_float32_kernels_of_one_layer_share_its_layout(monkeypatch):
    lin = nn.Linear(64, 48)
    with ck.quantized_once():
        a, b = (ck.F32Linear.from_linear(lin, isa) for isa in F32_OURS)
    assert a.weight_blocks.data_ptr() == b.weight_blocks.data_ptr()  # one copy of the weights for a plan of both
    fake = {f"f32/{F32_OURS[1]}": [0.1, 1.0, 1.0], f"f32/{F32_OURS[0]}": [1.0, 0.1, 0.1]}
    monkeypatch.setattr(ck, "time_kernels", lambda mods, *a, **k: {n: fake.get(n, [5.0] * 3) for n in mods})
    m = tiny()
    prepare_linears(m, two_layouts=True)
    layer = m.model.layers[0].mlp.down_proj
    assert type(layer) is ck.ByRows and layer.few.weight_blocks.data_ptr() == layer.many.weight_blocks.data_ptr()


@pytest.mark.skipif(len(OURS) < 2, reason="this CPU runs fewer than two of our int4 kernels")
def test_our_int4_kernels_of_one_layer_share_its_layout():
    lin = nn.Linear(64, 48)
    with ck.quantized_once():
        a, b = (ck.Int4Int8Linear.from_linear(lin, isa=isa) for isa in OURS)
    assert a.qweight.data_ptr() == b.qweight.data_ptr()


# ----------------------------------------------------------------------------------------------------------
# RMSNorm in C

from minivllm.qwen2 import apply_rotary, RMSNorm, RotaryEmbedding  # noqa: E402

needs_norm = pytest.mark.skipif(ck.norm_library() is None, reason="no C compiler for our RMSNorm")


@needs_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 896), (7, 64), (33, 200), (2, 3, 48)])  # one row, the threaded batch, 3-D
def test_c_rmsnorm_is_pytorchs_to_a_rounding(dtype, shape):
    torch.manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        fast = ck.CRMSNorm.from_norm(norm)
        x = (torch.randn(shape) * 5).to(dtype)
        got, want = fast(x), norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    rel = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert rel.max() <= (1e-6 if dtype == torch.float32 else 2**-7)  # the sum of squares in another order
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)) * norm.weight.double()
    assert ((got.double() - exact).abs() <= (exact.abs() * (1e-6 if dtype == torch.float32 else 2**-7) + 1e-6)).all()


@needs_norm
def test_c_rmsnorm_hands_other_inputs_to_pytorch():
    norm = RMSNorm(64, 1e-5)
    fast = ck.CRMSNorm.from_norm(norm)
    assert fast.weight is norm.weight and fast.eps == 1e-5
    with torch.no_grad():
        x = torch.randn(4, 64)
        assert torch.equal(fast(x.bfloat16()), norm(x.bfloat16()))  # bfloat16 rows, float32 weight: PyTorch's
        assert torch.equal(fast(x.half()), norm(x.half()))
        strided = torch.randn(64, 4).t()  # not contiguous
        assert (fast(strided) - norm(strided)).abs().max() <= 1e-6
        assert fast(torch.randn(0, 64)).shape == (0, 64)


@needs_norm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7, 9, 300])  # one token, below and above the threaded count
def test_c_rotary_gives_pytorchs_bits(dtype, T):
    torch.manual_seed(T)
    qkv = (torch.randn(T, 6, 32) * 8).to(dtype)  # 2 q heads, 2 k, 2 v of 32
    cos, sin = RotaryEmbedding(32, 10000.0)(torch.randint(0, 40000, (T,)), dtype)
    x, before = qkv[:, :4], qkv.clone()  # q and k: a view with the product's row stride
    got = ck.c_rotary(x, cos, sin)
    assert got.dtype == dtype and got.shape == (T, 4, 32) and torch.equal(got, apply_rotary(x, cos, sin))
    assert torch.equal(qkv, before)  # the input untouched


@needs_norm
def test_c_rotary_hands_other_inputs_to_pytorch():
    x, (cos, sin) = torch.randn(3, 4, 16), RotaryEmbedding(16, 10000.0)(torch.arange(3), torch.float32)
    odd = torch.randn(3, 16, 4).transpose(1, 2)  # heads not 16 apart: PyTorch's
    assert torch.equal(ck.c_rotary(odd, cos, sin), apply_rotary(odd, cos, sin))
    half = x.half()  # float16: PyTorch's
    assert torch.equal(ck.c_rotary(half, cos.half(), sin.half()), apply_rotary(half, cos.half(), sin.half()))
    assert torch.equal(ck.c_rotary(x, cos.bfloat16(), sin.bfloat16()), apply_rotary(x, cos.bfloat16(), sin.bfloat16()))
    assert ck.c_rotary(torch.randn(0, 4, 16), cos[:0], sin[:0]).shape == (0, 4, 16)


@needs_norm
def test_prepare_norms_swaps_every_norm_and_rotary_and_the_model_agrees(tiny_folder):
    plain, _ = load_prepared(tiny_folder, "float32", "cpu", pack=False)  # the exact path: PyTorch's norms
    assert not any(type(m) is ck.CRMSNorm for m in plain.modules())
    m = tiny()
    ref = logits(m, IDS)
    assert ck.prepare_norms(m) == 2 * 2 + 1 + 2  # two per layer and the final norm; each layer's rotary
    assert all(type(n) is not RMSNorm for n in m.modules())
    assert all(layer.self_attn.rotary is ck.c_rotary for layer in m.model.layers)
    assert rel(logits(m, IDS), ref) <= 1e-5
    prepared, _ = load_prepared(tiny_folder, "float32", "cpu")  # the measured path: ours
    assert sum(type(n) is ck.CRMSNorm for n in prepared.modules()) == 5
    assert [layer.self_attn.rotary for layer in plain.model.layers] == [apply_rotary] * 2
    assert [layer.self_attn.rotary for layer in prepared.model.layers] == [ck.c_rotary] * 2


def test_prepare_norms_without_a_compiler_keeps_pytorchs(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    ck.norm_library.cache_clear()
    try:
        m = tiny()
        assert ck.prepare_norms(m) == 0 and not any(type(n) is ck.CRMSNorm for n in m.modules())
        assert m.model.layers[0].self_attn.rotary is apply_rotary
    finally:
        ck.norm_library.cache_clear()


# ----------------------------------------------------------------------------------------------------------
# our C: one library from minivllm/csrc, no warnings, each self-test of each variant, ctypes tables as in C

CC = ck.c_compiler()
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")
FAMILIES = {"int4": ck.INT4_ISAS, "f32": ck.F32_ISAS, "norm": ck.PORTABLE, "head": ck.PORTABLE, "attn": ck.PORTABLE}
C_TYPES = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float}


@needs_cc
def test_c_compiles_without_a_warning(tmp_path):
    built = ck.compile_kernels(CC, tmp_path / "kernels.so")  # -Wall -Wextra
    assert built.returncode == 0 and built.stderr == "", built.stderr


@needs_cc
@pytest.mark.parametrize("kind, isa", [(kind, isa) for kind, table in FAMILIES.items() for isa in table])
def test_c_self_test(kind, isa):
    "Each self-test of each variant this CPU runs, in a child of its own: a fault fails the test, not pytest."
    table = FAMILIES[kind]
    if isa not in ck.isas_here(table):
        pytest.skip(f"this CPU lacks {sorted(table[isa][1] - ck.cpu_flags())}")
    assert ck.run_selftests(ck.c_library(CC), [f"{kind}_selftest:{table[isa][0]}"]) == 0


@needs_cc
def test_one_library_serves_every_family(fresh_int4):
    libraries = {lib for lib in (f() for f in FAMILY_LIBRARIES) if lib is not None}
    assert len(libraries) == 1 and [f.suffix for f in built(fresh_int4)].count(".so") == 1


@needs_cc
def test_a_kernel_that_faults_kills_a_child_not_us(monkeypatch, fresh_int4, caplog):
    "What a CPU that lists a flag and faults on its instructions does to a self-test: SIGILL (ud2 here)."
    corrupt(monkeypatch, fresh_int4, "norms.c", "(void)isa;", "(void)isa;\n  __builtin_trap();")
    assert ck.norm_library() is None
    assert "our norm kernels are not candidates: its self-test failed (killed: Illegal instruction)" in caplog.text
    assert ck.head_library() is not None  # the rest of the library serves


def c_params(name: str) -> list[tuple[str, type]]:
    "The parameters of C function `name` (in whichever of our sources defines it) as ctypes sees them."
    text = "\n".join(p.read_text() for p in sorted(ck.CSRC.glob("*.c")))
    found = re.search(rf"^\w[^\n]*\b{name}\(([^)]*)\)\s*{{", text, re.M)
    assert found, f"no C function {name}"
    words = [p.replace("*", " * ").split() for p in found.group(1).split(",")]
    return [(w[-1], ctypes.c_void_p if "*" in w else C_TYPES[w[-2]]) for w in words]


@pytest.mark.parametrize("functions", [ck.INT4_FUNCTIONS, ck.F32_FUNCTIONS, ck.NORM_FUNCTIONS, ck.HEAD_FUNCTIONS,
                                       ck.ATTN_FUNCTIONS], ids=["int4", "f32", "norm", "head", "attn"])
def test_ctypes_tables_are_the_c_signatures(functions):
    "ctypes cannot read C: each table of what Python passes names and types the C parameters, in order."
    for name, params in functions.items():
        assert list(params.items()) == c_params(name), name


def test_show_c_prints_a_definition_from_its_file(capsys):
    ck.show_c("linear_int4.c", "int4_linear")
    out = capsys.readouterr().out.splitlines()
    first, end = ck.c_lines("linear_int4.c", "int4_linear")
    lines = (ck.CSRC / "linear_int4.c").read_text().splitlines()
    assert out[0] == f"// linear_int4.c:{first + 1}-{end}" and out[1:] == lines[first:end]
    assert lines[first].startswith("// y [M, N] = x [M, K] W^T") and lines[end - 1] == "}"
    assert ck.c_lines("linear_f32.c", "F32_ROWS")[1] - ck.c_lines("linear_f32.c", "F32_ROWS")[0] == 10  # a macro
    with pytest.raises(ValueError, match="norms.c defines no 'int4_linear'"):
        ck.c_lines("norms.c", "int4_linear")
