"""The GPU path proved on the CPU: the Triton decode backend in the engine (under TRITON_INTERPRET=1, set by
conftest.py on a machine without CUDA) and the CUDA-graph runner with its capture faked (`eager_capture`).

Every claim is against the PyTorch reference backend on the same tiny model in float32: greedy tokens identical,
batched equal to alone, preemption and prefix caching invisible."""

import pytest
import torch

import minivllm.cuda_graphs as cg
import minivllm.engine as eng
from minivllm.engine import EngineArgs, LLMEngine, SamplingParams, make_decoder
from minivllm.paged_cache import KVCache
from minivllm.triton_attention import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello there", "The quick brown fox jumps", "a", "Paged attention reads blocks " * 3]


def run(tiny, prompts=PROMPTS, params=GREEDY, **kw) -> list[list[int]]:
    "Token ids of each prompt, all added at once and stepped to the end."
    model, tok = tiny
    engine = LLMEngine(model, tok, **{"block_size": 4, "num_kv_blocks": 256, **kw})
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def reference(tiny):
    return run(tiny, attention_backend="torch")


@needs_triton
def test_triton_backend_is_greedy_identical_to_the_reference(tiny, reference):
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=256, attention_backend="triton")
    assert engine.runner.decoder.name == "triton" and engine.runner.graphs is None  # CPU: eager
    assert run(tiny, attention_backend="triton") == reference


@needs_triton
def test_triton_backend_batched_equals_alone(tiny, reference):
    alone = [run(tiny, [p], attention_backend="triton")[0] for p in PROMPTS]
    assert alone == reference


@needs_triton
@pytest.mark.parametrize("prefix", [False, True])
def test_triton_backend_preemption_and_prefix_caching_are_invisible(tiny, reference, prefix):
    # 30 blocks of 4 tokens cannot hold the four sequences at once: some are preempted and recomputed
    shared = ["You are a helpful assistant. " + p for p in PROMPTS[:3] + ["Paged attention"]]
    want = run(tiny, shared, attention_backend="torch", num_kv_blocks=256)
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=30, attention_backend="triton",
                       enable_prefix_caching=prefix, max_num_batched_tokens=32)
    ids = [engine.add_request(p, GREEDY) for p in shared]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == want
    assert engine.stats().num_preemptions > 0


def test_attention_backend_choice_and_errors(tiny, monkeypatch):
    model, tok = tiny
    cache = KVCache(model.config, 8, 4, torch.float32, torch.device("cpu"))
    assert make_decoder("torch", cache).name == "torch"
    assert make_decoder("auto", cache).name in ("c", "torch")  # the CPU: never triton by itself
    with pytest.raises(ValueError, match="unknown"):
        make_decoder("flash", cache)
    with pytest.raises(ValueError, match="'c' runs on the CPU"):
        make_decoder("c", KVCache(model.config, 8, 4, torch.float16, torch.device("cpu")))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_decoder("triton", cache)
    assert not eng.uses_cuda_graphs(EngineArgs(), torch.device("cpu"))
    assert not eng.uses_cuda_graphs(EngineArgs(enforce_eager=True), torch.device("cuda"))
    assert not eng.uses_cuda_graphs(EngineArgs(attention_backend="torch"), torch.device("cuda"))


def test_cli_has_the_backend_and_eager_flags():
    import argparse

    ap = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(ap.parse_args(["--attention-backend", "triton", "--enforce-eager"]))
    assert args.attention_backend == "triton" and args.enforce_eager


@needs_triton
def test_engine_with_graphs_faked_on_the_cpu(tiny, reference, monkeypatch):
    # the engine's CUDA-graph path with the capture faked: decode steps replay, padded to the captured sizes,
    # the scratch block stays outside the block manager, and the tokens are the reference's
    monkeypatch.setattr(eng, "uses_cuda_graphs", lambda args, device: not args.enforce_eager)
    monkeypatch.setattr(cg, "cuda_capture", cg.eager_capture)
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=256, attention_backend="triton", max_num_seqs=6)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 6]
    assert engine.block_manager.num_blocks == 255 and graphs.scratch_slot == 255 * 4
    replays = []
    for size, (replay, out) in list(graphs.graphs.items()):
        graphs.graphs[size] = ((lambda r=replay, s=size: replays.append(s) or r()), out)
    address = graphs.inputs.data_ptr()
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:3]]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[i] for i in ids] == reference[:3]
    assert replays and set(replays) == {4}  # three rows pad to the graph of 4
    assert graphs.inputs.data_ptr() == address
    eager = LLMEngine(model, tok, block_size=4, num_kv_blocks=256, attention_backend="triton", enforce_eager=True)
    assert eager.runner.graphs is None and eager.block_manager.num_blocks == 256


class CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    "Every aten op dispatched while it is on, by name."

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def decode_forward_ops(num_layers: int, decoder_name: str) -> list[str]:
    "The aten ops of one decode forward of 3 rows through a random Qwen2 of `num_layers` layers."
    from minivllm.paged_cache import BlockManager, PagedBatch
    from minivllm.qwen2 import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg).eval()
    bm, cache = BlockManager(16, 4), KVCache(cfg, 16, 4, torch.float32, torch.device("cpu"))
    tables = [bm.new_table() for _ in range(3)]
    for t, n in zip(tables, (5, 9, 2)):
        bm.append(t, n)
    meta = PagedBatch.build(cache, [(t, n - 1, 1) for t, n in zip(tables, (5, 9, 2))], 0, torch.device("cpu"),
                            make_decoder(decoder_name, cache, max_blocks=4))
    ids, pos = torch.tensor([1, 2, 3]), torch.tensor([4, 8, 1])
    with CountOps() as mode:
        model(ids, pos, meta)
    return mode.ops


@needs_triton
def test_decode_forward_has_no_host_sync_and_a_fixed_number_of_ops_per_layer():
    # what a CUDA graph needs of the forward: no op that reads a value back to the host (.item(), a bool of a
    # tensor: aten._local_scalar_dense), and the same ops in every layer, whatever the data
    one, two, three = (decode_forward_ops(n, "triton") for n in (1, 2, 3))
    assert not [op for op in three if "_local_scalar_dense" in op or "nonzero" in op]
    per_layer = len(two) - len(one)
    assert per_layer > 0 and len(three) - len(two) == per_layer
    print(f"{per_layer} aten ops per layer, {len(one) - per_layer} outside the layers (Triton launches not counted)")
