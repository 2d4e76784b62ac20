"""08a's fused kernels (residual add + RMSNorm, SiLU-and-mul, rotary) and 08's K/V store kernel against their
plain-PyTorch twins under Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without CUDA), and the
fused model in the engine: greedy tokens identical to 01's layers, through prefill, decode, preemption, prefix
caching and the CUDA-graph runner (capture faked).

Tolerances: float16 within a unit in the last place and float32 within 1e-6 (a norm's sum and SiLU's exp may
differ in their last bit, and the dtype's rounding can then go the other way; rotary and the store, elementwise,
are bit for bit);
bfloat16 within a few units in the last place: the interpreter converts float32 to bfloat16 by truncation,
where a GPU rounds to nearest."""

import copy

import pytest
import torch

import minivllm.cuda_graphs as cg
import minivllm.engine as eng
from minivllm.engine import LLMEngine, SamplingParams
from minivllm.paged_cache import DecodeAttention
from minivllm.qwen2 import Qwen2Config, Qwen2ForCausalLM, RMSNorm, RotaryEmbedding, apply_rotary, merge_projections
from minivllm.triton_attention import HAS_TRITON, interpreting, store_kv_triton

needs_triton = pytest.mark.skipif(not (HAS_TRITON and interpreting()), reason="triton's interpreter is not on")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
LOGPROBS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)  # the chosen token's
PROMPTS = ["Hello there", "The quick brown fox jumps", "a", "Fused kernels read each row once " * 3]

if HAS_TRITON:
    from minivllm.fused_kernels import (FusedQwen2Model, add_rms_norm, add_rms_norm_reference, count_kernels,
                                        fuse_model, rotary, silu_and_mul, silu_and_mul_reference)


def check(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, exact: bool = False) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    if dtype == torch.bfloat16:  # truncation in the interpreter: a unit or two in the last place of the scale
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6 * b.abs().max().item())
    elif exact:
        assert torch.equal(a, b), (a - b).abs().max()
    elif dtype == torch.float16:
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-10, atol=2**-14)
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 896])  # a power of two, not, the bundled model's
def test_add_rms_norm_equals_its_twin(dtype, hidden):
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden).to(dtype)
    x, r = torch.randn(5, hidden).to(dtype) * 3, torch.randn(5, hidden).to(dtype)
    for residual in (None, r):
        (got, got_sum), (want, want_sum) = add_rms_norm(x, residual, norm), add_rms_norm_reference(x, residual, norm)
        check(got, want, dtype)
        check(got_sum, want_sum, dtype)
    assert add_rms_norm(x, None, norm)[1] is x  # the first layer: the stream is x itself, not a copy
    wide = torch.randn(5, 2 * hidden).to(dtype)[:, :hidden]  # rows strided, as a view hands them over
    check(add_rms_norm(wide, r, norm)[0], add_rms_norm_reference(wide, r, norm)[0], dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [80, 1024, 1500])  # one block, exactly one, two with a partial second
def test_silu_and_mul_equals_its_twin(dtype, inter):
    torch.manual_seed(inter)
    gu = torch.randn(3, 2 * inter).to(dtype) * 4
    check(silu_and_mul(gu), silu_and_mul_reference(gu), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(14, 2), (4, 4), (5, 1)])
def test_rotary_of_a_strided_qk_view_equals_01s(dtype, heads):
    hq, hkv = heads
    torch.manual_seed(hq)
    qkv = torch.randn(6, hq + 2 * hkv, 64).to(dtype)  # [T, Hq + 2 Hkv, D]: q and k are a strided view of it
    pos = torch.tensor([0, 1, 7, 500, 4000, 32767])
    cos, sin = RotaryEmbedding(64, 1e6, 32768)(pos, dtype)
    qk = qkv[:, : hq + hkv]
    got = rotary(qk, cos, sin)
    check(got, apply_rotary(qk, cos, sin), dtype, exact=True)
    assert got.is_contiguous() and torch.equal(qkv[:, : hq + hkv], qk)  # the input is left as it was


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_kernel_writes_what_the_reference_writes(dtype):
    torch.manual_seed(0)
    qkv = torch.randn(7, 14 + 2 * 2, 64).to(dtype)
    k, v = qkv[:, 14:16], qkv[:, 16:]
    slots = torch.tensor([3, 9, 22, 0, 17, 23, 4])
    pools = [torch.zeros(6, 4, 2, 64, dtype=dtype) for _ in range(4)]
    DecodeAttention().store(pools[0], pools[1], slots, k, v)
    buffer = torch.zeros(7, 5, dtype=torch.long)  # slots as a column of a larger buffer, as 09's graphs hold them
    buffer[:, 2] = slots
    store_kv_triton(k, v, pools[2], pools[3], buffer[:, 2])
    assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])
    assert int((pools[2] != 0).any(-1).any(-1).sum()) == 7  # every slot written, no other
    with pytest.raises(ValueError, match="do not fit"):
        store_kv_triton(k, v, torch.zeros(6, 4, 3, 64, dtype=dtype), pools[3], slots)


def tiny_qwen(seed: int = 0, dtype=torch.float32) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg).eval().to(dtype)
    for p in model.parameters():  # biases and norm weights away from their defaults: every add is exercised
        p.data += 0.1 * torch.randn_like(p)
    return model


@needs_triton
def test_fused_model_gives_01s_logits_and_runs_10_kernels_a_layer():
    from minivllm.paged_cache import BlockManager, KVCache, PagedBatch
    from minivllm.qwen2 import ContiguousKVCache
    from minivllm.triton_attention import TritonDecode

    plain = tiny_qwen()
    fused = copy.deepcopy(plain)
    assert fuse_model(fused) == 2 and type(fused.model) is FusedQwen2Model and fuse_model(fused) == 0
    ids = torch.randint(0, 64, (9,))
    outs = []
    for m in (plain, fused):
        cache = ContiguousKVCache(2)
        a = m.compute_logits(m(ids, torch.arange(9), cache.batch([0], [9])))
        b = m.compute_logits(m(ids[:1], torch.tensor([9]), cache.batch([0], [1])))
        outs.append(torch.cat([a, b]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1].argmax(-1), outs[0].argmax(-1))

    def kernels(model, layers):  # one decode step of 3 rows on the GPU's path, bfloat16, `layers` layers
        model = copy.deepcopy(model).to(torch.bfloat16)
        model.model.layers = model.model.layers[:layers]
        bm, cache = BlockManager(16, 4), KVCache(model.config, 16, 4, torch.bfloat16, torch.device("cpu"))
        tables = [bm.new_table() for _ in range(3)]
        for t, n in zip(tables, (5, 9, 2)):
            bm.append(t, n)
        meta = PagedBatch.build(cache, [(t, n - 1, 1) for t, n in zip(tables, (5, 9, 2))], 0,
                                torch.device("cpu"), TritonDecode(max_blocks=4))
        args = torch.tensor([1, 2, 3]), torch.tensor([4, 8, 1]), meta
        model.model(*args)  # the rotary tables, built once
        with torch.no_grad(), count_kernels() as k:
            model.model(*args)
        return k.names

    merge_projections(plain)
    before = len(kernels(plain, 2)) - len(kernels(plain, 1))
    names = kernels(fused, 2)
    after = len(names) - len(kernels(fused, 1))
    print(f"kernels a decode layer, bfloat16: 01's {before}, fused {after}")
    assert before >= 30 and after == 10
    assert not any(n.startswith("_local_scalar_dense") or n == "nonzero" for n in names)  # graph-safe: no sync


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    "The tiny model with sharp next-token distributions: a wrong K/V changes its tokens (conftest's `tiny`)."
    from conftest import tiny_model_folder
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-sharp"), sharp=True)


def fused_pair(tiny):
    "The tiny model and a fused copy of it (a deep copy: the module's own `tiny` stays plain)."
    model, tok = tiny
    fused = copy.deepcopy(model)
    fuse_model(fused)
    return (model, tok), (fused, tok)


def finish(engine: LLMEngine, prompts: list[str], params: SamplingParams = GREEDY) -> list:
    "Each prompt's final completion, all added at once and stepped to the end; every block comes back."
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks
    return [done[i] for i in ids]


def run(tiny, prompts=PROMPTS, **kw) -> list[list[int]]:
    model, tok = tiny
    kw = {"block_size": 4, "num_kv_blocks": 256, "attention_backend": "triton", **kw}
    return [o.token_ids for o in finish(LLMEngine(model, tok, **kw), prompts)]


def same_logprobs(got: list, want: list) -> None:
    "The same tokens with the same log-probabilities: K/V in a wrong slot moves these before any arg-max."
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for t, a, b in zip(g.token_ids, g.logprobs, w.logprobs):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4, (t, a[t], b[t])


@needs_triton
def test_engine_greedy_tokens_unchanged_by_fusion(tiny):
    plain, fused = fused_pair(tiny)
    assert run(fused) == run(plain)
    engines = [LLMEngine(*m, block_size=4, num_kv_blocks=256, attention_backend="triton") for m in (fused, plain)]
    same_logprobs(*(finish(e, PROMPTS, LOGPROBS) for e in engines))


@needs_triton
@pytest.mark.parametrize("prefix", [False, True])
def test_fused_engine_preemption_prefix_caching_and_separate_steps_are_invisible(tiny, prefix):
    plain, fused = fused_pair(tiny)
    shared = ["You are a helpful assistant. " + p for p in PROMPTS[:3] + ["Fused kernels"]]  # 30 blocks: too few
    want = run(plain, shared, attention_backend="torch")
    model, tok = fused
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=30, attention_backend="triton",
                       enable_prefix_caching=prefix, max_num_batched_tokens=32, prefill_steps="separate")
    assert [o.token_ids for o in finish(engine, shared)] == want
    assert engine.stats().num_preemptions > 0


@needs_triton
def test_fused_model_under_the_graph_runner(tiny, monkeypatch):
    # the CUDA-graph path with the capture faked: decode steps replay the fused layers from fixed buffers
    plain, fused = fused_pair(tiny)
    reference = LLMEngine(*plain, block_size=4, num_kv_blocks=256, attention_backend="torch")
    assert reference.runner.graphs is None  # made before the patch below: 02's eager path, no graph
    want = finish(reference, PROMPTS, LOGPROBS)
    monkeypatch.setattr(eng, "uses_cuda_graphs", lambda args, device: not args.enforce_eager)
    monkeypatch.setattr(cg, "cuda_capture", cg.eager_capture)
    model, tok = fused
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=256, attention_backend="triton", max_num_seqs=6)
    graphs, replays = engine.runner.graphs, []
    assert graphs is not None
    for size, (replay, out) in list(graphs.graphs.items()):
        graphs.graphs[size] = ((lambda r=replay, s=size: replays.append(s) or r()), out)
    same_logprobs(finish(engine, PROMPTS, LOGPROBS), want)
    assert replays and 4 in replays  # decode steps replayed the fused layers, padded rows included


def test_prepare_model_fuses_only_off_the_cpu(tiny):
    from minivllm.cpu_kernels import prepare_model

    model = prepare_model(copy.deepcopy(tiny[0]), pack=False)  # the CPU: 07's kernels or none, never 08a's
    assert type(model.model).__name__ == "Qwen2Model"
