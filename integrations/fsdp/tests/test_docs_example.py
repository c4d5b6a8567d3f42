"""The docs page's example runs as written: extracted from the page, launched with torchrun on 4 CPU ranks (dp 2 x cp 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations" / "fsdp.md"


def _example_code() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    runnable = [b for b in blocks if "init_process_group" in b]
    assert len(runnable) == 1, "the page should hold exactly one complete runnable example"
    return runnable[0]


@pytest.mark.skipif(not DOC.exists(), reason="docs page not in this checkout")
def test_docs_example_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "train_fsdp_cp.py"
    script.write_text(_example_code())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(script),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for dp in (0, 1):
        losses = [float(m) for m in re.findall(rf"dp {dp} step +\d+ loss (\d+\.\d+)", proc.stdout)]
        assert len(losses) == 12, proc.stdout
        assert losses[-1] < losses[0] - 0.5, losses  # it learns
