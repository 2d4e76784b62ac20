"""Part I runs with every Part II module absent: the engine imports, matches transformers token for token, and
preempts invisibly, on plain PyTorch. The Part II modules are made unimportable in a fresh interpreter
(`sys.modules[name] = None`: any import of them fails as a missing module does), so nothing of theirs can run."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen2ForCausalLM as HFModel

PART_TWO = ["cpu_kernels", "triton_attention", "fused_kernels", "cuda_graphs", "overlap", "parallel", "structured",
            "tool_calls", "live", "speculative", "bench"]
PROMPTS = ["the quick brown fox", "1 2 3 4 5", "def fib(n):", "Hello, my name is", "abcabcabc", "zz"]

SCRIPT = r"""
import json, sys
PART_TWO = json.loads(sys.argv[2])
for name in PART_TWO:
    sys.modules["minivllm." + name] = None  # absent: importing it raises ModuleNotFoundError

import minivllm
from minivllm.engine import LLM, LLMEngine, SamplingParams
from minivllm.paged_cache import KVCache
from minivllm.runner import load_prepared, make_decoder
from minivllm.weights import Tokenizer, load_safetensors_model

folder, prompts = sys.argv[1], json.loads(sys.argv[3])
model, tok = load_safetensors_model(folder), Tokenizer.from_folder(folder)
greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)


def run(params, **kw):
    with LLM.from_engine(LLMEngine(model, tok, block_size=4, **kw)) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats().num_preemptions, llm.engine


roomy, _, eng = run(greedy, num_kv_blocks=256)
tight, preempted, _ = run(greedy, num_kv_blocks=9, max_num_seqs=6)
seeded_roomy, _, _ = run(seeded, num_kv_blocks=256)
seeded_tight, seeded_preempted, _ = run(seeded, num_kv_blocks=9, max_num_seqs=6)
errors = {}
for what, call in {
    "c": lambda: make_decoder("c", eng.cache),
    "int8": lambda: load_prepared(folder, quantization="int8"),
    "speculative": lambda: LLMEngine(model, tok, num_kv_blocks=16, speculative_config={"method": "ngram"}),
    "async": lambda: LLMEngine(model, tok, num_kv_blocks=16, async_scheduling=True),
}.items():
    try:
        call()
    except Exception as e:
        errors[what] = f"{type(e).__name__}: {e}"
print(json.dumps({
    "plugins": minivllm.load_plugins(),
    "loaded": sorted(n for n in PART_TWO if sys.modules.get("minivllm." + n) is not None),
    "decoder": type(eng.runner.decoder).__name__,
    "processors": len(eng.logits_processors), "hooks": len(eng.step_hooks),
    "greedy": roomy, "tight": tight, "preempted": preempted,
    "seeded": seeded_roomy, "seeded_tight": seeded_tight, "seeded_preempted": seeded_preempted,
    "errors": errors,
}))
"""


@pytest.fixture(scope="module")
def alone(tiny_folder):
    "What the engine did in an interpreter where Part II is absent."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_folder), json.dumps(PART_TWO), json.dumps(PROMPTS)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_no_part_two_module_runs(alone):
    assert alone["loaded"] == []
    import minivllm
    assert alone["plugins"] == {name: False for name in minivllm.PLUGINS}
    assert set(minivllm.PLUGINS) <= {f"minivllm.{n}" for n in PART_TWO}
    assert alone["decoder"] == "DecodeAttention" and alone["processors"] == alone["hooks"] == 0  # nothing added


def test_greedy_parity_with_transformers_alone(alone, tiny_folder):
    from minivllm.weights import Tokenizer
    tok = Tokenizer.from_folder(tiny_folder)
    hf = HFModel.from_pretrained(tiny_folder, torch_dtype=torch.float32).eval()
    same = 0
    for p, got in zip(PROMPTS, alone["greedy"]):
        ids = torch.tensor([tok.encode(p)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        same += ref == got
    print(f"Part I alone: greedy identical to transformers {same}/{len(PROMPTS)}")
    assert same == len(PROMPTS)


def test_preemption_is_invisible_alone(alone):
    assert alone["preempted"] > 0 and alone["seeded_preempted"] > 0  # the pool was too small for all at once
    assert alone["tight"] == alone["greedy"]
    assert alone["seeded_tight"] == alone["seeded"]


def test_what_needs_part_two_says_so(alone):
    errors = alone["errors"]
    assert "unknown: use one of auto, torch" in errors["c"]
    assert "no model preparer offers one here" in errors["int8"]
    assert errors["speculative"] == "ValueError: speculative_config needs minivllm.speculative, which is not installed here"
    assert errors["async"] == "ValueError: async_scheduling needs minivllm.overlap, which is not installed here"
