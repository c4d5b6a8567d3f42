"""`python -m benchmarks first-step` runs end to end on the CPU (tiny shapes, two fresh child processes), so the
script the GPU measurement uses cannot rot between GPU sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_first_step_smoke_on_cpu(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks", "first-step", "--device", "cpu", "--tokens", "256",
           "--heads", "2,1,16", "--runs", "cp1,sim8_warmup", "--breakdown", "auto", "--vendor-baseline", "",
           "--out-dir", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads((tmp_path / "first_step.json").read_text())
    kinds = [(r["kind"], r["cache"]) for r in doc["runs"]]
    assert kinds == [("cp1", "cold"), ("sim8_warmup", "cold")]
    for r in doc["runs"]:
        assert r["first_step_s"] > 0 and r["steady_step_s"] > 0 and r["cache_bytes"] >= 0
    assert doc["runs"][1]["warmup_s"] > 0
    # the breakdown from launch: every stage timed, the vendors apart, and the stages add up to the total
    assert [(r["kind"], r["cache"]) for r in doc["breakdown"]] == [
        ("breakdown:auto", "cold"),
        ("breakdown:auto", "warm"),
    ]
    for r in doc["breakdown"]:
        assert r["vendors"] == [] and r["vendor_import_s"] == 0  # the CPU's auto runs the torch path
        parts = ("python_s", "import_torch_s", "import_ours_s", "cuda_start_s", "inputs_s", "first_key_s")
        assert all(r[p] >= 0 for p in parts) and r["import_torch_s"] > 0 and r["first_step_s"] > 0
        assert r["ours_s"] == r["import_ours_s"] + r["first_key_s"] + r["first_step_s"]
        assert sum(r[p] for p in parts) <= r["launch_to_first_backward_s"]
        assert r["second_key_s"] > 0 and r["second_step_s"] > 0
    assert [i["modules"] for i in doc["imports"]] == ["torch"] and doc["imports"][0][
        "launch_to_imported_s"
    ] > 0
    assert "from process launch" in res.stdout
    bad = subprocess.run([*cmd[:4], "--runs", "nope"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--runs" in bad.stderr
