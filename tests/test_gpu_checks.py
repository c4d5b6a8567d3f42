"""The GPU correctness checks of the runtime and the group collectives, one test per check.

- `tests/gpu_runtime_worker.py`: calc_attn in bf16 against dense fp64 per kernel backend; at one GPU cp = 1
  plus the simulated ranks of cp 4 and 8 (one plain process, no torchrun), on every GPU of the machine the
  runtime over NCCL at cp = the GPU count (the test launches torchrun).
- `tests/gpu_group_collective_worker.py`: GroupCast / GroupReduce over NCCL, and the native implementation,
  against gloo (every GPU, torchrun).

Each worker writes a JSON verdict (rank 0) that the test grades, besides its exit status; the rows stay in the
test's temporary folder (`--basetemp` keeps them). On the GPU machine, from the repository root, every GPU
test of the repository in one command:

    python -m pytest -m gpu

CPU CI collects these tests and skips them (no CUDA device); `tests/test_gpu_scripts.py` runs the group
collective worker over gloo on the CPU so it cannot rot between GPU sessions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NGPU == 0, reason="needs a CUDA GPU")]


def _fa4_available() -> bool:
    try:
        import magi_ffa_fa4
    except ImportError:
        return False
    return magi_ffa_fa4.fa4_available()


def run_worker(worker: str, nproc: int, args: list[str], out: Path, timeout: float) -> dict:
    """Run `tests/<worker>` on `nproc` GPUs (one plain process at 1, torchrun above) with `--out out`; its JSON
    verdict (the test fails with the output's tail if the worker exits non-zero)."""
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "0"}
    res = subprocess.run([*launch, str(HERE / worker), *args, "--out", str(out)], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=HERE.parent)  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return json.loads(out.read_text())


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
"""(GPUs: 1 or every GPU ("all", at least 2), worker arguments)."""


def _nproc(gpus: int | str) -> int:
    if gpus == "all":
        if NGPU < 2:
            pytest.skip("needs at least 2 GPUs")
        return NGPU
    return int(gpus)


@pytest.mark.parametrize(("gpus", "args"), RUNTIME_CASES)
def test_runtime_matches_dense_fp64(tmp_path: Path, gpus: int | str, args: list[str]) -> None:
    if "--backends" not in args:  # FA4 where flash-attn-4 is installed, the Triton kernel always
        args = [*args, "--backends", "fa4,triton" if _fa4_available() else "triton"]
    verdict = run_worker("gpu_runtime_worker.py", _nproc(gpus), args, tmp_path / "runtime.json", timeout=600)
    bad = [r for r in verdict["rows"] if not r["ok"]]
    assert verdict["rows"] and verdict["failed"] == 0 and not bad, bad


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="nccl-vs-gloo"),
        pytest.param(["--impl", "native", "--seeds", "20", "--big-seeds", "2"], id="native-vs-a2av-vs-gloo"),
    ],
)
def test_group_collectives_match_gloo(tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "grpcoll.json"
    verdict = run_worker("gpu_group_collective_worker.py", _nproc("all"), args, out, timeout=300)
    assert verdict["worst"] and verdict["failed"] == 0 and not verdict["failures"], verdict
