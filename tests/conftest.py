"Shared test helpers: the `slow` marker and a tiny random model folder."
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
    """A tiny random Qwen2 (2 layers, hidden 64, context 512) with a byte-level tokenizer and a chat template:
    `minivllm.testing.tiny_chat_folder` (`sharp`: non-zero biases, a sharper next-token distribution)."""
    from minivllm.testing import tiny_chat_folder
    return tiny_chat_folder(d, seed, sharp)


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
