"""tools/triton_targets.py: every Triton kernel of the package compiled, on a machine without a GPU, for sm_75 (the
T4: float32 and float16), sm_80 and sm_90 (also bfloat16), on the bundled model's shapes and Qwen3-0.6B's, each
within its target's shared memory. What it cannot say: that they run, or how fast (a lent GPU's work)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {"_paged_decode_kernel", "_merge_splits_kernel", "_store_kv_kernel", "_paged_prefill_kernel",
           "_add_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel"}  # fmt: skip
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("targets") / "targets.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "triton_targets.py"), "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout) == json.loads(out.read_text())
    return json.loads(out.read_text())


def test_every_kernel_compiles_for_every_target(report):
    assert set(report["targets"]) == {"sm_75", "sm_80", "sm_90"}
    for name, t in report["targets"].items():
        failed = {k: v for k, v in t["kernels"].items() if not v["ok"]}
        assert not failed and t["compiled"] == t["total"] > 0, (name, failed)
        assert {k.split("[")[0] for k in t["kernels"]} == KERNELS, name  # every kernel the package launches


def test_the_t4_gets_float16_and_float32_the_others_bfloat16_too(report):
    dtypes = {name: {k.split("[")[1].split(";")[0] for k in t["kernels"]} for name, t in report["targets"].items()}
    assert dtypes["sm_75"] == {"float32", "float16"}
    assert dtypes["sm_80"] == dtypes["sm_90"] == {"float32", "float16", "bfloat16"}
    heads = {k for k in report["targets"]["sm_75"]["kernels"] if k.startswith("_paged_decode_kernel")}
    assert any("D=128" in k for k in heads) and any("D=64" in k for k in heads)  # both models' head sizes
    assert any("SPLIT=True" in k for k in heads) and any("SPLIT=False" in k for k in heads)
    prefill = {k for k in report["targets"]["sm_90"]["kernels"] if k.startswith("_paged_prefill_kernel")}
    assert any("bfloat16" in k and "DOT=True" in k for k in prefill)  # the tensor-core path a GPU takes
    assert any("float32" in k and "DOT=False" in k for k in prefill)
    for t in report["targets"].values():
        assert all(v["shared_bytes"] >= 0 and v["num_warps"] >= 1 for v in t["kernels"].values())
