"""minivllm.engine: the sampler (penalties, top-k/top-p/min-p, seeds, logprobs), incremental detokenization and stop
conditions, the engine step (batched == alone, preemption invisible, budget and cap, abort) and the offline `LLM`
API. Fast tests use a tiny random Qwen2 with a byte-level tokenizer (compared with transformers where parity is the
point) and a scripted model that emits chosen text (multi-byte characters, stop strings across tokens). The bundled
model (`slow`, float32) holds the figures that matter: batched == alone, preempted == unpreempted, no half
characters streamed, logprobs equal to a direct forward."""
import json
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import tiny_model_folder
import torch.nn.functional as F
from transformers import Qwen2Config as HFConfig
from transformers import Qwen2ForCausalLM as HFModel

from minivllm.engine import (LLM, LLMEngine, Sampler, apply_penalties, detokenize_incrementally, draw_token, filter_logits,
                             nucleus)
from minivllm.qwen2 import ContiguousKVCache, Qwen2Config
from minivllm.weights import load_safetensors_model, Tokenizer
from minivllm.scheduler import RequestTooLong, SamplingError, SamplingParams, Sequence

LOGIT_TOL = 1e-4  # float32: logprobs / logits, ours vs a direct forward


@contextmanager
def one_thread():
    """torch on one thread. On a shared 2-core machine two threads spin against other jobs: measured here, tiny models
    ran ~20x and the bundled model ~8x faster on one thread under load, and the bundled model only ~1.5x slower on an
    idle machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try: yield
    finally: torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def threads():
    with one_thread(): yield


# ---------------------------------------------------------------------------------------------------------------
# A tiny random model with a real byte-level tokenizer (the 04 notebook's tiny_model_folder)

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tiny_model_folder(tmp_path_factory.mktemp("tiny-engine"), sharp=True)
    return load_safetensors_model(d), Tokenizer.from_folder(d), HFModel.from_pretrained(d).eval()


def engine(tiny, **kw) -> LLMEngine:
    kw = {"num_kv_blocks": 256, "block_size": 4, **kw}
    return LLMEngine(tiny[0], tiny[1], **kw)


def llm(tiny, **kw) -> LLM:
    return LLM.from_engine(engine(tiny, **kw))


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def full_logits(model, ids: list[int]) -> torch.Tensor:
    "Logits of every position, one forward without any cache: [len, V]."
    meta = ContiguousKVCache(model.config.num_hidden_layers).batch([0], [len(ids)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


PROMPTS = ["Hello, my name is", "The capital of France", "def fib(n):", "你好，世界", "1 2 3 4 5 6 7 8 9 10 11 12",
           "emoji 🎉🎉 time", "a"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)


# ---------------------------------------------------------------------------------------------------------------
# A scripted model: emits a chosen token sequence, whatever the context (to test text handling exactly)

class ScriptedModel(torch.nn.Module):
    "After a prompt of `prompt_len` tokens it emits `script`, then `fill`; the token after position p is fixed."
    def __init__(self, vocab_size: int, prompt_len: int, script: list[int], fill: int):
        super().__init__()
        self.config = Qwen2Config(vocab_size=vocab_size, hidden_size=4, intermediate_size=4, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=512)
        self.lm_head = torch.nn.Linear(4, vocab_size, bias=False)   # the engine reads device and dtype here
        nxt = torch.full((512,), fill)
        nxt[prompt_len - 1:prompt_len - 1 + len(script)] = torch.tensor(script)
        self.nxt = nxt
        self.base = torch.linspace(0.0, -1.0, vocab_size)            # a fixed order for what is left when banned

    def forward(self, input_ids, positions, meta):
        return positions.float()[:, None]                           # [T, 1]: the position is all it needs

    def compute_logits(self, hidden):
        nxt = self.nxt[hidden[:, 0].long()]
        return self.base + 10.0 * F.one_hot(nxt, self.config.vocab_size).float()


@pytest.fixture(scope="module")
def scripted(tiny):
    tok = tiny[1]
    def make(text: str, prompt: str = "ab", fill_text: str = "."):
        script = tok.encode(text)
        return LLMEngine(ScriptedModel(tok.vocab_size, len(tok.encode(prompt)), script, tok.encode(fill_text)[0]), tok,
                         block_size=4, num_kv_blocks=64)
    return make


def stream(eng: LLMEngine, prompt, params) -> tuple[list, object]:
    "Run one request to the end through engine.step(); every output it produced, and the last."
    rid = eng.add_request(prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    assert outs[-1].finished
    return outs, outs[-1]


# ---------------------------------------------------------------------------------------------------------------
# Sampling: unit tests on hand-made rows

def test_apply_penalties_on_a_hand_made_row():
    row = torch.tensor([2.0, -2.0, 1.0, 0.5, -1.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(row, prompt_ids=[0, 1], output_ids=[2, 2, 3], p=p)
    # repetition (prompt + output tokens 0..3): positive / 2, negative * 2; token 4 unseen
    # then frequency (counts 2:2, 3:1) and presence, on output tokens only
    expect = torch.tensor([1.0, -4.0, 0.5 - 0.5 * 2 - 0.25, 0.25 - 0.5 * 1 - 0.25, -1.0])
    assert torch.allclose(row, expect)
    row = torch.tensor([2.0, -2.0, 1.0])
    apply_penalties(row, [0], [], SamplingParams(frequency_penalty=1.0, presence_penalty=1.0))
    assert row.tolist() == [2.0, -2.0, 1.0]  # no output yet: frequency and presence do nothing


def test_filter_logits():
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    inf = float("-inf")
    assert filter_logits(row, 2, 1.0, 0.0).isinf().tolist() == [False, False, True, True]
    assert filter_logits(row, 0, 0.75, 0.0).isinf().tolist() == [False, False, True, True]   # 0.5 + 0.3 >= 0.75
    assert filter_logits(row, 0, 0.5, 0.0).isinf().tolist() == [False, True, True, True]
    assert filter_logits(row, 0, 0.81, 0.0).isinf().tolist() == [False, False, False, True]
    assert filter_logits(row, 0, 1.0, 0.4).isinf().tolist() == [False, False, True, True]    # 0.15 < 0.4 * 0.5
    assert filter_logits(row, 0, 1.0, 0.0).tolist() == row.tolist()
    assert filter_logits(row, 3, 0.6, 0.0).isinf().tolist() == [False, False, True, True]
    assert inf not in filter_logits(row, 10, 1.0, 0.0).tolist()                              # top_k > V: off


def mk(output: list[int] = (), **kw) -> Sequence:
    "A sequence with prompt [1, 2] and `output` so far, sampled with SamplingParams(**kw)."
    s = Sequence("r", [1, 2], SamplingParams(**kw), None)
    s.token_ids += list(output)
    return s


def test_sampler_greedy_top_k_1_min_tokens_and_seeds():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    s = Sampler(0)
    toks, lps = s(logits, [mk(temperature=0), mk(top_k=1), mk(temperature=0.5, top_k=1), mk(temperature=0)],
                  [None] * 4, eos_ids=[])
    assert toks == logits.argmax(-1).tolist() and lps == [None] * 4
    # min_tokens bans eos and stop tokens; ignore_eos lifts the eos ban only
    row = torch.zeros(1, 10); row[0, 3] = 5; row[0, 4] = 4; row[0, 5] = 3
    assert s(row, [mk(temperature=0, min_tokens=1)], [None], eos_ids=[3])[0] == [4]
    assert s(row, [mk(temperature=0, min_tokens=1, stop_token_ids=[4])], [None], eos_ids=[3])[0] == [5]
    assert s(row, [mk(temperature=0, min_tokens=1, ignore_eos=True)], [None], eos_ids=[3])[0] == [3]
    assert s(row, [mk(temperature=0)], [None], eos_ids=[3])[0] == [3]
    # a seeded row draws the same token whatever else is in the batch
    alone = [Sampler(1)(logits[1:2], [mk(seed=7)], [torch.Generator().manual_seed(7)], [])[0][0] for _ in range(3)]
    for other in range(3):
        batch = Sampler(other)(logits, [mk(), mk(seed=7), mk(temperature=0.3), mk()],
                               [None, torch.Generator().manual_seed(7), None, None], [])[0]
        assert batch[1] == alone[0]
    assert len(set(alone)) == 1


def test_sampler_follows_the_distribution_and_the_filters():
    torch.manual_seed(1)
    logits = torch.randn(1, 8) * 1.5
    s = Sampler(3)
    draws = torch.tensor([s(logits, [mk(temperature=0.7)], [None], [])[0][0] for _ in range(3000)])
    freq = torch.bincount(draws, minlength=8).float() / len(draws)
    err = (freq - (logits[0] / 0.7).softmax(-1)).abs().max().item()
    print(f"max |empirical - softmax(logits / 0.7)| over 3000 draws: {err:.3f}")
    assert err < 0.035
    for kw in (dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3)):
        allowed = set((~filter_logits(logits[0], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0)).isinf())
                      .nonzero().flatten().tolist())
        got = {s(logits, [mk(**kw)], [None], [])[0][0] for _ in range(300)}
        assert got <= allowed and len(got) > 1, (kw, got, allowed)


def test_nucleus_on_a_full_vocabulary_is_the_sorted_definition():
    # a vocabulary of Qwen2's size: the candidates (1,024, then 16,384) and the full sort all give the same nucleus
    torch.manual_seed(4)
    ranks = torch.arange(1, 151_937).float()[torch.randperm(151_936)]
    for z in (-2 * ranks.log(), -1.2 * ranks.log(), torch.randn(151_936) / 20):
        probs, idx = torch.sort(z.softmax(-1), descending=True)
        for top_p in (0.3, 0.9, 0.999):
            kept = set(idx[probs.cumsum(-1) - probs < top_p].tolist())
            got = nucleus(z, top_p)
            assert set((~got.isinf()).nonzero().flatten().tolist()) == kept
            assert torch.equal(got[list(kept)], z[list(kept)])  # the kept logits are untouched


def test_draw_token_follows_the_distribution_across_chunks():
    g = torch.Generator().manual_seed(5)
    probs = torch.zeros(151_936)
    probs[[0, 127, 128, 90_000, 151_935]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    draws = torch.tensor([draw_token(probs, g) for _ in range(4000)])
    assert set(draws.tolist()) == {0, 127, 128, 90_000, 151_935}
    freq = torch.bincount(draws, minlength=151_936).float() / len(draws)
    assert (freq - probs).abs().max() < 0.03
    assert draw_token(torch.full((300,), float("nan")), g) is None
    assert draw_token(torch.tensor([0.0, 0.0, 1.0]), g) == 2


def test_sampler_logprobs_are_the_raw_distributions():
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    ref = torch.log_softmax(logits, -1)
    toks, lps = Sampler(0)(logits, [mk(temperature=0, logprobs=4, repetition_penalty=1.5), mk(temperature=1.0, logprobs=0)],
                           [None, torch.Generator().manual_seed(3)], [])
    assert lps[1].keys() == {toks[1]}
    for i, t in enumerate(toks):
        lp = lps[i][t]
        assert abs(lp.logprob - ref[i, t].item()) < 1e-6
        assert lp.rank == int((ref[i] > ref[i, t]).sum()) + 1
    top = sorted((v for k, v in lps[0].items()), key=lambda l: l.rank)
    assert [l.rank for l in top] == [1, 2, 3, 4] and len(lps[0]) == 4    # greedy: the chosen one is rank 1
    assert [l.logprob for l in top] == sorted((l.logprob for l in top), reverse=True)
    assert torch.allclose(torch.tensor([l.logprob for l in top]), ref[0].topk(4).values)


# ---------------------------------------------------------------------------------------------------------------
# Incremental detokenization

CJK_EMOJI = ["你好，世界！", "🎉 party 🎉🎉", "naïve café — 日本語のテキスト", "👩‍👩‍👧 family", "mixed ascii 中文 and 😀 ok"]


def check_incremental(tok: Tokenizer, text: str, window: int = 0) -> int:
    "Feed the tokens of `text` one by one; deltas never hold half a character and add up to the text."
    prompt = tok.encode("prompt: ")
    ids = list(prompt)
    pre = read = len(prompt)
    out, split, kept = "", 0, None
    for t in tok.encode(text):
        ids.append(t)
        new, pre, read, kept = detokenize_incrementally(tok, ids, pre, read, True, kept, window)
        assert kept is None or kept == tok.decode(ids[pre:read])  # the text it keeps is its prefix's
        assert "\ufffd" not in new, (text, new)
        split += new == ""
        out += new
    assert out == text
    return split


@pytest.mark.parametrize("window", [0, 1, 3, 8])
def test_detokenize_incrementally_tiny_byte_tokenizer(tiny, window):
    held = sum(check_incremental(tiny[1], t, window) for t in CJK_EMOJI)
    assert held > 10  # one token per byte: many steps held a partial character back


# ---------------------------------------------------------------------------------------------------------------
# Stop conditions and streamed text, exactly (scripted model)

def test_stop_string_spanning_tokens_is_caught_and_excluded(scripted):
    text = "Hi 你好🎉 world<STOP>tail and more"
    for stop, expect, reason in [("<STOP>", "Hi 你好🎉 world", "<STOP>"), ("好🎉 w", "Hi 你", "好🎉 w"),
                                 (["zzz", "world", "🎉"], "Hi 你好", "🎉"), ("o", "Hi 你好🎉 w", "o")]:
        eng = scripted(text)
        outs, last = stream(eng, "ab", SamplingParams(temperature=0, max_tokens=60, stop=stop))
        o = last.outputs[0]
        deltas = [x.outputs[0].delta_text for x in outs]
        assert o.text == expect and o.finish_reason == "stop"
        assert o.stop_reason == reason
        assert "".join(deltas) == o.text, "streamed text must never be taken back"
        assert not any("\ufffd" in d for d in deltas)
        assert sum((x.outputs[0].delta_token_ids for x in outs), []) == o.token_ids
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_streaming_multibyte_text_without_stops(scripted):
    text = "".join(CJK_EMOJI)
    eng = scripted(text)
    n = len(eng.tokenizer.encode(text))
    outs, last = stream(eng, "ab", SamplingParams(temperature=0, max_tokens=n))
    deltas = [x.outputs[0].delta_text for x in outs]
    assert last.outputs[0].text == text and last.outputs[0].finish_reason == "length"
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert sum(d == "" for d in deltas) > 10   # partial characters were held back, not emitted
    assert len(outs) == n                       # one output per step, even when it carries no text


def test_stop_token_ids_eos_min_tokens_ignore_eos(scripted, tiny):
    tok = tiny[1]
    eos = tok.eos_token_ids[0]
    text = "xy<|im_end|>abcdef"
    def run(**kw):
        return stream(scripted(text), "ab", SamplingParams(**{"temperature": 0, "max_tokens": 8, **kw}))[1].outputs[0]
    o = run()
    assert (o.text, o.token_ids[-1], o.finish_reason, o.stop_reason) == ("xy", eos, "stop", None)
    o = run(ignore_eos=True)
    assert o.finish_reason == "length" and len(o.token_ids) == 8 and o.text == "xyabcde"
    o = run(min_tokens=5)                      # eos is banned for the first 5 tokens
    assert len(o.token_ids) >= 5 and eos not in o.token_ids[:5]
    y = tok.encode("y")[0]
    o = run(stop_token_ids=[y])
    assert (o.token_ids, o.finish_reason, o.stop_reason) == (tok.encode("xy"), "stop", y)
    o = run(stop_token_ids=[y], min_tokens=3)  # stop tokens are banned too
    assert y not in o.token_ids[:3]
    o = run(max_tokens=3, ignore_eos=True)
    assert len(o.token_ids) == 3 and o.finish_reason == "length"


def test_min_tokens_holds_back_stop_strings(scripted):
    o = stream(scripted("ab, cdefghijkl"), "ab", SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop=","))[1]
    assert len(o.outputs[0].token_ids) >= 6


def test_stop_token_text_is_not_part_of_the_output(scripted, tiny):
    y = tiny[1].encode("y")[0]
    o = stream(scripted("xyz and more"), "ab", SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[y]))[1].outputs[0]
    assert (o.finish_reason, o.stop_reason) == ("stop", y)
    assert o.text == "x"


def test_max_tokens_none_runs_to_max_model_len(tiny):
    eng = engine(tiny, max_model_len=40)
    outs, last = stream(eng, "twelve chars", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(last.prompt_token_ids) + len(last.outputs[0].token_ids) == 40
    assert last.outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------------------------
# The engine on the tiny model: parity, batching, preemption, limits, abort

@pytest.mark.parametrize("block_size", [1, 4, 16, 7])
@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_parity_with_transformers(tiny, block_size, chunked):
    "Prompts (one byte = one token) just below, on and just above block boundaries, all in one batch."
    model, tok, hf = tiny
    lens = sorted({n for n in (block_size - 1, block_size, block_size + 1, 2 * block_size + 1) if n >= 1})
    prompts = [("the quick brown fox jumps over the lazy dog " * 2)[:n] for n in lens]
    kw = dict(max_num_batched_tokens=6) if chunked else {}
    got = tokens(llm(tiny, block_size=block_size, num_kv_blocks=512 // block_size, enable_chunked_prefill=chunked,
                     **kw).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False))
    same = 0
    for p, g in zip(prompts, got):
        ids = torch.tensor([tok.encode(p)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        same += ref == g
    print(f"block_size={block_size}, chunked={chunked}: greedy identical to transformers {same}/{len(prompts)}")
    assert same == len(prompts)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_separate_prefill_steps_change_nothing_but_the_steps(tiny, params):
    "Steps of prompts alone, then of decodes alone (the CUDA-graph policy): the same tokens as mixed steps."
    mixed = llm(tiny, max_num_batched_tokens=16, log_steps=True)
    separate = llm(tiny, max_num_batched_tokens=16, prefill_steps="separate", log_steps=True)
    a, b = (tokens(x.generate(PROMPTS, params, use_tqdm=False)) for x in (mixed, separate))
    assert a == b
    log = separate.engine.step_log
    assert all(s.prefill_tokens == 0 or s.decode_seqs == 0 for s in log), "a step held prompts and decodes"
    assert any(s.prefill_tokens and s.decode_seqs for s in mixed.engine.step_log)  # the policy made a difference
    assert separate.engine.args.prefill_steps == "separate" and mixed.engine.args.prefill_steps == "mixed"


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_equals_alone(tiny, params):
    batched = tokens(llm(tiny).generate(PROMPTS, params, use_tqdm=False))
    alone = [tokens(llm(tiny).generate(p, params, use_tqdm=False))[0] for p in PROMPTS]
    assert batched == alone
    # and in another batch, in another order, next to other requests
    other = PROMPTS[::-1] + ["filler one", "filler two"]
    mixed = tokens(llm(tiny, block_size=7).generate(other, [params] * len(PROMPTS) + [SamplingParams(max_tokens=5)] * 2,
                                                     use_tqdm=False))
    assert mixed[:len(PROMPTS)][::-1] == alone


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunked,prefix", [(True, True), (True, False), (False, False), (False, True),
                                            ("separate", True), ("separate", False)])
def test_preemption_is_invisible(tiny, params, chunked, prefix):
    ref = tokens(llm(tiny, enable_prefix_caching=False).generate(PROMPTS, params, use_tqdm=False))
    kw = dict(max_num_batched_tokens=10) if chunked else {}
    kw |= dict(prefill_steps="separate") if chunked == "separate" else {}
    tight = llm(tiny, num_kv_blocks=12, block_size=4, enable_chunked_prefill=bool(chunked), max_model_len=48,
                enable_prefix_caching=prefix, **kw)
    got = tokens(tight.generate(PROMPTS, params, use_tqdm=False))
    st = tight.engine.stats()
    print(f"{'seeded' if params.seed else 'greedy'}, chunked={chunked}, prefix caching={prefix}: preempted == "
          f"unpreempted {sum(a == b for a, b in zip(ref, got))}/{len(ref)} with {st.num_preemptions} preemptions")
    assert got == ref
    assert st.num_preemptions > 0
    assert st.num_free_blocks == st.num_blocks and all(r == 0 for r in tight.engine.block_manager.allocator.ref_counts)
    assert not tight.engine.scheduler.running and not tight.engine.scheduler.waiting


def test_n_completions_seeded(tiny):
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a = llm(tiny).generate("once upon a time", p, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    outs = [o.token_ids for o in a.outputs]
    assert len({tuple(o) for o in outs}) == 3, "n seeded completions should differ"
    b = llm(tiny, block_size=7).generate(["other", "once upon a time", "x"], SamplingParams(n=3, temperature=1.0, seed=11,
                                         max_tokens=12, ignore_eos=True), use_tqdm=False)[1]
    assert [o.token_ids for o in b.outputs] == outs   # reproducible, in another batch
    tight = llm(tiny, num_kv_blocks=10, block_size=4, max_model_len=40, enable_chunked_prefill=False)
    c = tight.generate(["once upon a time"] * 2, p, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in c[0].outputs] == outs and [o.token_ids for o in c[1].outputs] == outs


def test_seeds_and_top_k_1(tiny):
    g = tokens(llm(tiny).generate(PROMPTS, GREEDY, use_tqdm=False))
    k1 = tokens(llm(tiny).generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=20, ignore_eos=True),
                                   use_tqdm=False))
    assert k1 == g
    s1 = tokens(llm(tiny).generate(PROMPTS, SEEDED, use_tqdm=False))
    s2 = tokens(llm(tiny, seed=99).generate(PROMPTS, SEEDED, use_tqdm=False))   # the engine's own seed is irrelevant
    s3 = tokens(llm(tiny).generate(PROMPTS, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=4321,
                                                           max_tokens=20, ignore_eos=True), use_tqdm=False))
    assert s1 == s2 and s1 != s3 and s1 != g


def test_penalties_change_a_repetitive_output(tiny):
    prompt = "ab ab ab ab ab ab ab ab"
    base = tokens(llm(tiny).generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False))[0]
    for kw in (dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=1.5)):
        pen = tokens(llm(tiny).generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw),
                                        use_tqdm=False))[0]
        assert pen != base, kw
    rep = tokens(llm(tiny).generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                           frequency_penalty=2.0), use_tqdm=False))[0]
    assert max(map(rep.count, rep)) <= max(map(base.count, base))


def test_logprobs_equal_a_direct_forward(tiny):
    model, tok, _ = tiny
    for p in (SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=8, logprobs=2, ignore_eos=True)):
        out = llm(tiny, block_size=3).generate(["The capital of France", "你好"], p, use_tqdm=False)
        worst = 0.0
        for r in out:
            o = r.outputs[0]
            ref = torch.log_softmax(full_logits(model, r.prompt_token_ids + o.token_ids), -1)
            assert len(o.logprobs) == len(o.token_ids)
            for j, (t, lp) in enumerate(zip(o.token_ids, o.logprobs)):
                row = ref[len(r.prompt_token_ids) - 1 + j]
                worst = max(worst, abs(lp[t].logprob - row[t].item()))
                assert int((row > row[t] + 1e-4).sum()) + 1 <= lp[t].rank <= int((row > row[t] - 1e-4).sum()) + 1
                top = sorted((l for k, l in lp.items() if l.rank <= p.logprobs), key=lambda l: l.rank)
                assert [l.rank for l in top] == list(range(1, p.logprobs + 1))
                assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
                assert set(lp) <= set(row.topk(p.logprobs).indices.tolist()) | {t}
            assert math.isclose(o.cumulative_logprob, sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)),
                                rel_tol=1e-6)
        assert worst <= LOGIT_TOL
    assert llm(tiny).generate("x", GREEDY, use_tqdm=False)[0].outputs[0].logprobs is None


def test_budget_and_cap_are_never_exceeded(tiny):
    for chunked, budget in ((True, 16), (False, 128)):
        eng = engine(tiny, max_num_seqs=3, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                     num_kv_blocks=64, max_model_len=128)
        seen = []
        schedule = eng.scheduler.schedule
        def spy():
            b = schedule()
            seen.append((b.num_tokens, len(b.items), len(eng.scheduler.running)))
            return b
        eng.scheduler.schedule = spy
        outs = LLM.from_engine(eng).generate([f"request number {i} " * (i % 4 + 1) for i in range(10)],
                                             SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 10 for o in outs)
        assert max(n for n, _, _ in seen) <= budget and max(k for _, k, _ in seen) <= 3 and max(r for *_, r in seen) <= 3
        if chunked: assert max(n for n, _, _ in seen) == budget           # the budget was actually reached
        assert max(k for _, k, _ in seen) == 3                               # and so was the cap
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_abort_frees_every_block(tiny):
    eng = engine(tiny, max_num_batched_tokens=8, num_kv_blocks=64, max_num_seqs=2)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    keep = eng.add_request("keep going", p)
    mid = eng.add_request("a long prompt that is prefilled in chunks of eight", p)
    wait = eng.add_request("waiting for a seat", p)
    for _ in range(3): eng.step()
    sched = eng.scheduler
    by_id = {s.request_id: s for s in [*sched.running, *sched.waiting]}
    assert by_id[mid].num_computed < by_id[mid].num_tokens and by_id[mid].block_table.blocks   # mid-prefill
    assert by_id[wait] in sched.waiting
    assert eng.abort(mid) and eng.abort(wait)
    assert not eng.abort(mid) and not eng.abort("no such request")
    assert [s.request_id for s in sched.running] == [keep] and not sched.waiting
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks - len(by_id[keep].block_table.blocks)
    eng.step()
    assert eng.abort(keep)                                                                    # while decoding
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks and not eng.has_unfinished_requests()
    assert all(r == 0 for r in eng.block_manager.allocator.ref_counts)
    # the engine goes on as if nothing happened
    after = tokens(LLM.from_engine(eng).generate("keep going", p, use_tqdm=False))
    assert after == tokens(llm(tiny).generate("keep going", p, use_tqdm=False))


SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 2


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_caching_changes_nothing_but_work(tiny, params):
    prompts = [f"{SYSTEM}Question {i}: what is {i} + {i}?" for i in range(5)]
    outs = {}
    for prefix in (False, True):
        for chunked in (False, True):
            L = llm(tiny, enable_prefix_caching=prefix, enable_chunked_prefill=chunked,
                    max_num_batched_tokens=32 if chunked else 2048)
            res = L.generate(prompts[:1], params, use_tqdm=False) + L.generate(prompts[1:], params, use_tqdm=False)
            st = L.engine.stats()
            outs[prefix, chunked] = tokens(res)
            assert st.num_free_blocks == st.num_blocks
            if prefix:
                assert all(r.num_cached_tokens >= len(SYSTEM) // 4 * 4 for r in res[1:])
                assert st.prefix_cache_hits > 0
            else:
                assert all(r.num_cached_tokens == 0 for r in res) and st.prefix_cache_hits == 0
    assert all(v == outs[False, False] for v in outs.values())


def test_prefix_hit_then_a_prefill_without_chunking(tiny):
    L = llm(tiny, enable_chunked_prefill=False)                      # prefix caching is on by default
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    L.generate("abcdefghX", p, use_tqdm=False)                       # publishes 2 full blocks of 4
    got = tokens(L.generate(["abcdefghY", "a much longer prompt"], p, use_tqdm=False))
    assert got == tokens(llm(tiny, enable_prefix_caching=False).generate(["abcdefghY", "a much longer prompt"], p,
                                                                         use_tqdm=False))


def test_max_model_len_larger_than_the_pool_is_refused_or_served(tiny):
    try:
        eng = engine(tiny, num_kv_blocks=4, block_size=4, max_model_len=64)
        eng.add_request("ten tokens", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    except (ValueError, RequestTooLong):
        return
    for _ in range(200):
        eng.step()
        if not eng.has_unfinished_requests(): break
    assert not eng.has_unfinished_requests(), "livelock: the request can never be scheduled again"


# ---------------------------------------------------------------------------------------------------------------
# The offline API

def test_generate_accepts_every_prompt_form_and_keeps_the_order(tiny):
    model, tok, _ = tiny
    L = llm(tiny)
    ids = tok.encode("def fib(n):")
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (9, 1, 5, 3, 7)]
    prompts = ["Hello", {"prompt_token_ids": ids}, {"prompt": "你好"}, "def fib(n):", {"prompt_token_ids": tok.encode("ab")}]
    outs = L.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5, 3, 7]
    assert [o.prompt for o in outs] == ["Hello", None, "你好", "def fib(n):", None]
    assert outs[1].prompt_token_ids == ids == outs[3].prompt_token_ids
    assert outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids[:1]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert len({o.request_id for o in outs}) == 5
    one = L.generate(ids, params[0], use_tqdm=False)                     # a single prompt of token ids
    assert len(one) == 1 and one[0].outputs[0].token_ids == L.generate("def fib(n):", params[0], use_tqdm=False)[0].outputs[0].token_ids
    assert L.generate([], use_tqdm=False) == []
    with pytest.raises(ValueError):
        L.generate(["a", "b"], [params[0]], use_tqdm=False)
    with pytest.raises(ValueError):
        L.generate({"prompt_token_ids": [10**6]}, use_tqdm=False)


def test_generate_refuses_and_cleans_up(tiny):
    L = llm(tiny, max_model_len=32)
    with pytest.raises(RequestTooLong):
        L.generate(["fine", "x" * 40], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(RequestTooLong):
        L.generate("", use_tqdm=False)
    with pytest.raises(SamplingError) as e:
        L.generate("fine", SamplingParams(top_p=0), use_tqdm=False)
    assert e.value.param == "top_p"
    assert not L.engine.has_unfinished_requests() and L.engine.block_manager.num_free_blocks == L.engine.block_manager.num_blocks
    assert not L.engine.scheduler.waiting and not L.engine.scheduler.running


def test_chat(tiny):
    model, tok, _ = tiny
    L = llm(tiny)
    conv = [{"role": "user", "content": "Hi there"}]
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = L.chat(conv, p, use_tqdm=False)
    text = tok.apply_chat_template(conv)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert len(one) == 1 and one[0].prompt == text
    assert one[0].outputs[0].token_ids == L.generate(text, p, use_tqdm=False)[0].outputs[0].token_ids
    two = L.chat([conv, [{"role": "user", "content": "Another"}]], p, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert "Another" in two[1].prompt


def test_stats_and_step_log(tiny):
    L = llm(tiny, log_steps=True)
    L.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    st = L.engine.stats()
    assert st.generation_tokens == 15 and st.prompt_tokens == sum(len(L.tokenizer.encode(p)) for p in PROMPTS[:3])
    assert st.num_steps == len(L.engine.step_log) > 0 and st.num_running == st.num_waiting == 0
    assert st.kv_cache_usage == 0.0 and st.num_free_blocks == st.num_blocks


# ---------------------------------------------------------------------------------------------------------------
# The bundled model (slow)

QUESTIONS = ["Write a Python function that checks whether a number is prime.", "What is a hash map?",
             "写一个冒泡排序。", "用中文简单介绍一下你自己。", "Reply with three emoji that describe summer.",
             "What does `git stash` do?"]
BUNDLED_GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def bundled():
    from minivllm.weights import load_model
    model, tok = load_model(None, dtype="float32", device="cpu")
    return model, tok


@pytest.fixture(scope="module")
def bundled_reference(bundled):
    "The 6 questions as chats, batched, in a roomy pool: greedy and seeded."
    model, tok = bundled
    L = LLM.from_engine(LLMEngine(model, tok, num_kv_blocks=256, block_size=16))
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=24)
    with one_thread():
        return convs, L.chat(convs, BUNDLED_GREEDY, use_tqdm=False), L.chat(convs, seeded, use_tqdm=False), seeded


@pytest.mark.slow
def test_bundled_batched_equals_alone(bundled, bundled_reference):
    model, tok = bundled
    convs, batched, _, _ = bundled_reference
    L = LLM.from_engine(LLMEngine(model, tok, num_kv_blocks=64, block_size=16))
    alone = [L.chat(c, BUNDLED_GREEDY, use_tqdm=False)[0] for c in convs]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(batched, alone))
    print(f"bundled: batched == alone {same}/{len(convs)}")
    print(repr(batched[0].outputs[0].text))
    assert same == len(convs)
    assert all(len(o.outputs[0].token_ids) > 0 for o in batched)


@pytest.mark.slow
@pytest.mark.parametrize("chunked,prefix", [(False, False), (True, True), (False, True)])
def test_bundled_preemption_is_invisible(bundled, bundled_reference, chunked, prefix):
    "4 chats growing to ~60 tokens each in 24 blocks of 4 (96 tokens): two are admitted, then they outgrow the pool."
    model, tok = bundled
    convs, greedy_ref, seeded_ref, seeded = bundled_reference
    convs, n = convs[:4], 4        # batched == alone, so the roomy 6-chat batch is their reference
    for name, params, ref in (("greedy", BUNDLED_GREEDY, greedy_ref[:n]), ("seeded", seeded, seeded_ref[:n])):
        kw = dict(max_num_batched_tokens=24) if chunked else {}
        tight = LLM.from_engine(LLMEngine(model, tok, num_kv_blocks=24, block_size=4, max_model_len=96,
                                          enable_chunked_prefill=chunked, enable_prefix_caching=prefix, **kw))
        got = tight.chat(convs, params, use_tqdm=False)
        same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(ref, got))
        st = tight.engine.stats()
        print(f"bundled, {name}, chunked={chunked}, prefix caching={prefix}: preempted == unpreempted {same}/{n} "
              f"with {st.num_preemptions} preemptions; free blocks after {st.num_free_blocks}/{st.num_blocks}")
        assert same == n
        assert st.num_preemptions >= 3 and st.num_free_blocks == st.num_blocks


@pytest.mark.slow
def test_bundled_streaming_never_emits_half_a_character(bundled):
    model, tok = bundled
    eng = LLMEngine(model, tok, num_kv_blocks=64, block_size=16)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in
               ("用中文写两句关于春天的诗。", "Reply only with ten different emoji, no words.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    rids = [eng.add_request(p, params) for p in prompts]
    deltas = {r: [] for r in rids}
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            deltas[o.request_id].append(o.outputs[0].delta_text)
            if o.finished: final[o.request_id] = o.outputs[0]
    split_tokens = 0  # steps that emitted no text: a character was still incomplete
    for r in rids:
        o = final[r]
        assert not any("\ufffd" in d for d in deltas[r]), deltas[r]
        assert "".join(deltas[r]) == o.text
        split_tokens += sum(d == "" for d in deltas[r])
        print(repr(o.text))
    assert any(ord(c) > 0x2E80 for o in final.values() for c in o.text)    # CJK or emoji were generated
    print(f"bundled: {split_tokens} steps held back half a character")


@pytest.mark.slow
def test_bundled_tokenizer_detokenizes_incrementally(bundled):
    tok = bundled[1]
    assert any("\ufffd" in tok.decode([t]) for s in CJK_EMOJI for t in tok.encode(s))  # split characters exist
    for text in CJK_EMOJI + ["def f():\n    return '✓'  # 完成"]:
        for window in (0, 8):  # as the function alone runs it, and as the engine does (DETOKENIZE_WINDOW)
            check_incremental(tok, text, window)


@pytest.mark.slow
def test_bundled_stop_string_and_logprobs(bundled):
    model, tok = bundled
    L = LLM.from_engine(LLMEngine(model, tok, num_kv_blocks=64, block_size=16))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that adds two numbers."}])
    base = L.generate(prompt, SamplingParams(temperature=0, max_tokens=20, logprobs=5), use_tqdm=False)[0]
    o = base.outputs[0]
    # logprobs: the chosen token's equals log_softmax of a direct forward over prompt + output
    ref = torch.log_softmax(full_logits(model, base.prompt_token_ids + o.token_ids), -1)
    n = len(base.prompt_token_ids)
    worst = max(abs(lp[t].logprob - ref[n - 1 + j, t].item()) for j, (t, lp) in enumerate(zip(o.token_ids, o.logprobs)))
    print(f"bundled: max |logprob - log_softmax(direct forward)| = {worst:.2e}")
    assert worst <= LOGIT_TOL
    for lp in o.logprobs:
        top = sorted((l for l in lp.values() if l.rank <= 5), key=lambda l: l.rank)
        assert [l.rank for l in top] == [1, 2, 3, 4, 5]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
    # a stop string that spans a token boundary is caught and left out
    pieces = [tok.decode(o.token_ids[:k]) for k in range(len(o.token_ids) + 1)]
    k = next(k for k in range(3, len(o.token_ids)) if len(pieces[k]) - len(pieces[k - 1]) >= 2
             and len(pieces[k + 1]) > len(pieces[k]) and "\ufffd" not in pieces[k + 1] and pieces[k + 1].strip())
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]):][:2]        # the end of token k-1 + the start of token k
    cut = L.generate(prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    print(f"bundled: stop {stop!r} -> {cut.text!r}")
    assert cut.text == o.text[:o.text.find(stop)] and (cut.finish_reason, cut.stop_reason) == ("stop", stop)


@pytest.mark.slow
def test_bundled_min_tokens_and_repetition_penalty(bundled):
    model, tok = bundled
    L = LLM.from_engine(LLMEngine(model, tok, num_kv_blocks=64, block_size=16))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Answer with one word: is water wet?"}])
    short = L.generate(prompt, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 8     # it stops early by itself (eos)
    longer = L.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=12), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= 12 and not set(tok.eos_token_ids) & set(longer.token_ids[:12])
    print(f"bundled: {short.text!r} ({len(short.token_ids)} tokens) -> min_tokens=12: {longer.text!r}")
    rep = "the cat sat on the mat. " * 6
    p0 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = L.generate(rep, p0, use_tqdm=False)[0].outputs[0]
    pen = L.generate(rep, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5),
                     use_tqdm=False)[0].outputs[0]
    print(f"bundled: repetitive prompt -> {plain.text!r}; repetition_penalty=1.5 -> {pen.text!r}")
    assert pen.token_ids != plain.token_ids


# ---------------------------------------------------------------------------------------------------------------
# EngineArgs: one configuration for LLM, LLMEngine, the command lines

def test_engine_args_one_place_for_every_default(tiny):
    import argparse, dataclasses
    from minivllm.engine import EngineArgs
    eng = engine(tiny)
    # the defaults, with what the device decides filled in: on the CPU, mixed steps of 2,048 tokens
    assert EngineArgs().prefill_steps == "auto" and EngineArgs().max_num_batched_tokens is None
    assert eng.args == dataclasses.replace(EngineArgs(), num_kv_blocks=256, block_size=4,
                                           prefill_steps="mixed", max_num_batched_tokens=2048)
    assert eng.scheduler.config.max_num_seqs == EngineArgs().max_num_seqs == 64
    with pytest.raises(TypeError, match="no_such_option"):
        engine(tiny, no_such_option=1)
    ap = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = ap.parse_args(["--max-num-seqs", "3", "--num-gpu-blocks-override", "64", "--kv-cache-memory", "512M",
                        "--no-enable-chunked-prefill", "--max-model-len", "128"])
    a = EngineArgs.from_cli_args(ns)
    assert (a.max_num_seqs, a.num_kv_blocks, a.kv_cache_memory, a.enable_chunked_prefill) == (3, 64, 512_000_000, False)
    e2 = LLMEngine(tiny[0], tiny[1], a)
    assert e2.scheduler.config.max_num_batched_tokens == 2048 and e2.block_manager.num_blocks == 64
    assert "--enable-prefix-caching" in ap.format_help() and "--log-steps" not in ap.format_help()


def test_llm_takes_engine_args_and_has_vllms_attribute(tiny_folder):
    L = LLM(str(tiny_folder), dtype="float32", device="cpu", num_kv_blocks=32, block_size=4, max_num_seqs=2)
    assert L.llm_engine is L.engine and L.llm_engine.args.max_num_seqs == 2
    assert L.llm_engine.args.model == str(tiny_folder) and L.llm_engine.block_manager.num_blocks == 32
    out = L.generate("hi", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


# ---------------------------------------------------------------------------------------------------------------
# n > 1 shares the prompt; errors stay with their request; tiny temperatures are greedy

def blocks_in_use(eng) -> int:
    return eng.block_manager.num_blocks - eng.block_manager.num_free_blocks


@pytest.mark.parametrize("caching", [False, True])
def test_n_completions_share_the_prompt_blocks(tiny, caching):
    held = {}
    for n in (1, 4):
        eng = engine(tiny, enable_prefix_caching=caching)
        eng.add_request(list(range(37)), SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=4))
        eng.step()
        after_prompt = blocks_in_use(eng)
        eng.step()
        held[n] = (after_prompt, blocks_in_use(eng))
        assert eng.stats().prompt_tokens == 37
    assert held[1] == (10, 10)
    assert held[4] == (10, 13)              # 10 shared prompt blocks + 3 copies of the partly filled last one


def test_n_completions_are_the_same_shared_or_not(tiny):
    sp = SamplingParams(n=4, temperature=0.9, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    shared = llm(tiny).generate("Hello", sp, use_tqdm=False)[0]
    apart = llm(tiny, max_num_seqs=1).generate("Hello", sp, use_tqdm=False)[0]   # n > cap: four separate prompts
    assert [c.token_ids for c in shared.outputs] == [c.token_ids for c in apart.outputs]
    assert len({tuple(c.token_ids) for c in shared.outputs}) > 1
    for a, b in zip(shared.outputs, apart.outputs):
        assert math.isclose(a.cumulative_logprob, b.cumulative_logprob, rel_tol=1e-5)


def test_a_non_finite_row_fails_only_its_request(tiny):
    eng = engine(tiny)
    bad = eng.add_request("spoiled", SamplingParams(temperature=0.7, max_tokens=8, n=2))
    good = eng.add_request("fine", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    run = eng.runner.run
    def spoil(batch):
        logits = run(batch).clone()
        for i, s in enumerate(batch.sampling):
            if s.request_id == bad and s.num_output_tokens >= 2:
                logits[i] = float("nan")
        return logits
    eng.runner.run = spoil
    finals = {}
    while eng.has_unfinished_requests():
        finals |= {o.request_id: o for o in eng.step() if o.finished}
    assert [c.finish_reason for c in finals[bad].outputs] == ["error", "error"] and "not finite" in finals[bad].error
    assert finals[good].error is None and len(finals[good].outputs[0].token_ids) == 8
    assert blocks_in_use(eng) == 0


def test_a_detokenizer_error_fails_only_its_request(tiny, monkeypatch):
    import minivllm.engine as engine_module
    eng = engine(tiny)
    bad = eng.add_request("bad", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    good = eng.add_request("good", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    victim, real = eng.requests[bad].prompt_token_ids, engine_module.detokenize_incrementally
    def broken(tokenizer, ids, *a, **kw):
        if list(ids[: len(victim)]) == victim:
            raise UnicodeError("cannot decode")
        return real(tokenizer, ids, *a, **kw)
    monkeypatch.setattr(engine_module, "detokenize_incrementally", broken)
    finals = {}
    while eng.has_unfinished_requests():
        finals |= {o.request_id: o for o in eng.step() if o.finished}
    assert finals[bad].outputs[0].finish_reason == "error" and "UnicodeError" in finals[bad].error
    assert finals[good].outputs[0].finish_reason == "length" and blocks_in_use(eng) == 0


def test_tiny_temperatures_are_greedy(tiny):
    L = llm(tiny)
    ref = tokens(L.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False))
    for t in (1e-45, 1e-6):
        got = tokens(L.generate(["a", "b"], SamplingParams(temperature=t, max_tokens=8, ignore_eos=True), use_tqdm=False))
        assert got == ref


# ---------------------------------------------------------------------------------------------------------------
# Structured outputs through the engine (the grammar's mask in the sampler, its state advanced after each token)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_outputs_parse_and_leave_other_requests_unchanged(tiny):
    from minivllm.structured import StructuredOutputsParams
    L = llm(tiny)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = tokens(L.generate(["free text", "more free text"], plain, use_tqdm=False))
    json_sp = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"]))
    outs = L.generate(["free text", "give json", "more free text", "pick one"], [plain, json_sp, plain, seeded],
                      use_tqdm=False)
    assert tokens([outs[0], outs[2]]) == alone                    # unconstrained rows: identical tokens
    obj = json.loads(outs[1].outputs[0].text)
    assert set(obj) == {"name", "age"} and 0 <= obj["age"] <= 120 and outs[1].outputs[0].finish_reason == "stop"
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in outs[3].outputs)
    assert blocks_in_use(L.engine) == 0


def test_structured_outputs_bad_input_is_refused_before_anything_is_queued(tiny):
    from minivllm.structured import StructuredOutputError, StructuredOutputsParams
    eng = engine(tiny)
    with pytest.raises(StructuredOutputError):
        eng.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(StructuredOutputError):
        eng.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, regex="a+")))
    with pytest.raises(SamplingError, match="min_tokens"):
        eng.add_request("x", SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")))
    assert not eng.has_unfinished_requests() and blocks_in_use(eng) == 0


def test_structured_output_cut_by_max_tokens_is_length(tiny):
    from minivllm.structured import StructuredOutputsParams
    sp = SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    out = llm(tiny).generate("json please", sp, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def mixed_rows(V: int = 300):
    "Eight rows of every kind the sampler knows, with their logits and seeded generators."
    torch.manual_seed(5)
    logits = torch.randn(8, V) * 3
    out = [3, 4, 4]  # three tokens so far: what the penalties read, and min_tokens=5 still bans
    seqs = [mk(out, temperature=0), mk(out, temperature=0, repetition_penalty=1.3), mk(out, temperature=0.8, seed=11),
            mk(out, temperature=0.9, top_p=0.8), mk(out, temperature=1.2, top_k=5, min_p=0.05),
            mk(out, temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3, seed=3),
            mk(out, min_tokens=5, temperature=0.6), mk(out, temperature=1.0, top_k=40, top_p=0.9, logprobs=2)]
    assert all(s.output_token_ids == out for s in seqs)
    return logits, seqs


def gens(seqs):
    return [torch.Generator().manual_seed(s.params.seed) if s.params.seed is not None else None for s in seqs]


def test_batched_sampler_gives_the_row_by_row_tokens():
    # the same algorithm on all rows at once: the same uniform numbers, in row order, give the same tokens
    logits, seqs = mixed_rows()
    for trial in range(5):
        batched, lps = Sampler(trial)(logits, seqs, gens(seqs), eos_ids=[7])
        ref_sampler, ref_gens = Sampler(trial), gens(seqs)
        one_by_one = [ref_sampler._sample_row(logits[i], s, ref_gens[i], [7]) for i, s in enumerate(seqs)]
        assert batched == one_by_one
        assert lps[7] is not None and len(lps[7]) >= 1 and all(lp is None for lp in lps[:7])
        raw = torch.log_softmax(logits[7], -1)
        assert lps[7][batched[7]].logprob == pytest.approx(float(raw[batched[7]]), abs=1e-6)


def test_batched_sampler_waits_for_the_device_once(monkeypatch):
    # host reads of a tensor (each a wait for the GPU there) during one call: .tolist, .item, bool, int, float
    logits, seqs = mixed_rows()
    calls = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__"):
        orig = getattr(torch.Tensor, name)
        spy = lambda self, *a, _f=orig, _n=name, **k: calls.append(_n) or _f(self, *a, **k)  # noqa: E731
        monkeypatch.setattr(torch.Tensor, name, spy)
    no_logprobs = [s for s in seqs if s.params.logprobs is None]
    Sampler(0)(logits[: len(no_logprobs)], no_logprobs, gens(no_logprobs), eos_ids=[7])
    assert calls == ["tolist"]
    calls.clear()
    Sampler(0)(logits, seqs, gens(seqs), eos_ids=[7])  # with a logprobs row: one more, for all of them
    assert calls == ["tolist", "tolist"]


def test_batched_sampler_leaves_the_logits_alone_and_takes_an_empty_batch():
    logits, seqs = mixed_rows()
    before = logits.clone()
    Sampler(0)(logits, seqs, gens(seqs), eos_ids=[7])
    assert torch.equal(logits, before)  # penalties and filters work on copies: logprobs read the raw rows
    assert Sampler(0)(torch.zeros(0, 0), [], [], eos_ids=[7]) == ([], [])
