"""minivllm.speculative and the engine's verification of drafts (14): the n-gram proposer, the options with vLLM's
names, greedy outputs identical to decoding without speculation (chunked or not, a budget that trims drafts, a pool
small enough to preempt mid-speculation, stop strings and max_tokens inside an accepted run, logprobs, grammars),
blocks given back, and a chi-square test that sampling with drafts draws from the distribution plain sampling
draws from. A tiny random model with a byte tokenizer; its greedy answers fall into loops, which n-grams predict."""
import argparse
import dataclasses
import json

import pytest
import torch

from minivllm.engine import LLM, LLMEngine, apply_penalties, filter_logits
from minivllm.paged_cache import check_block_invariants
from minivllm.runner import EngineArgs
from minivllm.scheduler import SamplingParams
from minivllm.speculative import NgramProposer, SpeculativeConfig, draft_verdicts
from minivllm.structured import StructuredOutputsParams
from minivllm.testing import logits, tiny_chat_folder
from minivllm.weights import load_model

SPEC = {"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": None}
PROMPTS = ["def add(a, b):\n    return a + b\n" * 3, "hello world " * 5, "abc", "The quick brown fox", "x = [1, 2, 3]\n"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tok = load_model(str(tiny_chat_folder(tmp_path_factory.mktemp("tiny-spec"), sharp=True)))
    return model, tok


def generate(tiny, params, spec=None, prompts=PROMPTS, **kw):
    kw = {"num_kv_blocks": 256, "block_size": 4, **kw}
    engine = LLMEngine(*tiny, speculative_config=spec, **kw)
    outs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], engine


# --- the proposer and the options --------------------------------------------------------------------------------

def test_ngram_lookup():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.lookup([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]  # suffix 1 2 3 seen at 0: what followed it
    assert p.lookup([1, 2, 9, 7, 1, 2, 8, 1, 2]) == [8, 1, 2]  # the latest earlier occurrence wins
    assert p.lookup([5, 1, 2, 7, 9, 9, 2]) == [7, 9, 9]  # no 2- or 3-gram match: the last token alone
    assert p.lookup([1, 2, 3, 4]) == []  # nothing repeats
    assert p.lookup([7]) == [] and p.lookup([7, 7]) == [7]
    assert NgramProposer(k=3, min_n=2, max_n=2).lookup([5, 1, 2, 7, 9, 2]) == []  # a 1-gram is below min_n
    assert NgramProposer(k=2, min_n=1, max_n=4).lookup([3, 4, 5, 3, 4]) == [5, 3]  # k caps the draft


def test_speculative_config():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 5, 5)  # vLLM's defaults
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse({}) is None
    bad = [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "positive integer"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "not supported"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"num_speculative_tokens": 2, "draft_tokens": 3}, "unknown keys"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ]
    for spec, words in bad:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(spec)


def test_cli_flag(tiny):
    ap = EngineArgs.add_cli_args(argparse.ArgumentParser())
    a = EngineArgs.from_cli_args(ap.parse_args(["--speculative-config", json.dumps(SPEC)]))
    assert a.speculative_config == SPEC
    with pytest.raises(SystemExit):
        ap.parse_args(["--speculative-config", "{oops"])
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLMEngine(*tiny, num_kv_blocks=64, speculative_config={"method": "ngram"})


# --- greedy: the same tokens as without speculation ----------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {},
    {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
    {"max_num_batched_tokens": 16},  # drafts trimmed to what the budget leaves
    {"enable_prefix_caching": False, "block_size": 16},
])
def test_greedy_identical(tiny, kw):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base, _ = generate(tiny, params, **kw)
    got, engine = generate(tiny, params, SPEC, **kw)
    assert [o.token_ids for o in got] == [o.token_ids for o in base]
    assert [o.text for o in got] == [o.text for o in base]
    drafts, drafted, accepted = engine.spec_counts
    assert drafts > 0 and 0 < accepted <= drafted
    assert engine.num_steps < sum(len(o.token_ids) for o in base)  # several tokens in some steps
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # every block back


def test_preempted_mid_speculation(tiny):
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    base, _ = generate(tiny, params)
    engine = LLMEngine(*tiny, num_kv_blocks=40, block_size=4, speculative_config=SPEC)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done, drafted_when_preempted = {}, 0
    while engine.has_unfinished_requests():
        engine._propose()  # what `step` does first; step proposes again, identically
        drafting = {s.seq_id for s in engine.scheduler.running if s.draft}
        outs = engine.step()
        drafted_when_preempted += sum(s.seq_id in drafting for s in engine.last_batch.preempted)
        check_block_invariants(engine.block_manager, [s.block_table for s in engine.scheduler.running])
        for o in outs:
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert engine.scheduler.num_preemptions > 0 and drafted_when_preempted > 0
    assert [done[i] for i in ids] == [o.token_ids for o in base]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stops_inside_an_accepted_run(tiny):
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base, _ = generate(tiny, plain)
    for i, o in enumerate(base):  # a stop string from the middle of each answer; lengths that end mid-draft
        stop = o.text[20:22] if len(o.text) > 24 else None
        for params in [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=stop),
                       SamplingParams(temperature=0, max_tokens=7 + i, ignore_eos=True)]:
            want, _ = generate(tiny, params, prompts=[PROMPTS[i]])
            got, engine = generate(tiny, params, SPEC, prompts=[PROMPTS[i]])
            assert (got[0].text, got[0].token_ids, got[0].finish_reason, got[0].stop_reason) == (
                want[0].text, want[0].token_ids, want[0].finish_reason, want[0].stop_reason)
            assert len(got[0].token_ids) == len(want[0].token_ids) <= params.max_tokens


def test_stop_token_inside_an_accepted_run(tiny):
    base, _ = generate(tiny, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    accepted = 0
    for o, prompt in zip(base, PROMPTS):
        params = SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[o.token_ids[30]])
        want, _ = generate(tiny, params, prompts=[prompt])
        got, engine = generate(tiny, params, SPEC, prompts=[prompt])
        assert got[0].token_ids == want[0].token_ids and got[0].stop_reason == want[0].stop_reason == o.token_ids[30]
        accepted += engine.spec_counts[2]
    assert accepted > 0


def test_prefix_cache_holds_only_accepted_tokens(tiny):
    "A prompt that is an earlier prompt and its answer reuses that answer's cached blocks: the same tokens follow."
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = LLMEngine(*tiny, num_kv_blocks=256, block_size=4, speculative_config=SPEC)
    llm = LLM.from_engine(engine)
    first = llm.generate(PROMPTS, params, use_tqdm=False)
    assert engine.spec_counts[1] > engine.spec_counts[2] > 0  # some guesses were rejected: their K/V was written
    follow = [{"prompt_token_ids": tiny[1].encode(p) + o.outputs[0].token_ids} for p, o in zip(PROMPTS, first)]
    again = llm.generate(follow, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 40 for o in again)  # each answer's blocks came from the prefix cache
    fresh, _ = generate(tiny, params, prompts=follow, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in again] == [o.token_ids for o in fresh]


def test_logprobs_and_grammar(tiny):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    base, _ = generate(tiny, params)
    got, engine = generate(tiny, params, SPEC)
    assert engine.spec_counts[2] > 0
    for a, b in zip(got, base):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    so = StructuredOutputsParams(regex=r"(ab|cd)+e(fg)*h")
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    base, _ = generate(tiny, params, prompts=["abcdabcd", "efgefg"])
    got, engine = generate(tiny, params, SPEC, prompts=["abcdabcd", "efgefg"])
    assert [o.text for o in got] == [o.text for o in base]
    assert [o.token_ids for o in got] == [o.token_ids for o in base]


def test_disable_by_batch_size(tiny):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _, engine = generate(tiny, params, dict(SPEC, disable_by_batch_size=len(PROMPTS) - 1))
    first = engine.spec_counts[0]
    _, engine2 = generate(tiny, params, dict(SPEC, disable_by_batch_size=len(PROMPTS)))
    assert engine2.spec_counts[0] > first  # at most the limit running: drafts from the first decode on
    stats = engine2.stats()
    assert (stats.counters["spec_decode_num_drafts"], stats.counters["spec_decode_num_accepted_tokens"]) == (
        engine2.spec_counts[0], engine2.spec_counts[2])


# --- sampling: the distribution of plain sampling -------------------------------------------------------------------

def test_draft_verdicts():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    x, px, rest = draft_verdicts(probs, [1, None])
    assert x.tolist() == [1, -1] and px.tolist() == pytest.approx([0.3, 0.0])
    assert rest.tolist() == [pytest.approx([0.5, 0.0, 0.2]), pytest.approx([0.1, 0.1, 0.8])]


def exact_distribution(model, prompt_ids: list[int], params: SamplingParams, steps: int) -> dict[tuple, float]:
    "P(first `steps` output tokens) under plain sampling, from the model's own forward passes (one per prefix)."
    out = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for prefix, p in out.items():
            row = logits(model, torch.tensor(prompt_ids + list(prefix)))[-1].float().clone()
            apply_penalties(row, prompt_ids, list(prefix), params)
            probs = filter_logits(row / params.temperature, params.top_k, params.top_p, params.min_p).softmax(-1)
            for t in probs.nonzero()[:, 0].tolist():
                nxt[prefix + (t,)] = p * float(probs[t])
        out = nxt
    return out


def chi_square_p(counts: dict, expected: dict, n: int) -> float:
    "The p-value of Pearson's chi-square test, cells with fewer than 5 expected samples pooled into one."
    big = {k for k, q in expected.items() if q * n >= 5}
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [expected[k] * n for k in big] + [n - sum(expected[k] * n for k in big)]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), torch.tensor(chi2 / 2)))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                   presence_penalty=0.5, frequency_penalty=0.3, max_tokens=3, ignore_eos=True),
])
def test_sampling_distribution(tiny, params):
    model, tok = tiny
    greedy, _ = generate(tiny, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), prompts=["abc"])
    ids = tok.encode("abc") + greedy[0].token_ids  # the model's own loop: likely tokens, seen before, drafted
    n = 3000
    exact = exact_distribution(model, ids, params, 3)
    prompts = [{"prompt_token_ids": ids}] * n
    got, engine = generate(tiny, params, SPEC, prompts=prompts, max_num_seqs=256, num_kv_blocks=4096)
    drafts, drafted, accepted = engine.spec_counts
    assert n // 10 < drafts <= n and 0 < accepted < drafted  # requests drafted (at most once), kept and not
    counts = {}
    for o in got:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    assert set(counts) <= {k for k, q in exact.items() if q > 0}  # nothing plain sampling could not draw
    p_value = chi_square_p(counts, exact, n)
    print(f"drafts {drafts}, drafted {drafted}, accepted {accepted}, cells {len(counts)}, p-value {p_value:.3f}")
    assert p_value > 1e-3
    hotter = dataclasses.replace(params, temperature=params.temperature * 1.5)  # the test can tell them apart
    assert chi_square_p(counts, exact_distribution(model, ids, hotter, 3), n) < 1e-3


# --- the server: the flag, the counters, the log line ---------------------------------------------------------------

def test_server_counts_drafts(tiny, caplog):
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.server import BackgroundServer, build_app

    model, tok = tiny
    plain = LLMEngine(model, tok, block_size=4, num_kv_blocks=512)
    want = LLM.from_engine(plain).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=512, speculative_config=SPEC)
    with BackgroundServer(build_app(engine, "tiny")) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=40, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream) == want[0].outputs[0].text
        text = httpx.get(srv.url + "/metrics").text
        m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert m["vllm:spec_decode_num_drafts_total"] > 0
        assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
        with caplog.at_level("INFO", logger="minivllm.server"):
            metrics = srv.app.state.engine.metrics
            metrics._logged = (0,) * len(metrics._counters)  # as if the last line were before the request
            line = metrics.log_stats(engine.stats())
        assert "Avg generation throughput" in line and "SpecDecoding: mean acceptance length" in line
        assert line in caplog.text


def test_server_refuses_a_bad_config():
    import subprocess
    import sys

    bad = '{"method": "eagle", "num_speculative_tokens": 2}'
    out = subprocess.run([sys.executable, "-m", "minivllm.server", "--speculative-config", bad], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "method 'eagle' is not supported" in out.stderr
    out = subprocess.run([sys.executable, "-m", "minivllm.server", "--speculative-config", "{5"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "not valid JSON" in out.stderr


TRITON_SCRIPT = """
import json, torch
from minivllm.engine import LLM, LLMEngine
from minivllm.scheduler import SamplingParams
from minivllm.testing import tiny_chat_folder
from minivllm.weights import load_model
torch.set_num_threads(1)
model, tok = load_model(str(tiny_chat_folder(sharp=True)))
prompts = ["def add(a, b):\\n    return a + b\\n" * 2, "hello world " * 4]
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
out = {}
for name, spec in (("plain", None), ("spec", json.loads(__import__("sys").argv[1]))):
    e = LLMEngine(model, tok, num_kv_blocks=64, block_size=4, attention_backend="triton", speculative_config=spec)
    out[name] = [o.outputs[0].token_ids for o in LLM.from_engine(e).generate(prompts, params, use_tqdm=False)]
    out[name + "_accepted"] = e.spec_counts[2]
    out["decoder"] = type(e.runner.decoder).__name__
print(json.dumps(out))
"""


def test_triton_decode_rows(tmp_path):
    "The verification rows through the Triton decode kernel (interpreted on the CPU): the same tokens."
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    script = tmp_path / "triton_spec.py"
    script.write_text(TRITON_SCRIPT)
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script), json.dumps(SPEC)], capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["decoder"] == "TritonDecode" and got["spec_accepted"] > 0
    assert got["spec"] == got["plain"]
