"""The benchmark tools (06_benchmarks) on a tiny random model: the serving client against a real server (ours, in a
background thread and as a separate process), its vLLM-style metrics, the decode profiler and the roofline bytes, the
machine every result records, and the committed results themselves.
The figures themselves come from `#| bench` cells on the bundled model; these tests check the machinery that makes
them, so that a wrong count or definition cannot hide behind a plausible number."""
import json
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

import minivllm.bench as bench
from minivllm.engine import LLMEngine
from minivllm.utils import free_port


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
    monkeypatch.setattr(bench, "cpuinfo", lambda: fields)
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
    ("offline", ["--concurrency", "2", "--num-requests", "2", "--min-tokens", "3", "--max-tokens", "6",
                 "--dtype", "float32"]),  # identical to transformers: float32 ("auto" may be bfloat16)
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


# Every mode against transformers and llama-server in one run (the `cpu` subcommand)

def test_parse_mode_names_weights_and_activations():
    assert bench.parse_mode("float32") == bench.Mode("float32", "float32", None)
    assert bench.parse_mode("int8") == bench.Mode("int8", "auto", "int8")  # activations: bfloat16 where the CPU has it
    assert bench.parse_mode("int4/float32") == bench.Mode("int4/float32", "float32", "int4")
    with pytest.raises(ValueError, match="only int8 or int4"):
        bench.parse_mode("bfloat16/float32")


def test_prefix_share_counts_tokens_before_the_first_difference():
    assert bench.prefix_share([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == pytest.approx(4 / 6)
    assert bench.prefix_share([[7, 8]], [[9, 8]]) == 0.0


def test_llama_server_cmd_gives_each_slot_its_context_and_two_threads():
    cmd = bench.llama_server_cmd("llama-server", Path("m.gguf"), 8103, slots=16, ctx_per_slot=512, threads=2)
    flag = {k: v for k, v in zip(cmd, cmd[1:])}
    assert (flag["-np"], flag["-c"], flag["-t"], flag["-tb"], flag["--port"]) == ("16", "8192", "2", "2", "8103")
    assert "-cb" in cmd and flag["-m"] == "m.gguf"


def test_ours_server_cmd_passes_the_mode_and_the_engine_flags():
    flags = bench.engine_flags(bench.EngineArgs(num_kv_blocks=300, enable_chunked_prefill=False, dtype="bfloat16"))
    assert flags == ["--num-kv-blocks", "300", "--no-enable-chunked-prefill"]  # dtype is the mode's, not a flag
    cmd = bench.ours_server_cmd(bench.parse_mode("int4/bfloat16"), 8101, flags)
    assert cmd[1:3] == ["-m", "minivllm.server"] and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--quantization") + 1] == "int4" and cmd[-3:] == flags


def fake_cpu_result():
    "A cpu result with two modes, one that failed to load, and llama.cpp at two slot settings for c=16."
    def srv(engine, c, tput, **kw):
        return {"engine": engine, "concurrency": c, "output_throughput": tput, **kw}
    off = [{"mode": "float32", "concurrency": c, "ours_tok_s": 2.0 * c, "hf_tok_s": c, "speedup": 2.0,
            "identical": 3, "requests": 4, "float32_prefix_share": None} for c in (1, 16)]
    serving = [srv("llama.cpp", 1, 30.0, slots=1), srv("llama.cpp", 16, 60.0, slots=1),
               srv("llama.cpp", 16, 70.0, slots=16), srv("mini-vLLM", 1, 15.0, mode="float32"),
               srv("mini-vLLM", 16, 140.0, mode="float32")]
    modes = [{"mode": "float32"}, {"mode": "int4", "error": "ValueError: no"}]
    paired = [srv("mini-vLLM", 1, 24.0, mode="float32", server="ours f32", paired_with="llama 1"),
              srv("llama.cpp", 1, 20.0, mode=None, server="llama 1", paired_with="ours f32")]
    return {"modes": modes, "offline": off, "serving": serving, "paired": paired}


def test_cpu_summary_takes_llamas_best_slot_setting_per_concurrency():
    rows = {(r["mode"], r["concurrency"]): r for r in bench.cpu_summary(fake_cpu_result())}
    assert rows["float32", 16]["llama_slots"] == 16 and rows["float32", 16]["vs_llama"] == pytest.approx(2.0)
    assert rows["float32", 1]["vs_llama"] == pytest.approx(0.5) and rows["float32", 1]["vs_hf"] == 2.0
    assert rows["int4", 16]["served_tok_s"] is None and rows["int4", 16]["vs_llama"] is None  # shown, not run
    # one user side by side: the paired rows' own ratio, at c=1 only; none for a mode that was not paired
    assert rows["float32", 1]["vs_llama_paired"] == pytest.approx(1.2) and rows["float32", 16]["vs_llama_paired"] is None
    assert rows["int4", 1]["vs_llama_paired"] is None
    assert bench.cpu_summary({**fake_cpu_result(), "paired": []})[0]["vs_llama_paired"] is None


def test_print_cpu_summary_shows_every_mode(capsys):
    bench.print_cpu_summary(fake_cpu_result())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 4 and lines[1].startswith("float32") and lines[-1].startswith("int4")
    assert "2.00x" in lines[2] and "0.50x" in lines[1] and lines[1].endswith("1.20x") and "paired" in lines[0]


def test_serve_runs_records_a_server_that_cannot_start_and_goes_on(tmp_path):
    bad = bench.ServerRun("bad", [sys.executable, "-c", "print('INFO minivllm: no kernel'); raise SystemExit(3)"],
                          "http://127.0.0.1:9/v1", [1], {"engine": "mini-vLLM", "mode": "int4"})
    recs, rows = bench.serve_runs([bad, bad], {1: 2}, log_dir=tmp_path, say=lambda m: None)
    assert rows == [] and len(recs) == 2
    assert "exited with 3" in recs[0]["error"] and recs[0]["log"] == ["INFO minivllm: no kernel"]


def test_cpu_subcommand_runs_every_mode_offline_and_served(tiny_folder, tmp_path):
    out = tmp_path / "cpu.json"
    bench.main(["cpu", "--model", str(tiny_folder), "--modes", "float32", "bfloat16", "float64",
                "--concurrency", "1", "3", "--offline-requests", "2", "3", "--offline-tokens", "2", "5",
                "--serve-prompts", "2", "3", "--serve-tokens", "2", "5", "--num-kv-blocks", "300",
                "--llama-server", "", "--log-dir", str(tmp_path / "logs"), "--preliminary", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["preliminary"] and res["machine"]["cores"] >= 1 and res["kernels"]["torch_cpu_capability"]
    assert [m["mode"] for m in res["modes"]] == ["float32", "bfloat16", "float64"]
    assert "error" in res["modes"][2]  # float64 is refused: recorded, and the run went on
    assert [(r["mode"], r["concurrency"]) for r in res["offline"]] == [
        ("float32", 1), ("float32", 3), ("bfloat16", 1), ("bfloat16", 3)]
    assert all(r["identical"] == r["requests"] for r in res["offline"] if r["mode"] == "float32")
    assert all("same_as_float32" in r for r in res["offline"] if r["mode"] == "bfloat16")
    served = [(r["mode"], r["concurrency"], r["completed"]) for r in res["serving"]]
    assert served == [("float32", 1, 2), ("float32", 3, 3), ("bfloat16", 1, 2), ("bfloat16", 3, 3)]
    assert all(r["total_output_tokens"] == r["requested_tokens"] for r in res["serving"])
    assert "error" in res["servers"][2] and not any(s["engine"] == "llama.cpp" for s in res["servers"])
    assert res["paired"] == []  # no llama-server: nothing to pair with
    assert any("KV cache" in line for line in res["servers"][0]["log"])  # the server's own start-up lines


def test_host_step_times_runs_the_engine_around_a_model_that_does_nothing():
    "The NullModel's steps: every row decodes, and the numbers are per batch size (43: the host's own work)."
    from minivllm.bench import NullModel, host_step_times
    from minivllm.qwen2 import Qwen2Config
    m = NullModel(Qwen2Config(vocab_size=50, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1))
    assert m(torch.tensor([1, 2, 3]), None, None).shape == (3, 8) and m.compute_logits(torch.zeros(2, 8)).shape == (2, 50)
    res = host_step_times(rows=(1, 8), steps=3)
    assert set(res) == {1, 8} and all(0 < r["min_ms"] <= r["median_ms"] for r in res.values())


def test_bench_host_command_line(tmp_path):
    out = tmp_path / "host.json"
    r = subprocess.run([sys.executable, "-m", "minivllm.bench", "host", "--rows", "1", "4", "--steps", "2", "--json",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["host_step_ms"]) == {"1", "4"} and "cpu" in json.dumps(res["machine"]).lower()
