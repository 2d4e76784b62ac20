"Shared test helpers: the `slow` marker and a tiny random model folder."
import json
import os
from pathlib import Path

import pytest
import torch


# Triton decides at import whether it interprets kernels; on a machine without CUDA it must (set before any test
# module, or a library such as xgrammar, imports triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # CI runs every test; `slow` only labels those that need the bundled model (select with -m slow / -m "not slow").
    config.addinivalue_line("markers", "slow: needs the real bundled model (minutes on a 2-core CPU)")


def tiny_model_folder(d: Path, seed: int = 0, sharp: bool = False) -> Path:
    """A tiny random Qwen2 (2 layers, hidden 64, context 512) saved by transformers, with a byte-level tokenizer (one
    token per byte: CJK and emoji always span tokens) and a chat template. `sharp`: non-zero biases and a sharper
    next-token distribution than the default init gives."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    tok = HFTok(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, rope_theta=10000.0))
    if sharp:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"): p.normal_(0, 0.1)
            hf.lm_head.weight.normal_(0, 0.2)
    hf.save_pretrained(d)
    tok.save(str(d / "tokenizer.json"))
    tmpl = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": tmpl, "eos_token": "<|im_end|>"}))
    return d


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    "The tiny model folder, once per test module (a module may define its own `tiny_folder` instead)."
    return tiny_model_folder(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    "The tiny model and its tokenizer, loaded once per test module."
    from minivllm.weights import load_safetensors_model, Tokenizer
    return load_safetensors_model(tiny_folder), Tokenizer.from_folder(tiny_folder)


@pytest.fixture(scope="module")
def server(tiny):
    "A real uvicorn server on loopback serving the tiny model as 'tiny' (a module may define its own `server`)."
    from minivllm.engine import LLMEngine
    from minivllm.server import BackgroundServer, build_app

    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=1024, max_num_seqs=16)
    with BackgroundServer(build_app(engine, "tiny")) as srv:
        yield srv
