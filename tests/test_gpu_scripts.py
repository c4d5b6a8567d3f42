"""The GPU checks' workers and the GPU benchmarks run end to end on CPU ranks (gloo stands in for NCCL), so
they cannot rot between GPU sessions; the device runner parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "gpu_group_collective_worker.py"


def test_group_collective_check_runs_over_gloo(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(WORKER), "--device", "cpu", "--seeds", "3", "--out", str(tmp_path / "v.json")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    verdict = json.loads((tmp_path / "v.json").read_text())
    assert verdict["failed"] == 0 and verdict["table_sets"] == 3, verdict
    assert "reduce lse == reference" in verdict["worst"]


def test_native_check_needs_cuda_and_device_scripts_parse() -> None:
    cmd = [sys.executable, str(WORKER), "--device", "cpu"]
    res = subprocess.run([*cmd, "--impl", "native"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "--impl native needs --device cuda" in res.stderr, res.stderr[-2000:]
    for script in ("device.sh", "integration_wheels.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)]).returncode == 0, script


def test_simulated_cp_bench_runs_each_backend_on_the_same_plan(tmp_path: Path) -> None:
    """`python -m benchmarks sim` on the CPU (torch path, toy sizes): one row per backend for each
    (mask, cp) with the same plan, `auto` resolved and compared with the explicit backend; bad names refused."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MAGI_BENCH_DEVICE": "cpu"}
    script = [sys.executable, "-m", "benchmarks", "sim"]
    args = ["--tokens-per-gpu", "32", "--cps", "2", "--masks", "varlen_causal", "--degree", "0",
            "--cp1-tokens", "64", "--single-max-tokens", "64", "--json", str(tmp_path / "sim.json")]  # fmt: skip
    res = subprocess.run([*script, *args, "--kernel-backend", "torch,auto", "--simulate-explicit"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "sim.json").read_text())
    assert [(r["kernel_backend"], r["backend"]) for r in data["sim"]] == [
        ("torch", "torch"),
        ("auto", "torch"),
    ]
    torch_row, auto_row = data["sim"]
    assert [r["area"] for r in torch_row["ranks"]] == [r["area"] for r in auto_row["ranks"]]
    assert torch_row["single_fwd"] == auto_row["single_fwd"]  # the whole-mask yardstick, measured once
    assert [r["backend"] for r in data["cp1"]] == ["torch"]
    assert "| varlen_causal | 2 | auto (torch) |" in res.stdout
    bad = subprocess.run([*script, *args, "--kernel-backend", "auto,cuda"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and "--kernel-backend: unknown ['cuda']" in bad.stderr, bad.stderr[-2000:]
    alone = subprocess.run([*script, *args, "--kernel-backend", "auto"], capture_output=True, text=True,
                           timeout=120, env=env, cwd=ROOT)  # fmt: skip
    assert alone.returncode == 2 and "--no-single --no-cp1" in alone.stderr, alone.stderr[-2000:]


def test_bandwidth_tables_are_consistent() -> None:
    """The GPU bandwidth benchmark's tables: every rank's agree, half of each input is sent, nothing to self."""
    import benchmarks.group_collective_bench as bench  # the repository root is on pytest.ini's pythonpath
    from magi_group_collective._tables import CastTables, cross_check

    for world in (2, 3, 4, 8):
        tables = [CastTables.build(*bench.bandwidth_tables(world, r, 4096), world) for r in range(world)]
        assert not cross_check(tables), world
        for r, t in enumerate(tables):
            sent = sum(n * len(d) for n, d in zip(t.input_split_sizes, t.dst_indices))
            assert sent * 2 == sum(t.input_split_sizes) and all(r not in d for d in t.dst_indices)


def test_device_runner_documents_and_checks_its_phases(tmp_path: Path) -> None:
    """`benchmarks/device.sh`: every phase is listed in its header (printed when called without one), the
    documented ones exist, and an unknown phase is refused before anything runs."""
    import re

    script = ROOT / "benchmarks" / "device.sh"
    phases = re.findall(r"^phase_([\w-]+)\(\) \{", script.read_text(), flags=re.M)
    env = {**os.environ, "OUT": str(tmp_path)}
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert usage.returncode == 2
    for phase in phases:
        assert re.search(rf"[\s(|]{re.escape(phase)}[\s(|]", usage.stdout), f"phase {phase} not in the header"
    documented = ("park", "install", "gpu-tests", "info", "mask-loop", "first-step", "kernels-det", "scaling")
    assert set(documented) <= set(phases)
    bad = subprocess.run(["bash", str(script), "gpu-tests", "nope"], capture_output=True, text=True, timeout=60,
                         env=env)  # fmt: skip
    assert bad.returncode == 2 and "unknown phase nope" in bad.stderr
    assert not (tmp_path / "device.log").exists()  # refused before the first phase ran
