"""09a's async scheduling: step N+1 scheduled and launched before step N's tokens are read. Every claim is against
the same engine with it off, on a tiny random model: tokens, text and finish reasons identical over random
workloads (greedy and seeded sampling, stop strings, EOS, chunked and separate prefill, prefix caching, a pool so
small that sequences are preempted), through the CUDA-graph runner with its capture faked, when requests that
need their tokens on the host come and go (the loop drains and resumes), on abort, and on a row that is not
finite. The trap: the blocks of a sequence that ends while a launched step still writes them stay out of the pool
until that step is read (checked after every call, and shown to fail with the hold taken away)."""

import random

import pytest
import torch

import minivllm.cuda_graphs as cg
import minivllm.engine as eng
from minivllm.engine import LLMEngine, SamplingParams
from minivllm.overlap import PLACEHOLDER, OverlapLoop
from minivllm.triton_attention import HAS_TRITON

WORDS = "the cat sat on a mat while 7 dogs ran ab ba 🎉 你好".split()


def workload(seed: int, n: int = 8) -> list[tuple[str, SamplingParams]]:
    "Random prompts (some sharing a prefix) with greedy or seeded sampling, stop strings, EOS and lengths."
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        prompt = ("shared system prompt: " if rnd.random() < 0.4 else "") + " ".join(rnd.choices(WORDS, k=rnd.randint(1, 12)))
        kw = dict(max_tokens=rnd.randint(1, 30), ignore_eos=rnd.random() < 0.5, stop=["ab"] if rnd.random() < 0.3 else None)
        if rnd.random() < 0.4:
            kw.update(temperature=0.9, top_p=0.9, top_k=20, seed=seed * 100 + i)
        else:
            kw.update(temperature=0)
        if rnd.random() < 0.2:
            kw.update(logit_bias={rnd.randrange(256): -100.0})
        out.append((prompt, SamplingParams(**kw)))
    return out


def check_holds(engine: LLMEngine, launched_blocks: dict) -> None:
    "A sequence that ended while the step in flight still writes it: none of its blocks is in the free pool."
    step = engine.overlap.in_flight if engine.overlap else None
    if step is None:
        return
    free = engine.block_manager.allocator.free_ids
    for seq, _ in step.batch.items:
        if seq.is_finished:
            blocks = launched_blocks[id(step), seq.seq_id]
            assert not any(b in free for b in blocks), f"blocks of ended sequence {seq.seq_id} freed in flight"


def run(tiny, requests, add_later=(), abort_at=None, **kw):
    "Outputs (tokens, text, finish reason) by request, and the engine, stepped to the end with checks."
    model, tok = tiny
    engine = LLMEngine(model, tok, **{"block_size": 4, "num_kv_blocks": 256, "max_num_seqs": 8, **kw})
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done, calls, launched_blocks = {}, 0, {}
    if engine.overlap is not None:  # each launched step's blocks, as it was launched
        launch = engine.overlap.launch

        def recording(batch, last):
            step = launch(batch, last)
            for seq, _ in batch.items:
                launched_blocks[id(step), seq.seq_id] = list(seq.block_table.blocks)
            return step

        engine.overlap.launch = recording
    later = list(add_later)
    while engine.has_unfinished_requests() or later:
        calls += 1
        if later and calls == later[0][0]:
            ids.append(engine.add_request(*later.pop(0)[1:]))
        if abort_at is not None and calls == abort_at[0]:
            engine.abort(ids[abort_at[1]])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        check_holds(engine, launched_blocks)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing held or leaked
    assert not engine.scheduler.holds
    result = {i: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.error)
              for i, o in done.items()}
    return [result.get(i) for i in ids], engine


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from minivllm.weights import Tokenizer, load_safetensors_model
    from minivllm.testing import tiny_chat_folder
    d = tiny_chat_folder(tiny_folder.parent / "sharp", sharp=True)
    return load_safetensors_model(d), Tokenizer.from_folder(d)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["mixed", "separate", "tight", "no-prefix-cache"])
def test_overlap_changes_no_output(tiny, seed, mode):
    kw = {"mixed": {}, "separate": {"prefill_steps": "separate"},
          "tight": {"num_kv_blocks": 40, "max_num_batched_tokens": 24},
          "no-prefix-cache": {"enable_prefix_caching": False, "max_num_batched_tokens": 16}}[mode]
    reqs = workload(seed)
    plain, _ = run(tiny, reqs, **kw)
    over, engine = run(tiny, reqs, async_scheduling=True, **kw)
    assert over == plain
    assert all(o is not None for o in over)
    if mode == "tight":
        assert engine.scheduler.num_preemptions > 0 or seed  # seed 0 preempts in 40 blocks


def test_the_loop_overlaps_and_fills_placeholders_on_the_device(tiny, monkeypatch):
    # after each call the step in flight holds a placeholder per running sampler, and the next launch feeds it
    fed = []
    orig = OverlapLoop.launch

    def launch(self, batch, last):
        fed.append(sum(1 for s, _ in batch.items if s.token_ids[-1] == PLACEHOLDER))
        return orig(self, batch, last)

    monkeypatch.setattr(OverlapLoop, "launch", launch)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) for p in ["Hello", "a b c", "🎉"]]
    plain, _ = run(tiny, reqs)
    over, engine = run(tiny, reqs, async_scheduling=True)
    assert over == plain
    assert max(fed) == 3 and fed[0] == 0  # the first step is prompts; then three decodes a step, from the device


def test_requests_that_need_host_tokens_drain_the_loop(tiny):
    # penalties, logprobs, n > 1 and a grammar arrive mid-run: the loop reads what is in flight and runs plain steps
    # while they are there, then overlaps again; nobody's output changes
    base = workload(11, n=4)
    later = [(3, "penalized prompt", SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3)),
             (5, "with logprobs", SamplingParams(temperature=0, max_tokens=6, logprobs=2)),
             (9, "two of them", SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=5))]
    plain, _ = run(tiny, base, add_later=later)
    over, engine = run(tiny, base, add_later=later, async_scheduling=True)
    assert over == plain and all(o is not None for o in over)


@pytest.mark.parametrize("when", [2, 3, 5])
def test_abort_in_flight(tiny, when):
    reqs = [(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in ["Hello", "other", "third x"]]
    plain, _ = run(tiny, reqs, abort_at=(when, 1))
    over, engine = run(tiny, reqs, abort_at=(when, 1), async_scheduling=True)
    assert over[0] == plain[0] and over[2] == plain[2] and over[1] is None  # an aborted request says nothing more


def test_a_row_that_is_not_finite_ends_its_request_only(tiny, monkeypatch):
    calls = []
    draw = eng.Sampler.draw

    def bad_draw(self, logits, seqs, *a, **k):
        tokens = draw(self, logits, seqs, *a, **k)
        calls.append(1)
        if len(calls) == 4:
            tokens = tokens.clone()
            tokens[0] = -1
        return tokens

    monkeypatch.setattr(eng.Sampler, "draw", bad_draw)
    reqs = [(p, SamplingParams(temperature=0.5, seed=i, max_tokens=10, ignore_eos=True)) for i, p in enumerate(["x", "yy"])]
    over, _ = run(tiny, reqs, async_scheduling=True)
    assert over[0][2] == "error" and "not finite" in over[0][3] and PLACEHOLDER not in over[0][0]
    assert over[1][2] == "length" and len(over[1][0]) == 10


def test_without_the_hold_the_check_fails(tiny, monkeypatch):
    # the check above can fail: with the hold taken away, an ended sequence's blocks go back while its row runs
    class NoHolds(dict):
        def __setitem__(self, k, v):
            pass

    orig = OverlapLoop.__init__

    def init(self, engine):
        orig(self, engine)
        engine.scheduler.holds = NoHolds()

    monkeypatch.setattr(OverlapLoop, "__init__", init)
    reqs = [(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) for p, n in [("Hello", 3), ("long one", 20)]]
    with pytest.raises(AssertionError, match="freed in flight"):
        run(tiny, reqs, async_scheduling=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_overlap_through_the_graph_runner(tiny, monkeypatch):
    # decode steps replay from graphs (capture faked): the placeholders are fed into the graph's input buffer
    monkeypatch.setattr(eng, "uses_cuda_graphs", lambda args, device: not args.enforce_eager)
    monkeypatch.setattr(cg, "cuda_capture", cg.eager_capture)
    fed = []
    graph_run = cg.DecodeGraphs.run
    monkeypatch.setattr(cg.DecodeGraphs, "run", lambda self, items, ids, feed=None: fed.append(feed is not None)
                        or graph_run(self, items, ids, feed))
    reqs = workload(5, n=5)
    kw = dict(attention_backend="triton", max_num_seqs=6, prefill_steps="separate")
    plain, _ = run(tiny, reqs, enforce_eager=True, **kw)
    assert not fed
    over, engine = run(tiny, reqs, async_scheduling=True, **kw)
    assert engine.runner.graphs is not None
    assert over == plain
    assert sum(fed) > 10  # decode steps replayed with their tokens fed from the step before


def test_no_overlap_with_speculation(tiny):
    reqs = workload(2, n=3)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    plain, _ = run(tiny, reqs, speculative_config=spec)
    over, engine = run(tiny, reqs, speculative_config=spec, async_scheduling=True)
    assert over == plain and not engine.overlap.can_overlap()


def test_the_server_with_async_scheduling(tiny):
    # a real server on loopback with the loop on: the official client streams what the plain engine makes,
    # concurrent clients that hang up mid-stream leave no block behind
    import asyncio

    import httpx
    import openai

    from minivllm.server import BackgroundServer, build_app

    model, tok = tiny
    prompts = ["Hello there", "a b c d", "🎉 once more"]
    plain = LLMEngine(model, tok, block_size=4, num_kv_blocks=512)
    want = [o.outputs[0].text for o in eng.LLM.from_engine(plain).generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=512, max_num_seqs=16, async_scheduling=True)
    with BackgroundServer(build_app(engine, "tiny")) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        got = []
        for p in prompts:
            chunks = client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            got.append("".join(c.choices[0].text for c in chunks))
        assert got == want

        async def leave_early(i):
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
                body = {"prompt": f"client {i} " * 3, "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        n += bool(line)
                        if n == 3:
                            return True

        async def main():
            return await asyncio.gather(*[leave_early(i) for i in range(6)])

        assert all(asyncio.run(main()))
        for _ in range(100):  # the engine thread frees what the hang-ups held
            if engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.requests:
                break
            import time
            time.sleep(0.05)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sequences_that_fill_the_context(tiny):
    # max_tokens None: each ends at max_model_len; its spare row in the step after sits at the last position
    reqs = [(p, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)) for p in ["Hello", "a longer prompt"]]
    plain, _ = run(tiny, reqs, max_model_len=40)
    over, _ = run(tiny, reqs, max_model_len=40, async_scheduling=True)
    assert over == plain and all(o[2] == "length" for o in over)


def test_the_flag_on_the_command_line():
    import argparse

    from minivllm.engine import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"])).async_scheduling is True
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is False


def test_the_launch_indexes_tensors_with_tensors_only(tiny, monkeypatch):
    # on a GPU a Python list as an index is copied to the device by a blocking copy, which waits for the step
    # queued before it: the launch of N + 1 would wait for N + 1 itself. No list index while a step is launched.
    launching = []
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def listy(key) -> bool:
        return isinstance(key, list) or (isinstance(key, tuple) and any(isinstance(k, list) for k in key))

    def get(self, key):
        assert not (launching and listy(key)), f"a list index in the launch: {str(key)[:60]}"
        return getitem(self, key)

    def put(self, key, value):
        assert not (launching and listy(key)), f"a list index in the launch: {str(key)[:60]}"
        return setitem(self, key, value)

    launch = OverlapLoop.launch

    def watched(self, batch, last):
        launching.append(1)
        try:
            return launch(self, batch, last)
        finally:
            launching.pop()

    monkeypatch.setattr(torch.Tensor, "__getitem__", get)
    monkeypatch.setattr(torch.Tensor, "__setitem__", put)
    monkeypatch.setattr(OverlapLoop, "launch", watched)
    reqs = workload(7, n=8)  # greedy, seeded, logit_bias rows together
    assert any(sp.logit_bias for _, sp in reqs) and any(not sp.greedy for _, sp in reqs)
    over, _ = run(tiny, reqs, async_scheduling=True)
    assert all(o is not None for o in over)
