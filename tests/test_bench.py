"""The benchmark tools (06_benchmarks) on a tiny random model: the serving client against a real server (ours, in a
background thread and as a separate process), its vLLM-style metrics, the decode profiler and the roofline bytes, the
machine every result records, and the committed results themselves.
The figures themselves come from `#| bench` cells on the bundled model; these tests check the machinery that makes
them, so that a wrong count or definition cannot hide behind a plausible number."""
import json
import socket
import sys
from datetime import datetime
from pathlib import Path

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
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compare_servers_runs_a_real_server_process(tiny_folder):
    port = free_port()
    cmd = [sys.executable, "-m", "minivllm.server", "--model", str(tiny_folder), "--port", str(port),
           "--num-gpu-blocks-override", "512", "--uvicorn-log-level", "warning"]
    rows = bench.compare_servers({"tiny": (cmd, f"http://127.0.0.1:{port}/v1")}, concurrencies=(1, 3),
                                 num_prompts=lambda c: 2 * c, min_tokens=2, max_tokens=6)
    assert [(r["server"], r["concurrency"], r["prompts"], r["completed"]) for r in rows] == [("tiny", 1, 2, 2), ("tiny", 3, 6, 6)]
    assert all(r["total_output_tokens"] == r["requested_tokens"] for r in rows)
    with pytest.raises(ConnectionError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_server_process_that_dies_is_an_error():
    with pytest.raises(RuntimeError, match="exited with 3"):
        with bench.server_process([sys.executable, "-c", "import sys; sys.exit(3)"], "http://127.0.0.1:9/v1"):
            pass


# The machine every result records

MACHINE_KEYS = {"cpu", "cores", "flags", "torch", "torch_threads", "date", "recorded"}
RESULTS = sorted((Path(__file__).resolve().parent.parent / "nbs" / "results").glob("*.json"))


def test_machine_info_records_cpu_flags_torch_and_date():
    m = bench.machine_info()
    assert MACHINE_KEYS <= m.keys()
    assert m["cores"] >= 1 and m["cpu"] and m["torch"] == torch.__version__
    assert set(m["flags"]) <= set(bench.CPU_FLAGS)
    assert datetime.fromisoformat(m["date"]).utcoffset().total_seconds() == 0  # UTC, with its offset
    assert m["recorded"] == "by the run"


def test_machine_info_reads_the_flags_of_proc_cpuinfo(monkeypatch):
    fields = {"model name": "Test CPU 9000", "flags": "fpu sse2 avx2 fma avx512f amx_tile"}
    monkeypatch.setattr(bench, "_cpuinfo", lambda: fields)
    m = bench.machine_info()
    assert (m["cpu"], m["flags"]) == ("Test CPU 9000", ["avx2", "fma", "avx512f", "amx_tile"])
    line = bench.describe_machine(m)
    assert line.startswith("Test CPU 9000, ") and "no avx512_bf16" in line and "recorded" not in line


def test_describe_machine_marks_a_record_made_after_the_run():
    m = {"cpu": "AMD EPYC", "cpu_family": "Zen 3", "cores": 2, "flags": ["avx2", "fma"], "torch": "2.13.0+cpu",
         "torch_threads": 2, "cuda": None, "date": "2026-11-30", "recorded": "after the run, from the run's notes"}
    line = bench.describe_machine(m)
    assert line.startswith("AMD EPYC (Zen 3), 2 cores, avx2 fma, no avx512f/avx512_bf16/amx_tile")
    assert line.endswith("2026-11-30 [recorded after the run, from the run's notes]")


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_every_committed_result_records_its_machine(path):
    m = json.loads(path.read_text())["machine"]
    assert MACHINE_KEYS <= m.keys(), f"{path.name}: the machine lacks {MACHINE_KEYS - m.keys()}"
    assert m["cores"] >= 1 and m["torch"] and datetime.fromisoformat(m["date"])


def test_results_folder_is_not_empty():
    assert {p.stem for p in RESULTS} >= {"offline_float32", "offline_bfloat16", "profile_float32", "features"}


def test_command_line_writes_the_machine_and_its_arguments(server, tmp_path):
    out = tmp_path / "serve.json"
    bench.main(["serve", "--base-url", f"{server.url}/v1", "--num-prompts", "3", "--max-tokens", "20",
                "--api-key", "secret", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert (saved["completed"], saved["failed"]) == (3, 0)
    assert saved["params"]["num_prompts"] == 3 and "api_key" not in saved["params"]  # no secret in a result
    assert saved["machine"]["cores"] >= 1 and saved["machine"]["recorded"] == "by the run"


@pytest.mark.parametrize("cmd, args", [
    ("offline", ["--concurrency", "2", "--num-requests", "2", "--min-tokens", "3", "--max-tokens", "6"]),
    ("profile", ["--batch-size", "2", "--steps", "2"]),
    ("features", ["--system-tokens", "40", "--users", "2", "--prompt-tokens", "60", "--streams", "2",
                  "--budget", "16"]),
])
def test_model_subcommands_take_the_engines_flags(tiny_folder, tmp_path, monkeypatch, cmd, args):
    seen = []

    class Recording(LLMEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append((self.args.num_kv_blocks, self.args.block_size))

    monkeypatch.setattr(bench, "LLMEngine", Recording)
    out = tmp_path / f"{cmd}.json"
    bench.main([cmd, "--model", str(tiny_folder), "--num-kv-blocks", "300", "--block-size", "4", *args,
                "--json", str(out)])
    assert seen and set(seen) == {(300, 4)}  # every engine the benchmark built has the flags' values
    saved = json.loads(out.read_text())
    assert (saved["params"]["num_kv_blocks"], saved["params"]["block_size"]) == (300, 4)
    assert saved["machine"]["recorded"] == "by the run"
    if cmd == "offline":
        assert saved["rows"][0]["identical"] == 2 and saved["rows"][0]["tokens"] >= 2 * 3
    elif cmd == "profile":
        assert saved["profiles"][0]["batch_size"] == 2 and saved["decode_bytes"] > 0
    else:
        assert saved["shared_prefix"]["identical"] == 2 and saved["long_prompt"]["on"]["long_prompt_s"] > 0
