"""A loop that hands the kernels a new mask every step compiles nothing after its warm-up.

The GPU tests run ``python -m benchmarks mask-loop --check`` (20 timed steps of 16k tokens, each a new mask of
one of seven kinds, after a warm-up of other masks and of one mask per FA4 interval-width bucket) for the
FA4, cuDNN and Triton backends at cp 1: it exits 1 when a compiled-kernel cache (FA4's and cuDNN's JIT
caches, magi_ffa's Triton kernels) grows during the timed steps or a step compiles where no cache shows it
(takes more than ``COMPILE_S`` seconds longer than the same mask's warm re-run). How fast the steps are is
the benchmark's report, not this test's verdict. On the GPU machine, from the repository root:

    python -m pytest -m gpu packages/ffa_fa4/tests/test_mask_loop_gpu.py

The CPU test runs the same script on the torch path at toy sizes, so that it cannot rot between GPU sessions
(it needs the runtime and the planner installed beside this package, as in the development environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _run(args: list[str], out: Path, timeout: float, env: dict | None = None) -> tuple[int, str, dict]:
    cmd = [sys.executable, "-m", "benchmarks", "mask-loop", *args, "--out-dir", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    report = json.loads((out / "mask_loop.json").read_text()) if (out / "mask_loop.json").exists() else {}
    return res.returncode, res.stdout + res.stderr, report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["fa4", "cudnn", "triton"])
def test_new_mask_every_step_compiles_nothing_after_warmup(backend: str, tmp_path: Path) -> None:
    rc, log, report = _run(
        ["--backends", backend, "--cps", "1", "--check"], tmp_path, timeout=900, env={"TRITON_INTERPRET": "0"}
    )
    rows = report.get("rows", [])
    if rows and "skipped" in rows[0]:
        pytest.skip(f"{backend}: {rows[0]['skipped']}")
    assert rc == 0, log[-4000:]
    (row,) = rows
    assert row["passed"] and len(row["steps"]) == 20
    assert not any(row["cache_growth"].values()), row["cache_growth"]
    assert not row["stall_steps"], [row["steps"][i] for i in row["stall_steps"]]


def test_script_runs_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("magi_attention")
    pytest.importorskip("magi_solver")
    args = ["--device", "cpu", "--backends", "torch", "--cps", "1,2", "--tokens", "512", "--steps", "3"]
    args += ["--warmup", "1", "--warmup-widths", "3", "--heads", "2:1", "--head-dim", "16"]
    rc, log, report = _run(args, tmp_path, timeout=300)
    assert rc == 0, log[-4000:]
    rows = report["rows"]
    assert [(r["backend"], r["cp"]) for r in rows] == [("torch", 1), ("torch", 2)]
    for r in rows:
        assert len(r["steps"]) == 3 and r["steps"][0]["kind"] == "random"
        assert all(s["seconds"] > 0 and s["rerun_seconds"] > 0 for s in r["steps"])
        # CPU timings under load are noise: the verdict's fields exist, their values are the GPU test's
        assert isinstance(r["stall_steps"], list) and isinstance(r["passed"], bool)
        assert set(r["cache_growth"]) == {"fa4", "cudnn", "triton"}
        assert r["warmup_masks"] == ["random"] + [f"warmup{i}" for i in range(6)]
    assert "backend   cp" in log


def test_cache_counter_reads_the_vendor_caches(monkeypatch) -> None:
    """The script counts FA4's and cuDNN's JIT caches (a function's ``compile_cache`` or a module's cache
    object, each a ``*Cache`` holding a ``cache`` dict) and Triton kernels' ``device_caches``, once each."""
    import types

    import benchmarks.mask_loop_bench as bench  # the repository root is on pytest.ini's pythonpath

    class JITCache:
        def __init__(self, n: int):
            self.cache = {i: None for i in range(n)}

    def fwd():
        pass

    fwd.compile_cache = JITCache(2)
    fa = types.ModuleType("flash_attn.cute.interface")
    fa._flash_attn_fwd, fa.alias = fwd, fwd.compile_cache  # one cache reached twice counts once
    cu = types.ModuleType("cudnn.flex_attention.plan.builder")
    cu._CLASSIFY = JITCache(1)
    kernel = types.SimpleNamespace(device_caches={0: ({"a": 1, "b": 2, "c": 3}, None)})
    tr = types.ModuleType("magi_ffa._fake_kernels")
    tr.kernel, tr.same = kernel, kernel
    before = bench.cache_entries()
    for mod in (fa, cu, tr):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    after = bench.cache_entries()
    assert {n: after[n] - before[n] for n in after} == {"fa4": 2, "cudnn": 1, "triton": 3}
