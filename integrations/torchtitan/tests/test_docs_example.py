"""The docs page's example runs as written: extracted from the page, launched with torchrun on 2 CPU ranks (cp 2)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from magi_attention.testing import run_docs_example

DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations" / "torchtitan.md"


@pytest.mark.skipif(not DOC.exists(), reason="docs page not in this checkout")
def test_docs_example_runs_as_written(tmp_path: Path) -> None:
    proc = run_docs_example(DOC, 2, tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 12, proc.stdout
    assert losses[-1] < losses[0] - 1.0, losses  # it learns
    # each rank holds its half of the 512 tokens of a batch (padded to magi's chunk grid)
    tokens = {int(m) for m in re.findall(r"tokens on this rank (\d+)", proc.stdout)}
    assert tokens and all(200 <= t <= 320 for t in tokens), tokens
