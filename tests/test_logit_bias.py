"""OpenAI's `logit_bias` (issue 50): a banned token never comes, a forced one always does, on every path: the plain
sampler, the head's arg-max shortcut of a prepared CPU model (07), speculative decoding (exact under the bias), and
the server with the official client; an id outside the vocabulary is a 400 that names it."""
import openai
import pytest

from minivllm.engine import LLM, LLMEngine
from minivllm.runner import load_prepared
from minivllm.scheduler import SamplingParams
from minivllm.server import BackgroundServer, build_app

PROMPT = "abcabcabcabcabcabc abcabcabc"  # repeats: n-gram drafts find something to propose


def tokens(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, **kw), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("engine_kw", [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                                    "prompt_lookup_max": 3, "prompt_lookup_min": 2}}],
                         ids=["plain", "speculative"])
def test_a_banned_token_never_comes_and_a_forced_one_always_does(tiny, engine_kw):
    llm = LLM.from_engine(LLMEngine(*tiny, num_kv_blocks=128, block_size=4, **engine_kw))
    greedy = tokens(llm, temperature=0)
    banned = greedy[0]
    without = tokens(llm, temperature=0, logit_bias={banned: -100})
    assert banned not in without and without != greedy
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        assert tokens(llm, logit_bias={65: 100}, **kw) == [65] * 24
    plain = LLM.from_engine(LLMEngine(*tiny, num_kv_blocks=128, block_size=4))
    assert without == tokens(plain, temperature=0, logit_bias={banned: -100})  # speculation exact under the bias
    assert not engine_kw or llm.llm_engine.spec_counts[0] > 0  # drafts were checked


def test_the_heads_argmax_shortcut_is_not_taken_for_a_biased_row(tiny_folder):
    model, tok = load_prepared(str(tiny_folder), "float32")
    llm = LLM.from_engine(LLMEngine(model, tok, num_kv_blocks=128, block_size=4))
    greedy = tokens(llm, temperature=0)
    assert tokens(llm, temperature=0, logit_bias={greedy[0]: -100})[0] != greedy[0]
    assert tokens(llm, temperature=0, logit_bias={66: 100}) == [66] * 24


def test_logit_bias_through_the_server_with_the_official_client(tiny):
    with BackgroundServer(build_app(LLMEngine(*tiny, num_kv_blocks=128, block_size=4), "tiny")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        forced = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           logit_bias={"65": 100}, extra_body={"ignore_eos": True})
        assert forced.choices[0].message.content == tiny[1].decode([65]) * 6
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, logit_bias={"99999": -100})
        assert e.value.body["param"] == "logit_bias" and "99999" in e.value.body["message"]
