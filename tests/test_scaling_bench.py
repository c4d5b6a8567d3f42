"""`python -m benchmarks.magi_attention_bench --scaling` on the CPU (torch path, toy sizes): the scaling table's
efficiency, the plan's remote K/V and the cost model's prediction for every simulated row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scaling_table_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MAGI_BENCH_DEVICE": "cpu"}
    args = ["--tokens-per-gpu", "64", "--cps", "2", "--masks", "video_block_causal", "--degree", "0",
            "--no-cp1", "--single-max-tokens", "128", "--kernel-backend", "torch,auto", "--scaling",
            "--json", str(tmp_path / "s.json")]  # fmt: skip
    res = subprocess.run([sys.executable, "-m", "benchmarks.magi_attention_bench", *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())["scaling"]
    assert [r["kernel_backend"] for r in rows] == ["torch", "auto"]
    for r in rows:
        assert r["E_fwd"] > 0 and r["E_bwd"] > 0  # auto takes the explicit backend's one-GPU rate
        assert r["chunk_size"] >= 1 and r["remote_kv_tokens_max"] >= r["remote_kv_tokens_mean"] >= 0
        assert r["predicted"]["fwd_ms"] > 0 and r["predicted"]["bwd_tflops_per_gpu"] > 0
    assert "| video_block_causal | 2 | auto (torch) |" in res.stdout
