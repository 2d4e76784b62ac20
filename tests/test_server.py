"""The OpenAI-compatible server (05_server) against real clients on loopback.

A real uvicorn server in a background thread, driven by the official `openai` client and by raw httpx: chat and
completions, streamed and not, SSE framing, stop strings with multi-byte characters, seeded sampling, `n`,
logprobs, every bad input (4xx with an OpenAI-style error, never a 500, no block leaked), the API key, clients that
hang up (blocks back at once), 64 concurrent streaming clients, the bounded queue's bookkeeping, and the command
line. Faults, overload and shutdown are in test_server_faults.py; a two-minute soak in test_server_soak.py.
Fast tests use a tiny random model; those marked `slow` serve the bundled Qwen2.5-Coder-0.5B.
"""
import asyncio, json, os, re, subprocess, sys, tempfile, time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from minivllm.engine import LLMEngine
from minivllm.weights import load_model
from minivllm.server import AsyncEngine, BackgroundServer, available_cores, build_app
from minivllm.utils import free_port

ROOT = Path(__file__).resolve().parent.parent


def tiny_app(tiny, **kw):
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=1024, max_num_seqs=64, log_steps=True)
    return build_app(engine, "tiny", **kw)


@pytest.fixture(scope="module")
def server(tiny):
    with BackgroundServer(tiny_app(tiny, max_body_bytes=1 << 20)) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    "Every sample of /metrics, by name (labels dropped: one model per server)."
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}


def wait_idle(url: str, timeout: float = 5.0) -> dict[str, float]:
    "The metrics once nothing runs and no block is held (or whatever they are at the timeout)."
    t0 = time.monotonic()
    while True:
        m = metrics(url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() - t0 > timeout: return m
        time.sleep(0.02)


def sse_events(resp: httpx.Response) -> list[str]:
    "The `data:` payloads of a server-sent event stream, checking the framing (data lines, blank line between)."
    raw = resp.read().decode()
    assert raw.endswith("\n\n"), raw[-50:]
    events = raw[:-2].split("\n\n")
    for e in events: assert e.startswith("data: ") and "\n" not in e, e
    return [e[len("data: "):] for e in events]


CHAT = [{"role": "user", "content": "Hello there"}]


# --- the basics ------------------------------------------------------------------------------------------------
def test_health_models_tokenize(server, tiny):
    _, tok = tiny
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 512
    r = httpx.post(server.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert r == {"tokens": tok.encode("héllo"), "count": len(tok.encode("héllo")), "max_model_len": 512}
    r = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(CHAT))
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.apply_chat_template(CHAT)
    for bad in [{}, {"prompt": "a", "messages": CHAT}, {"tokens": [10**9]}]:
        path = "/detokenize" if "tokens" in bad else "/tokenize"
        r = httpx.post(server.url + path, json=bad)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_chat_and_completions_with_openai_client(client):
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion" and chat.model == "tiny"
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert (chat.usage.completion_tokens, chat.usage.total_tokens) == (7, chat.usage.prompt_tokens + 7)
    comp = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0)
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion" and comp.choices[0].finish_reason == "length"
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens) == (len("Once upon"), 5)
    # several prompts in one completions request, token-id prompts, and the model may be left out
    many = client.completions.create(model="tiny", prompt=["a", "bb", "ccc"], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in many.choices] == list(range(6)) and many.usage.prompt_tokens == 6
    r = httpx.post(str(client.base_url).rstrip("/") + "/completions", json={"prompt": [72, 105], "max_tokens": 2}).json()
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    # a stop token (here: every token) ends the completion with finish_reason "stop"
    stop = client.completions.create(model="tiny", prompt="x", max_tokens=20, temperature=0,
                                     extra_body={"stop_token_ids": list(range(259))})
    assert (stop.choices[0].finish_reason, stop.usage.completion_tokens) == ("stop", 1)


def _stream_chat(client, **kw) -> tuple[list[str], list]:
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, stream=True, **kw))
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    return texts, chunks


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}])
def test_streamed_text_equals_whole_text(client, sampling):
    kw = dict(max_tokens=60, extra_body={"ignore_eos": True}, **sampling)
    whole = client.chat.completions.create(model="tiny", messages=CHAT, **kw).choices[0].message.content
    texts, chunks = _stream_chat(client, **kw)
    assert "".join(texts) == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length" and len({c.id for c in chunks}) == 1
    comp = client.completions.create(model="tiny", prompt="abc", **kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="abc", stream=True, **kw)) == comp


def test_no_chunk_holds_a_broken_character(client):
    "Seeded sampling from the tiny model emits valid multi-byte characters; no chunk splits one."
    kw = dict(max_tokens=200, temperature=1.0, extra_body={"ignore_eos": True})
    found = 0
    for seed in range(4):
        whole = client.completions.create(model="tiny", prompt="x", seed=seed, **kw).choices[0].text
        chunks = [c.choices[0].text for c in client.completions.create(model="tiny", prompt="x", seed=seed, stream=True, **kw)]
        assert "".join(chunks) == whole
        multi = [ch for ch in whole if ord(ch) > 127 and ch != "\ufffd"]
        found += len(multi)
        # a character split across two chunks would decode as U+FFFD in both halves: the join would differ
        # from the whole, and the count of U+FFFD would grow
        assert sum(c.count("\ufffd") for c in chunks) == whole.count("\ufffd")
    assert found > 0, "the sampled text should contain multi-byte characters for this test to mean something"


def test_stop_string_with_multibyte_characters(client):
    kw = dict(model="tiny", prompt="y", max_tokens=200, temperature=1.0, extra_body={"ignore_eos": True})
    for seed in range(20):
        text = client.completions.create(seed=seed, **kw).choices[0].text
        hits = [i for i, ch in enumerate(text) if ord(ch) > 127 and ch != "\ufffd" and i > 0]
        if hits: break
    else: pytest.fail("no multi-byte character in 20 seeded samples")
    i = hits[0]
    stop = text[i - 1:i + 1]                              # an ASCII-or-whatever character and a multi-byte one
    assert len(stop.encode()) > len(stop)
    expected = text[:text.find(stop)]
    cut = client.completions.create(seed=seed, stop=[stop], **kw).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(seed=seed, stop=[stop], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    # the same through chat, with the stop string taken from the chat's own output
    ckw = dict(model="tiny", messages=CHAT, max_tokens=200, temperature=1.0, extra_body={"ignore_eos": True})
    for seed in range(20):
        text = client.chat.completions.create(seed=seed, **ckw).choices[0].message.content
        hits = [i for i, ch in enumerate(text) if ord(ch) > 127 and ch != "\ufffd"]
        if hits: break
    stop = text[hits[0]]
    got = client.chat.completions.create(seed=seed, stop=stop, **ckw).choices[0]
    assert (got.message.content, got.finish_reason) == (text[:text.find(stop)], "stop")
    texts, chunks = _stream_chat(client, seed=seed, stop=stop, max_tokens=200, temperature=1.0, extra_body={"ignore_eos": True})
    assert "".join(texts) == text[:text.find(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_and_n(client):
    kw = dict(model="tiny", messages=CHAT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=12, **kw).choices[0].message.content
    assert a == b and a != c
    two = client.chat.completions.create(seed=11, n=2, **kw)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert two.choices[0].message.content == a and two.choices[1].message.content != a   # completion i uses seed + i
    assert two.usage.completion_tokens == 24
    texts = {0: "", 1: ""}
    for ch in client.chat.completions.create(seed=11, n=2, stream=True, **kw):
        for choice in ch.choices: texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [x.message.content for x in two.choices]


def test_vllm_sampling_extras(client):
    "top_k, min_p, repetition/presence/frequency penalties, min_tokens, stop_token_ids reach the engine."
    kw = dict(model="tiny", prompt="abc", max_tokens=20, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    top1 = client.completions.create(temperature=1.0, seed=5, **{**kw, "extra_body": {"ignore_eos": True, "top_k": 1}})
    assert top1.choices[0].text == greedy
    extras = {"ignore_eos": True, "min_p": 0.1, "repetition_penalty": 1.3}
    r = client.completions.create(temperature=0.8, seed=1, presence_penalty=1.0, frequency_penalty=0.5, **{**kw, "extra_body": extras})
    assert r.usage.completion_tokens == 20
    early = client.completions.create(temperature=0, **{**kw, "extra_body": {"stop_token_ids": list(range(200)), "min_tokens": 5}})
    assert early.usage.completion_tokens >= 5


def test_logprobs(client):
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for e in content:
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert len(e.top_logprobs) == 3 and e.logprob == e.top_logprobs[0].logprob   # greedy: the top token
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == chat.choices[0].message.content
    comp = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)
    streamed = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                                   stream=True, extra_body={"ignore_eos": True}))
    got = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in content])


def test_sse_framing_and_usage(server):
    body = {"messages": CHAT, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + "/v1/chat/completions", json=body).json()
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    strip = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}
    assert strip(chunks[-1]["usage"]) == strip(whole["usage"])          # the same counts; and the second request
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # found the first one's prompt cached
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == whole["choices"][0]["message"]["content"]
    # completions: text chunks, no usage chunk unless asked
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "text_completion" for e in events[:-1])
    assert all("usage" not in json.loads(e) for e in events[:-1])


# --- bad input --------------------------------------------------------------------------------------------------
HI = [{"role": "user", "content": "hi"}]
BAD = [  # (what, path, body: dict -> JSON, str -> as is, expected status, expected param)
    ("malformed JSON", "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user"', 400, None),
    ("empty body", "/v1/chat/completions", "", 400, None),
    ("body not an object", "/v1/chat/completions", "[1, 2]", 400, None),
    ("messages missing", "/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("messages empty", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("message not an object", "/v1/chat/completions", {"messages": ["hi"]}, 400, "messages[0]"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("role missing", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content"),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-4", "messages": HI}, 404, "model"),
    ("model a number", "/v1/chat/completions", {"model": 4, "messages": HI}, 400, "model"),
    ("temperature a string", "/v1/chat/completions", {"messages": HI, "temperature": "hot"}, 400, "temperature"),
    ("temperature a numeric string", "/v1/chat/completions", {"messages": HI, "temperature": "0.5"}, 400, "temperature"),
    ("n a float", "/v1/chat/completions", {"messages": HI, "n": 2.0}, 400, "n"),
    ("stream a string", "/v1/chat/completions", {"messages": HI, "stream": "yes"}, 400, "stream"),
    ("stop a number", "/v1/chat/completions", {"messages": HI, "stop": 5}, 400, "stop"),
    ("stop an empty string", "/v1/chat/completions", {"messages": HI, "stop": [""]}, 400, "stop"),
    ("max_tokens negative", "/v1/chat/completions", {"messages": HI, "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/chat/completions", {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens absurd", "/v1/chat/completions", {"messages": HI, "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens past the context", "/v1/chat/completions", {"messages": HI, "max_tokens": 510}, 400, "max_tokens"),
    ("max_tokens a float", "/v1/chat/completions", {"messages": HI, "max_tokens": 1e9}, 400, "max_tokens"),
    ("max_completion_tokens negative", "/v1/chat/completions", {"messages": HI, "max_completion_tokens": -1}, 400, "max_tokens"),
    ("temperature 3", "/v1/chat/completions", {"messages": HI, "temperature": 3}, 400, "temperature"),
    ("temperature -1", "/v1/chat/completions", {"messages": HI, "temperature": -1}, 400, "temperature"),
    ("temperature NaN", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", {"messages": HI, "top_p": 0}, 400, "top_p"),
    ("top_p 1.5", "/v1/chat/completions", {"messages": HI, "top_p": 1.5}, 400, "top_p"),
    ("top_k -5", "/v1/chat/completions", {"messages": HI, "top_k": -5}, 400, "top_k"),
    ("presence_penalty 5", "/v1/chat/completions", {"messages": HI, "presence_penalty": 5}, 400, "presence_penalty"),
    ("n 100", "/v1/chat/completions", {"messages": HI, "n": 100}, 400, "n"),
    ("n 0", "/v1/chat/completions", {"messages": HI, "n": 0}, 400, "n"),
    ("top_logprobs 50", "/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    ("stop_token_ids outside the vocabulary", "/v1/chat/completions", {"messages": HI, "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    ("seed too large", "/v1/chat/completions", {"messages": HI, "seed": 2**70}, 400, "seed"),
    ("logit_bias outside the vocabulary", "/v1/chat/completions", {"messages": HI, "logit_bias": {"99999": 5}}, 400, "logit_bias"),
    ("logit_bias too strong", "/v1/chat/completions", {"messages": HI, "logit_bias": {"1": 500}}, 400, "logit_bias"),
    ("stream_options without stream", "/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("prompt longer than the context", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
    ("completions: prompt missing", "/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("completions: empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("completions: empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("completions: prompt a number", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("completions: token id outside the vocabulary", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("completions: negative token id", "/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("completions: prompt longer than the context", "/v1/completions", {"prompt": "word " * 200}, 400, "prompt"),
    ("completions: one of two prompts too long", "/v1/completions", {"prompt": ["ok", "word " * 200]}, 400, "prompt"),
    ("completions: logprobs 50", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("completions: echo", "/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("oversized body", "/v1/completions", {"prompt": "x" * (2 << 20)}, 413, None),
    ("unknown path", "/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server, what, path, body, status, param):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if status == 404 and param == "model": assert err["code"] == "model_not_found"


def test_bad_input_leaves_nothing_behind(server, client):
    "After every bad input (run above, and again here at once), nothing runs, no block is held, and it still serves."
    async def all_bad():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            return await asyncio.gather(*[c.post(p, **({"content": b} if isinstance(b, str) else {"json": b}))
                                          for _, p, b, _, _ in BAD])
    assert all(400 <= r.status_code < 500 for r in asyncio.run(all_bad()))
    m = wait_idle(server.url)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
    assert client.chat.completions.create(model="tiny", messages=HI, max_tokens=3).usage.completion_tokens <= 3
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405


def test_api_key(tiny):
    with BackgroundServer(tiny_app(tiny, api_key="s3cret")) as srv:
        url = srv.url + "/v1/chat/completions"
        body = {"messages": HI, "max_tokens": 2}
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=HI, max_tokens=2).usage.completion_tokens <= 2
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200


# --- clients that leave -----------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server):
    async def leave_early(i):
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json={"prompt": f"client {i} " * 3, "max_tokens": 450,
                                                                 "ignore_eos": True, "stream": True}) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += bool(line)
                    if n == 3: return True                       # hang up after three chunks
    async def main():
        tasks = [asyncio.create_task(leave_early(i)) for i in range(6)]
        await asyncio.sleep(0)
        return await asyncio.gather(*tasks)
    before = metrics(server.url)["vllm:generation_tokens_total"]
    assert all(asyncio.run(main()))
    m = wait_idle(server.url, timeout=3)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    # nobody ran on: far fewer than 6 x 450 tokens were made
    assert m["vllm:generation_tokens_total"] - before < 6 * 450 / 2


@pytest.fixture
def slow_steps(server, monkeypatch):
    "Each engine step sleeps 5 ms, so 400 steps outlast a client's half-second timeout on any CPU."
    eng = server.app.state.engine.engine
    step = eng.step
    def slow():
        time.sleep(0.005)
        return step()
    monkeypatch.setattr(eng, "step", slow)


def test_disconnect_while_waiting_for_a_whole_response(server, slow_steps):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 480, "ignore_eos": True}, timeout=0.5)
    m = wait_idle(server.url, timeout=3)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0


# --- load -------------------------------------------------------------------------------------------------------
def test_64_concurrent_streaming_clients(server):
    aeng: AsyncEngine = server.app.state.engine
    steps0 = len(aeng.engine.step_log)
    async def one(c, i):
        text, finish, usage = "", None, None
        stream = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"client {i}"}],
                                                 max_tokens=32, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return finish, usage.completion_tokens
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120) as c:
            return await asyncio.wait_for(asyncio.gather(*[one(c, i) for i in range(64)]), timeout=120)
    t0 = time.monotonic()
    results = asyncio.run(main())
    wall = time.monotonic() - t0
    assert results == [("length", 32)] * 64
    assert aeng.torch_threads == available_cores() == torch.get_num_threads()
    peak = max(r.running for r in aeng.engine.step_log[steps0:])
    print(f"64 streaming clients done in {wall:.1f} s; largest batch {peak} sequences")
    assert peak >= 16, f"concurrent requests should share batches; the largest held {peak}"
    m = wait_idle(server.url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["vllm:time_to_first_token_seconds_count"] >= 64 and m["vllm:e2e_request_latency_seconds_count"] >= 64


VLLM_METRICS = [  # what vLLM's Grafana dashboard, its autoscaler examples and the routers that read it expect
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total"]


def test_metrics_names(server, client):
    "vLLM's names and labels, so vLLM's dashboards and autoscalers read ours unchanged; ours keep minivllm:."
    from prometheus_client.parser import text_string_to_metric_families
    client.completions.create(model="tiny", prompt="count me", max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    for name in VLLM_METRICS:
        assert name in samples and samples[name].labels.get("model_name") == "tiny", name
    success = [s.labels for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total"]
    assert {"model_name": "tiny", "finished_reason": "length"} in success, success
    assert samples["vllm:prompt_tokens_total"].value > 0 and samples["vllm:generation_tokens_total"].value >= 3
    ours = {n.split("{")[0] for n in text.splitlines() if n.startswith("minivllm:") and "_created" not in n}
    assert ours == {"minivllm:num_queued_sequences", "minivllm:num_queued_prompt_tokens",
                    "minivllm:num_requests_in_flight", "minivllm:requests_shed_total"}, ours


def test_two_servers_in_one_process(tiny):
    "Each app has its own metrics registry and engine thread."
    with BackgroundServer(tiny_app(tiny)) as a, BackgroundServer(tiny_app(tiny)) as b:
        httpx.post(a.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert metrics(a.url)["vllm:generation_tokens_total"] == 2 and metrics(b.url)["vllm:generation_tokens_total"] == 0


# --- the command line -------------------------------------------------------------------------------------------
def _serve(args: list[str], startup: float):
    "Start `python -m minivllm.server ARGS` on a free loopback port; returns (process, url, log file)."
    port = free_port()
    logf = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.server", *args, "--port", str(port)], stdout=logf,
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < startup:
        assert proc.poll() is None, Path(logf.name).read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200: return proc, url, Path(logf.name)
        except httpx.TransportError: time.sleep(0.2)
    proc.kill(); pytest.fail("server did not start:\n" + Path(logf.name).read_text())


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "minivllm.server", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ["--model", "--host", "--port", "--dtype", "--block-size", "--max-num-seqs", "--max-num-batched-tokens",
                 "--max-model-len", "--served-model-name", "--api-key", "--kv-cache-memory-bytes", "--num-gpu-blocks-override",
                 "--max-num-queued-reqs", "--max-num-queued-tokens", "--shutdown-timeout", "--limit-concurrency",
                 "--request-body-timeout", "--max-request-body-bytes"]:
        assert flag in out.stdout, flag


OPENMP_POOL = """
import os, sys, threading, time
from minivllm.engine import EngineArgs, LLMEngine
from minivllm.server import arg_parser, build_engine
threads = lambda: len(os.listdir("/proc/self/task")) - threading.active_count()  # native threads (OpenMP's)
before = threads()
if sys.argv[1] == "server":
    build_engine(arg_parser().parse_args(["--num-kv-blocks", "64"]))
else:  # what build_engine must not do: load in the main thread
    LLMEngine.from_engine_args(EngineArgs(num_kv_blocks=64))
deadline = time.monotonic() + 3  # a finished thread's pool workers exit a few milliseconds after it
while threads() != before and time.monotonic() < deadline:
    time.sleep(0.005)
print(before, threads())
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
def test_build_engine_leaves_no_openmp_pool_in_the_main_thread(tmp_path):
    "The server loads in a passing thread: the engine thread's OpenMP pool is then the process's only one."
    script = tmp_path / "pool.py"
    script.write_text(OPENMP_POOL)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    counts = {}
    for how in ("server", "main"):
        out = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr
        counts[how] = list(map(int, out.stdout.split()))
    assert counts["server"][1] == counts["server"][0]  # the loader's pool left with its thread
    assert counts["main"][1] > counts["main"][0]  # the check sees a pool: loading in main leaves its workers


def test_server_flags_write_no_engine_default():
    "The engine's flags come from EngineArgs: their defaults are the dataclass's, and every field has a flag."
    import dataclasses
    from minivllm.engine import EngineArgs
    from minivllm.server import arg_parser
    ns = arg_parser().parse_args([])
    assert EngineArgs.from_cli_args(ns) == EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        if f.metadata.get("cli", True):
            assert hasattr(ns, f.name), f.name
    src = (ROOT / "minivllm" / "server.py").read_text()
    for flag in ["--max-num-seqs", "--block-size", "--max-num-batched-tokens", "--gpu-memory-utilization"]:
        assert f'"{flag}"' not in src, flag


def test_command_line_serves_a_model_folder(tiny_folder):
    proc, url, logf = _serve(["--model", str(tiny_folder), "--kv-cache-memory-bytes", "8MiB"], startup=90)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        assert [m.id for m in c.models.list().data] == [str(tiny_folder)]
        assert c.completions.create(model=str(tiny_folder), prompt="hi", max_tokens=3).usage.completion_tokens <= 3
    finally:
        proc.terminate(); proc.wait(30)
    log = logf.read_text()
    assert f"on http://127.0.0.1:{url.rsplit(':', 1)[1]}" in log and re.search(r"KV cache: \d+ blocks x 16 tokens", log), log


# --- the bundled model ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bundled_model_streams_what_it_answers():
    model, tok = load_model(None, "float32")
    with BackgroundServer(build_app(LLMEngine(model, tok, num_kv_blocks=1024), "minivllm")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
        for content in ["What is a mutex? One sentence.", "用中文写一句关于缓存的话。"]:
            msgs = [{"role": "user", "content": content}]
            whole = c.chat.completions.create(model="minivllm", messages=msgs, max_tokens=32, temperature=0)
            t0 = time.perf_counter(); ttft = None; chunks = []
            for ch in c.chat.completions.create(model="minivllm", messages=msgs, max_tokens=32, temperature=0, stream=True):
                if ch.choices and ch.choices[0].delta.content:
                    ttft = ttft or time.perf_counter() - t0; chunks.append(ch.choices[0].delta.content)
            print(f"time to first token at light load: {ttft * 1000:.0f} ms; {whole.choices[0].message.content!r}")
            assert "".join(chunks) == whole.choices[0].message.content
            assert not any("\ufffd" in x for x in chunks)
        # a few clients at once, all in the same batches
        async def one(ac, i):
            r = await ac.chat.completions.create(model="minivllm", max_tokens=16, temperature=0,
                                                 messages=[{"role": "user", "content": f"Say the number {i}."}])
            return r.choices[0].finish_reason
        async def main():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="EMPTY", max_retries=0, timeout=300) as ac:
                return await asyncio.gather(*[one(ac, i) for i in range(8)])
        assert all(f in ("stop", "length") for f in asyncio.run(main()))
        m = wait_idle(srv.url)
        assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0


@pytest.mark.slow
def test_command_line_with_no_model_serves_the_bundled_model():
    proc, url, logf = _serve(["--num-gpu-blocks-override", "256"], startup=240)
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"model": "minivllm", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate(); proc.wait(30)
    assert "KV cache: 256 blocks x 16 tokens = 4,096 tokens" in logf.read_text()


def test_cached_prompt_tokens_are_reported_in_usage(client):
    "Prefix caching shows in usage.prompt_tokens_details.cached_tokens (OpenAI's field), streamed and not."
    system = "You are a careful assistant who answers in one short sentence. " * 3
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]
    first = client.chat.completions.create(model="tiny", messages=msgs("first?"), max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    again = client.chat.completions.create(model="tiny", messages=msgs("second?"), max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(system) // 2   # most of the shared system prompt
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    stream = client.chat.completions.create(model="tiny", messages=msgs("third?"), max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens >= len(system) // 2


def test_tiny_temperatures_are_greedy(client):
    "Below 1e-5 a temperature is greedy (vLLM's rule): 1e-45 gives temperature 0's text, not token 0 over and over."
    kw = dict(model="tiny", prompt="Greedy or not", max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    for t in [1e-45, 1e-9, 9e-6]:
        assert client.completions.create(temperature=t, **kw).choices[0].text == greedy, t


def test_tokenize_is_capped_like_prompts(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x" * 600})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/tokenize", json={"prompt": "x" * 5_000_000}, timeout=30)
    assert r.status_code == 413   # above this server's 1 MiB body cap
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x" * 500}).json()["count"] == 500


def test_a_body_labelled_otherwise_than_json_gets_415(server):
    r = httpx.post(server.url + "/v1/completions", content=b"prompt=hi",
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}')  # no label: JSON
    assert r.status_code == 200


def test_the_queue_is_given_back(server, client, slow_steps):
    "After requests of every kind (done, streamed, left, bad), the queue's gauges are back to zero."
    client.completions.create(model="tiny", prompt=["a", "b"], n=3, max_tokens=4)
    list(client.completions.create(model="tiny", prompt="s", max_tokens=4, stream=True))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 400, "ignore_eos": True},
                   timeout=0.3)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 5:
        m = metrics(server.url)
        queue = (m["minivllm:num_queued_sequences"], m["minivllm:num_queued_prompt_tokens"],
                 m["minivllm:num_requests_in_flight"])
        if queue == (0, 0, 0):
            break
        time.sleep(0.05)
    assert queue == (0, 0, 0)


def test_openapi_declares_every_request_body(server):
    "/openapi.json types each POST's body with 05a's models: /docs shows every field, client generators work."
    import jsonschema
    doc = httpx.get(server.url + "/openapi.json").json()
    assert httpx.get(server.url + "/docs").status_code == 200
    for path, model in [("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
    schemas = doc["components"]["schemas"]
    assert {"messages", "temperature", "tools", "response_format", "max_completion_tokens"} <= set(
        schemas["ChatCompletionRequest"]["properties"])
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc))
    assert refs and set(refs) <= set(schemas)  # every reference resolves
    check = lambda body: jsonschema.validate(body, {"$ref": "#/components/schemas/ChatCompletionRequest",  # noqa: E731
                                                    "components": doc["components"]})
    check({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5})
    with pytest.raises(jsonschema.ValidationError):
        check({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"})
