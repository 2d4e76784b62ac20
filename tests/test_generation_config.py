"""What a vLLM user meets first (issue 46): the model's own sampling defaults from its generation_config.json, and
vLLM's command line for a chat model, run unchanged.

A tiny model folder with a generation_config.json of its own: greedy by default (temperature 0), a cap of 5 new
tokens. Requests that leave the fields out get them; a request's own values win; `--generation-config vllm` turns
the file off; `--override-generation-config` changes single values; the server's start log names the defaults; a
bad flag is refused before the model loads, saying why.
"""
import json, shutil, subprocess, sys, os

import httpx
import openai
import pytest

from minivllm.engine import LLM, LLMEngine
from minivllm.scheduler import SamplingParams
from minivllm.server import BackgroundServer, build_app
from minivllm.weights import Tokenizer, load_safetensors_model

from test_server import ROOT, _serve


@pytest.fixture(scope="module")
def greedy_folder(tiny_folder, tmp_path_factory):
    "The tiny model, its generation config: greedy, 5 new tokens at most, a repetition penalty."
    d = tmp_path_factory.mktemp("tiny-generation-config")
    for p in tiny_folder.iterdir():
        shutil.copy(p, d / p.name)
    (d / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "temperature": 0.0, "repetition_penalty": 1.05, "max_new_tokens": 5, "eos_token_id": 257}))
    return d


def engine(folder, **kw) -> LLMEngine:
    return LLMEngine(load_safetensors_model(folder), Tokenizer.from_folder(folder), num_kv_blocks=256, **kw)


def test_offline_defaults_come_from_the_model_folder(greedy_folder):
    llm = LLM.from_engine(engine(greedy_folder))
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.repetition_penalty, p.max_tokens, p.top_p) == (0.0, 1.05, 5, 1.0)
    out = llm.generate(["Hello there"], use_tqdm=False)[0].outputs[0]  # no params: the model's defaults
    same = llm.generate(["Hello there"], SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=5),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == same.token_ids and len(out.token_ids) <= 5
    off = LLM.from_engine(engine(greedy_folder, generation_config="vllm")).get_default_sampling_params()
    assert (off.temperature, off.max_tokens, off.repetition_penalty) == (1.0, 16, 1.0)  # vLLM's own
    assert LLM.from_engine(engine(greedy_folder, override_generation_config={"temperature": 0.5})) \
        .get_default_sampling_params().temperature == 0.5


def test_a_bad_default_is_said_at_start(greedy_folder):
    with pytest.raises(ValueError, match="temprature"):
        engine(greedy_folder, override_generation_config={"temprature": 0.5})
    with pytest.raises(ValueError, match="temperature"):
        engine(greedy_folder, override_generation_config={"temperature": -1})


def test_requests_get_the_defaults_they_leave_out(greedy_folder):
    with BackgroundServer(build_app(engine(greedy_folder), "tiny")) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": "Tell me a story"}]
        plain = [c.chat.completions.create(model="tiny", messages=msgs).choices[0].message.content for _ in range(3)]
        assert len(set(plain)) == 1  # temperature 0 from the model: the same answer every time
        greedy = c.chat.completions.create(model="tiny", messages=msgs, temperature=0).choices[0].message.content
        assert plain[0] == greedy
        capped = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=50, temperature=0)
        assert capped.usage.completion_tokens <= 5  # max_new_tokens caps every request
        hot = {c.chat.completions.create(model="tiny", messages=msgs, temperature=1.5, seed=s).choices[0].message.content
               for s in range(4)}
        assert len(hot) > 1  # the request's own temperature wins


def test_vllm_command_line_runs_unchanged(greedy_folder, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    args = ["--model", str(greedy_folder), "--kv-cache-memory-bytes", "8MiB", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--chat-template", str(template), "--generation-config", "auto",
            "--override-generation-config", '{"max_new_tokens": 3}']
    proc, url, logf = _serve(args, startup=90)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model=str(greedy_folder), messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens <= 3
        tokens = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert tokens["count"] == len("<user>hi<assistant>")  # the byte-level tiny model: one token a byte
    finally:
        proc.terminate(); proc.wait(30)
    log = logf.read_text()
    assert "default sampling parameters from the generation config (auto)" in log and "'max_tokens': 3" in log, log
    assert "chat template: from --chat-template" in log


@pytest.mark.parametrize("flags, says", [
    (["--tool-call-parser", "llama3_json"], "'llama3_json' is not available: this server has hermes"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--chat-template", "missing.jinja"], "no such file"),
    (["--override-generation-config", '{"temprature": 1}'], "temprature is not one of"),
    (["--generation-config", "/no/such/folder"], "no generation_config.json there"),
    (["--reasoning-parser-of-tomorrow", "x"], "unrecognized arguments: --reasoning-parser-of-tomorrow"),
])
def test_a_flag_we_cannot_honour_fails_at_start_naming_it(flags, says):
    out = subprocess.run([sys.executable, "-m", "minivllm.server", "--model", "/no/model/needed", *flags],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 2 and says in out.stderr, out.stderr
