"""The GPU correctness checks of the runtime and the group collectives, one test per check of the GPU suite.

Each test launches one of the checks on every GPU of the machine (`torchrun`, one process per GPU) and asserts
that it passed: `benchmarks/gpu_runtime_check.py` (calc_attn in bf16 against dense fp64 per kernel backend,
over NCCL at cp = the GPU count, or cp 1 plus simulated cp 4 and 8 on one GPU) and
`benchmarks/gpu_group_collective_check.py` (GroupCast / GroupReduce over NCCL, and the native
implementation, against gloo). The checks stay scripts too (the device scripts run them with their own
arguments and keep their JSON rows).

On the GPU machine, from the repository root, every GPU test of the repository in one command:

    python -m pytest -m gpu

CPU CI collects these tests and skips them (no CUDA device).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="needs a CUDA GPU")]


def _fa4_available() -> bool:
    try:
        import magi_ffa_fa4
    except ImportError:
        return False
    return magi_ffa_fa4.fa4_available()


def _torchrun(script: str, nproc: int, args: list[str], timeout: float) -> str:
    """Run `benchmarks/<script>` on `nproc` GPUs; its stdout (the test fails with the output's tail)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += [str(ROOT / "benchmarks" / script), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "0"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res.stdout


# (id, GPUs: 1 or every GPU ("all", at least 2), arguments); the cases of benchmarks/gpu_suite.sh
RUNTIME_CASES = [
    pytest.param(1, [], id="cp1-and-simulated-cp4-cp8"),
    pytest.param("all", [], id="nccl"),
    pytest.param("all", ["--head-dim", "64", "--degrees", "0,dynamic"], id="nccl-d64"),
    pytest.param(
        "all", ["--head-dim", "256", "--backends", "triton", "--degrees", "0,dynamic"], id="nccl-d256"
    ),
    pytest.param("all", ["--uneven-shard", "--tokens", "4000", "--degrees", "0,dynamic"], id="nccl-uneven"),
    pytest.param("all", ["--grpcoll", "native"], id="nccl-native-grpcoll"),
]


def _nproc(gpus: int | str) -> int:
    if gpus == "all":
        if NGPU < 2:
            pytest.skip("needs at least 2 GPUs")
        return NGPU
    return int(gpus)


@pytest.mark.parametrize(("gpus", "args"), RUNTIME_CASES)
def test_runtime_matches_dense_fp64(gpus: int | str, args: list[str]) -> None:
    if "--backends" not in args:  # FA4 where flash-attn-4 is installed, the Triton kernel always
        args = [*args, "--backends", "fa4,triton" if _fa4_available() else "triton"]
    out = _torchrun("gpu_runtime_check.py", _nproc(gpus), args, timeout=600)
    assert " 0 failed" in out, out[-4000:]


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="nccl-vs-gloo"),
        pytest.param(["--impl", "native", "--seeds", "20", "--big-seeds", "2"], id="native-vs-a2av-vs-gloo"),
    ],
)
def test_group_collectives_match_gloo(args: list[str]) -> None:
    out = _torchrun("gpu_group_collective_check.py", _nproc("all"), args, timeout=300)
    assert "0 failures" in out, out[-4000:]
