"""The benchmark tools (06_benchmarks) on a tiny random model: the serving client against a real server (ours, in a
background thread and as a separate process), its vLLM-style metrics, the decode profiler and the roofline bytes.
The figures themselves come from `#| bench` cells on the bundled model; these tests check the machinery that makes
them, so that a wrong count or definition cannot hide behind a plausible number."""
import socket
import sys

import numpy as np
import pytest
import torch

import minivllm.bench as bench
from minivllm.engine import LLMEngine
from minivllm.server import BackgroundServer, build_app


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, block_size=4, num_kv_blocks=1024, max_num_seqs=16)
    with BackgroundServer(build_app(engine, "tiny")) as srv:
        yield srv


@pytest.mark.parametrize("p", [0, 1, 37.5, 50, 99, 100])
def test_percentile_is_numpys_linear_interpolation(p):
    xs = [0.3, 0.1, 5.0, 2.2, 0.7, 0.7, 9.1]
    assert bench._pct(xs, p) == pytest.approx(np.percentile(xs, p))


def test_serve_benchmark_counts_and_definitions(server):
    prompts = [f"Count to {i}:" for i in range(6)]
    lens = [3, 8, 5, 1, 7, 4]
    res = bench.serve_benchmark(f"{server.url}/v1", "tiny", prompts, lens, max_concurrency=2, progress=False)
    assert (res["completed"], res["failed"], res["total_output_tokens"]) == (6, 0, sum(lens))
    assert res["output_throughput"] == pytest.approx(sum(lens) / res["duration_s"])
    assert res["request_throughput"] == pytest.approx(6 / res["duration_s"])
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"]
    assert res["p50_ttft_ms"] <= res["p99_ttft_ms"] and res["p50_e2el_ms"] <= res["p99_e2el_ms"]
    assert res["mean_tpot_ms"] > 0 and res["mean_itl_ms"] > 0


def test_serve_benchmark_with_poisson_arrivals(server):
    res = bench.serve_benchmark(f"{server.url}/v1", "tiny", ["a", "b", "c", "d"], [2, 2, 2, 2], request_rate=50.0,
                                seed=3, progress=False)
    assert (res["completed"], res["total_output_tokens"]) == (4, 8)


def test_serve_benchmark_reports_failures(server):
    res = bench.serve_benchmark(f"{server.url}/v1", "no-such-model", ["a", "b"], [2, 2], progress=False)
    assert (res["completed"], res["failed"]) == (0, 2)
    assert all("HTTP 404" in e for e in res["errors"])


def test_decode_profile_sums_to_the_step_and_unwraps(tiny):
    model, tok = tiny
    before, linear = dict(vars(LLMEngine)), dict(vars(torch.nn.Linear))
    pr = bench.decode_profile(model, tok, 3, steps=3, num_kv_blocks=256, block_size=4)
    assert dict(vars(LLMEngine)) == before and dict(vars(torch.nn.Linear)) == linear
    assert set(pr["ms"]) == set(bench.PROFILE_SHARES) and pr["batch_size"] == 3
    assert pr["ms"]["matmuls (layers)"] > 0 and pr["ms"]["attention"] > 0 and pr["ms"]["sampling"] > 0
    assert 0.7 * pr["ms_per_step"] < sum(pr["ms"].values()) <= 1.01 * pr["ms_per_step"]
    assert pr["tok_per_s"] == pytest.approx(3 / (pr["ms_per_step"] / 1e3))


def test_decode_bytes_per_step(tiny):
    model, _ = tiny
    c = model.config
    per_layer = (c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim   # q, k, v
                 + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim                # their biases
                 + c.num_attention_heads * c.head_dim * c.hidden_size                              # o
                 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)                    # mlp, 2 norms
    head = c.vocab_size * c.hidden_size
    expected = 4 * (c.num_hidden_layers * per_layer + c.hidden_size + head + c.hidden_size)       # + norm, 1 embedding row
    assert bench.decode_bytes_per_step(model) == expected


def test_memory_bandwidth_is_plausible():
    bw = bench.memory_bandwidth(gib=0.125, repeats=2)
    assert 0.1 < bw < 10_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def test_compare_servers_runs_a_real_server_process(tiny_folder):
    port = free_port()
    cmd = [sys.executable, "-m", "minivllm.server", "--model", str(tiny_folder), "--port", str(port),
           "--num-gpu-blocks-override", "512", "--uvicorn-log-level", "warning"]
    rows = bench.compare_servers({"tiny": (cmd, f"http://127.0.0.1:{port}/v1")}, concurrencies=(1, 3),
                                 num_prompts=lambda c: 2 * c, min_tokens=2, max_tokens=6)
    assert [(r["server"], r["concurrency"], r["prompts"], r["completed"]) for r in rows] == [("tiny", 1, 2, 2), ("tiny", 3, 6, 6)]
    assert all(r["total_output_tokens"] == r["requested_tokens"] for r in rows)
    with pytest.raises(ConnectionError): socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_server_process_that_dies_is_an_error():
    with pytest.raises(RuntimeError, match="exited with 3"):
        with bench.server_process([sys.executable, "-c", "import sys; sys.exit(3)"], "http://127.0.0.1:9/v1"):
            pass
