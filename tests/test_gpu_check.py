"tools/gpu_check.py in its quick CPU mode: one JSON on stdout with every section, parity holding, no errors."
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.py"
SECTIONS = ("compile_targets", "parity", "two_engines", "long_prompt", "decode_step", "prefill_kernel", "throughput",
            "overlap", "nano_vllm_workload", "book")
GPU_DIRS = (ROOT / ".gpu", ROOT.parent / "shared" / "gpu")  # the bundled model's tokenizer and shapes
needs_gpu_dir = pytest.mark.skipif(not any((d / "bundled_config.json").exists() for d in GPU_DIRS),
                                   reason="needs .gpu/ or ../shared/gpu/ (bundled tokenizer)")  # fmt: skip


def check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    "The script in a fresh process, on the CPU whatever the machine has (CUDA_VISIBLE_DEVICES empty)."
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)  # fmt: skip


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    "One quick CPU run of every section: its stdout, stderr and the file --out wrote."
    out = tmp_path_factory.mktemp("gpu-check") / "check.json"
    p = check("--mode", "quick", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    return p, json.loads(out.read_text())


@needs_gpu_dir
def test_stdout_holds_only_the_json_it_wrote(quick):
    p, written = quick
    assert json.loads(p.stdout) == written  # nothing else on stdout: progress and libraries' go to stderr
    assert "section parity done" in p.stderr


@needs_gpu_dir
def test_every_section_ran_without_error(quick):
    res = quick[1]
    assert res["mode"] == "quick" and res["dtype"] == "float32"
    assert res["sections"] == list(SECTIONS)
    assert res["errors"] == [] and res["skipped"] == []
    for name in SECTIONS:
        assert "error" not in res[name], (name, res[name])
        assert res[name]["section_seconds"] >= 0
    for key in ("cpu", "torch", "transformers", "triton", "device", "date"):
        assert key in res["machine"], key


@needs_gpu_dir
def test_parity_holds_for_every_variant(quick):
    par = quick[1]["parity"]
    backends = ("torch", "triton") if importlib.util.find_spec("triton") else ("torch",)
    want = {f"attention_backend={b},enforce_eager={e}" for b in backends for e in (True, False)}
    assert want <= set(par["variants"])
    assert set(par["variants"]) == set(par["per_variant"])
    for name, r in par["per_variant"].items():
        assert r["total"] == len(par["prompt_lengths"]) * len(par["configs"]) * 2, name  # block sizes 1, 16
        assert r["identical"] == r["total"] and "errors" not in r, (name, r)
        assert r["graphs"] is False, name  # no CUDA graphs on the CPU
    assert par["identical"] == par["total"] > 0


@needs_gpu_dir
def test_the_stand_in_sections_report_their_numbers(quick):
    res = quick[1]
    assert res["two_engines"]["ok"] and res["two_engines"]["two_alive_fixed_budgets"]["same_tokens"]
    assert res["long_prompt"]["ok"] and res["long_prompt"]["new_tokens"] == 8
    rows = res["throughput"]["rows"]
    assert [r["concurrency"] for r in rows] == res["plan"]["concurrency"]
    for r in rows:
        assert r["ours"]["tokens"] == r["requests"] * r["output_tokens"] and r["ratio"] > 0
    assert "ours_eager" in rows[-1] and rows[-1]["ours_eager"]["graphs"] is False
    nano = res["nano_vllm_workload"]
    assert nano["output_tokens"] > 0 and nano["sampling"] == {"temperature": 0.6}
    assert nano["async_scheduling"]["output_tok_s"] > 0  # the same workload with the next step launched early
    ov = res["overlap"]
    assert ov["identical"] == ov["requests"] == res["plan"]["overlap"][0]  # greedy: the same tokens on and off
    assert ov["on"]["output_tok_s"] > 0 and ov["off"]["output_tok_s"] > 0
    ct = res["compile_targets"]
    assert ct["failed"] == {} and set(ct["targets"]) == {"sm_75", "sm_80", "sm_90"}
    assert all(done == total > 0 for done, total in ct["targets"].values())
    assert res["book"]["ok"] and res["book"]["notebooks"] == ["nbs/00a_utils.ipynb"] and res["book"]["failed"] == []
    for case in ("3 fresh x 12", "2 x 5 after 20 cached"):  # the prefill kernel: the reference's numbers
        row = res["prefill_kernel"][case]
        assert row["max_diff"] < 1e-4 and row["triton_ms"] > 0 and row["torch_ms"] > 0, row
    for B in res["plan"]["decode_batches"]:
        for key in (f"batch {B}", f"batch {B} eager"):
            assert res["decode_step"][key]["aten_ops_per_step"] > 0, key


@needs_gpu_dir
def test_the_t4_proxy_runs_float16_without_flash_attention(tmp_path):
    out = tmp_path / "t4.json"
    p = check("--mode", "quick", "--t4", "--sections", "overlap", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dtype"] == "float16" and res["t4_proxy"]["flash_sdp"] is False
    assert res["overlap"]["identical"] == res["overlap"]["requests"]


def test_bad_arguments_name_what_is_wrong():
    p = check("--sections", "parity,warp_speed")
    assert p.returncode == 2 and "warp_speed" in p.stderr and "two_engines" in p.stderr
    p = check("--mode", "gpu")
    assert p.returncode == 2 and "needs CUDA" in p.stderr
    p = check("--mode", "t4")
    assert p.returncode == 2 and "needs CUDA" in p.stderr
    p = check("--t4", "--dtype", "bfloat16")
    assert p.returncode == 2 and "float16" in p.stderr
    assert p.stdout == ""
