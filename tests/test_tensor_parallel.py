"""Tensor parallelism (10) on the CPU over gloo: greedy output equal to N=1 for several head layouts, a preemption
storm, a killed worker (a clear error, not a hang), rank 0 killed (its worker exits), two processes joined over TCP."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from minivllm.engine import LLM
from minivllm.parallel import ShardPlan, WorkerDied, save_random_model
from minivllm.qwen2 import ModelLoadError, Qwen2Config
from minivllm.scheduler import SamplingParams
from minivllm.utils import free_port

ROOT = Path(__file__).resolve().parent.parent


def _cfg(hq: int, hkv: int, tie: bool, head_dim: int = 8, hidden: int = 48) -> Qwen2Config:
    return Qwen2Config(vocab_size=259, hidden_size=hidden, intermediate_size=80, num_hidden_layers=2,
                       num_attention_heads=hq, num_key_value_heads=hkv, head_dim=head_dim,
                       max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=tie)


# name: (config, world size, block size, new tokens per prompt)
CONFIGS = {
    "gqa14/2-n2-untied-bs16": (_cfg(14, 2, False), 2, 16, 32),
    "mha4/4-n2-tied-bs1": (_cfg(4, 4, True), 2, 1, 32),
    "mha4/4-n4-untied-bs16": (_cfg(4, 4, False), 4, 16, 12),
    "mqa5/1-n2-tied-bs16": (_cfg(5, 1, True), 2, 16, 32),
}

_gen = torch.Generator().manual_seed(7)
_shared = torch.randint(0, 256, (20,), generator=_gen).tolist()  # a prefix three prompts share (prefix caching)
PROMPTS = [torch.randint(0, 256, (n,), generator=_gen).tolist() for n in (3, 11, 40, 57, 26)]
PROMPTS += [_shared + torch.randint(0, 256, (n,), generator=_gen).tolist() for n in (1, 9, 17)]
ENGINE = dict(max_num_batched_tokens=48, enable_prefix_caching=True, dtype="float32")  # 57 tokens: chunked prefill
# float32 is pinned: "auto" is bfloat16 on some CPUs, where N ranks summing in another order may flip a token


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _run(folder: Path, world: int, new_tokens: int, **kw) -> tuple[list[list[int]], LLM]:
    "Token ids of every prompt, and the LLM (still running: the caller shuts it down)."
    llm = LLM(str(folder), tensor_parallel_size=world, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(new_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _leftover_children() -> list[psutil.Process]:
    "This process's live children, less multiprocessing's resource tracker (it lives as long as this process)."
    kids = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    return [p for p in kids if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_one_rank(name, tmp_path):
    cfg, world, bs, new = CONFIGS[name]
    folder = save_random_model(tmp_path / "m", cfg, seed=world)
    kw = dict(ENGINE, block_size=bs, num_kv_blocks=2048 // bs)
    ref, _ = _run(folder, 1, new, **kw)
    got, llm = _run(folder, world, new, **kw)
    ranks = llm.llm_engine.runner.describe()
    llm.shutdown()
    same = sum(a == b for a, b in zip(ref, got))
    print(f"{name}: {same}/{len(ref)} prompts identical, {new} tokens each")
    assert same == len(ref)
    plans = [ShardPlan.of(Qwen2Config.from_json(folder / "config.json"), r, world) for r in range(world)]
    for desc, plan in zip(ranks, plans):  # each rank holds the KV pools of its own heads only
        assert desc["kv_pool"] == (2, 2048 // bs, bs, len(plan.kv_heads), 8)
    if name.startswith("mqa"):
        assert [d["kv_heads"] for d in ranks] == ["0..0", "0..0"]  # the one KV head, replicated
    assert not _leftover_children()


def test_preemption_storm_changes_nothing(tmp_path):
    folder = save_random_model(tmp_path / "m", _cfg(4, 2, False), seed=3)
    kw = dict(ENGINE, block_size=4, num_kv_blocks=30)  # 8 sequences ending at 51 to 105 tokens: 13 to 27 blocks
    ref, llm1 = _run(folder, 1, 48, **kw)
    got, llm = _run(folder, 2, 48, **kw)
    eng = llm.llm_engine
    ranks = eng.runner.describe()
    llm.shutdown()
    print(f"storm: {eng.stats().num_preemptions} preemptions at N=2, {llm1.engine.stats().num_preemptions} at N=1")
    assert eng.stats().num_preemptions > 0
    assert got == ref
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # every block back
    assert [d["kv_pool"][1] for d in ranks] == [30, 30]  # every rank's pools: rank 0's block ids


@pytest.fixture(scope="module")
def small_folder(tmp_path_factory) -> Path:
    return save_random_model(tmp_path_factory.mktemp("tp") / "m", _cfg(4, 2, False), seed=5)


def test_killed_worker_is_a_clear_error(small_folder):
    llm = LLM(str(small_folder), tensor_parallel_size=2, num_kv_blocks=256, dtype="float32")
    worker = llm.llm_engine.runner.group.workers[0]
    from minivllm.server import AsyncEngine
    assert AsyncEngine(llm.llm_engine).num_threads == max(1, os.cpu_count() // 2)  # a server's rank 0: its share
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], _greedy(4), use_tqdm=False)
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL)

    threading.Timer(0.5, kill).start()
    long = [{"prompt_token_ids": p} for p in PROMPTS]
    with pytest.raises(WorkerDied, match=r"worker rank 1 \(pid \d+\) was killed by signal 9"):
        llm.generate(long, _greedy(400), use_tqdm=False)  # runs for seconds: killed mid-generation
    seconds = time.monotonic() - killed_at[0]
    print(f"worker killed -> WorkerDied in {seconds:.2f} s")
    assert seconds < 30  # no wait for the 5-minute collective timeout
    with pytest.raises(WorkerDied, match="closed"):
        llm.generate(long, _greedy(4), use_tqdm=False)
    llm.shutdown()
    assert not _leftover_children()


RANK0 = """
import sys, time
from minivllm.engine import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64, dtype="float32")
    print(llm.llm_engine.runner.group.workers[0].pid, flush=True)
    time.sleep(120)
"""


def test_worker_exits_when_rank0_dies(small_folder, tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    rank0 = subprocess.Popen([sys.executable, str(script), str(small_folder)], stdout=subprocess.PIPE, text=True)
    worker = psutil.Process(int(rank0.stdout.readline()))
    rank0.kill()
    rank0.wait()
    _, alive = psutil.wait_procs([worker], timeout=15)
    if alive:
        worker.kill()
    assert not alive, "the worker outlived rank 0"


def _rank1_by_hand(folder: Path, dtype: str, monkeypatch) -> subprocess.Popen:
    "Start rank 1 on its own with its own flags, as on another machine, and set rank 0's env:// variables here."
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "minivllm.parallel", "--model", str(folder), "--tensor-parallel-size", "2",
           "--dtype", dtype]
    worker = subprocess.Popen(cmd, env={**os.environ, **env, "RANK": "1"}, cwd=ROOT)
    for k, v in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    return worker


def test_two_processes_over_tcp(small_folder, monkeypatch):
    "Rank 1 started on its own, as on another machine; rank 0 (this process) meets it through env://."
    ref, _ = _run(small_folder, 1, 24, num_kv_blocks=256, dtype="float32")
    worker = _rank1_by_hand(small_folder, "float32", monkeypatch)
    try:
        got, llm = _run(small_folder, 2, 24, num_kv_blocks=256, dtype="float32")
        assert llm.llm_engine.runner.group.workers == []  # nothing spawned: the rank came by itself
        llm.shutdown()
        assert worker.wait(timeout=30) == 0  # told to stop, it left cleanly
    finally:
        if worker.poll() is None:
            worker.kill()
    print(f"over TCP: {sum(a == b for a, b in zip(ref, got))}/{len(ref)} prompts identical")
    assert got == ref


def test_ranks_that_loaded_another_dtype_are_refused(small_folder, monkeypatch):
    "A rank started by hand with its own --dtype: rank 0 refuses the group before the first step."
    worker = _rank1_by_hand(small_folder, "bfloat16", monkeypatch)
    try:
        with pytest.raises(ModelLoadError, match="loaded the model differently.*float32.*bfloat16"):
            LLM(str(small_folder), tensor_parallel_size=2, num_kv_blocks=64, dtype="float32")
        assert worker.wait(timeout=30) is not None  # the group was closed: the worker did not stay behind
    finally:
        if worker.poll() is None:
            worker.kill()


def test_server_with_a_dead_worker_says_503_and_exits(small_folder, tmp_path):
    "The server at N=2: a killed worker ends the engine loop with WorkerDied; /health turns 503; nothing is left."
    import httpx

    port = free_port()
    log = tmp_path / "server.log"
    args = ["--model", str(small_folder), "--port", str(port), "--host", "127.0.0.1", "--block-size", "4",
            "--num-gpu-blocks-override", "256", "--tensor-parallel-size", "2", "--uvicorn-log-level", "warning"]
    code = "import sys\nfrom minivllm import server\nserver.main(sys.argv[1:])"
    srv = subprocess.Popen([sys.executable, "-c", code, *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert srv.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        family = [srv.pid] + [p.pid for p in psutil.Process(srv.pid).children(recursive=True)]
        workers = [p for p in psutil.Process(srv.pid).children() if "spawn" in " ".join(p.cmdline())]
        assert len(workers) == 1, [p.cmdline() for p in psutil.Process(srv.pid).children()]
        body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True}
        threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=60)).start()
        time.sleep(1.0)
        workers[0].kill()
        killed = time.monotonic()
        statuses = set()
        while srv.poll() is None and time.monotonic() < deadline:
            try:
                statuses.add(httpx.get(url + "/health", timeout=1).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        text = log.read_text()
        print(f"server: /health answered {sorted(statuses)} after the kill; exit status {srv.returncode} "
              f"{time.monotonic() - killed:.2f} s after it")
        assert srv.returncode == 1, text[-3000:]
        assert "WorkerDied" in text and "rank 1" in text, text[-3000:]
        assert statuses <= {200, 503}  # 503 once the engine loop has died (it exits soon after: a short window)
        _, alive = psutil.wait_procs([psutil.Process(p) for p in family if psutil.pid_exists(p)], timeout=15)
        assert not alive, f"left behind: {alive}"
    finally:
        if srv.poll() is None:
            srv.kill()


def test_gguf_split_equals_one_rank(tmp_path):
    "A Q8_0 GGUF: each rank dequantizes tensor by tensor and keeps its part; greedy output equals N=1."
    from test_qwen2 import tiny_hf, write_gguf  # 01's tests write tiny llama.cpp-style GGUF files

    hf = tiny_hf(3)
    with torch.no_grad():  # a sharper next-token distribution than the default init gives
        hf.lm_head.weight.mul_(40)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, hf, "Q8_0")
    ref, _ = _run(path, 1, 16, num_kv_blocks=256, dtype="float32")
    got, llm = _run(path, 2, 16, num_kv_blocks=256, dtype="float32")
    llm.shutdown()
    print(f"GGUF Q8_0 at N=2: {sum(a == b for a, b in zip(ref, got))}/{len(ref)} prompts identical")
    assert got == ref


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_world_size_one_through_the_distributed_path(device, small_folder):
    "One rank with real process groups (gloo on the CPU, NCCL on a GPU): every collective runs; output equals N=1."
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from minivllm.engine import EngineArgs, LLMEngine
    from minivllm.parallel import launch_tensor_parallel

    kw = dict(model=str(small_folder), device=device, dtype="float32", num_kv_blocks=256)
    ref, _ = _run(small_folder, 1, 16, device=device, dtype="float32", num_kv_blocks=256)
    eng = launch_tensor_parallel(LLMEngine, EngineArgs(tensor_parallel_size=1, **kw))
    with LLM.from_engine(eng) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(16), use_tqdm=False)
        backend = torch.distributed.get_backend()
        calls = eng.runner.group.comm_calls
    print(f"world size 1 over {backend}: {calls} collectives, {len(outs)} prompts")
    assert backend == ("nccl" if device == "cuda" else "gloo")
    assert calls > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
