"""The new-mask loop's masks (`benchmarks.mask_loop_bench.loop_masks`): a new mask every step, and with
`--same-area` the same work per kind, so the 1.5x-median target measures the new-mask cost only."""

from __future__ import annotations

import pytest

from benchmarks.common import mask_area
from benchmarks.mask_loop_bench import KINDS, SAME_AREA, loop_masks


@pytest.mark.parametrize("kinds", [("docs_causal",), KINDS])
def test_same_area_masks_are_new_every_step_and_of_equal_work(kinds: tuple) -> None:
    masks = loop_masks(20, 16384, seed=1, kinds=kinds, same_area=True)
    assert [m[0] for m in masks] == [kinds[i % len(kinds)] for i in range(20)]  # the kinds in turn
    assert len({(m[0], str(m[1]), str(m[2]), str(m[3])) for m in masks}) == 20  # a new mask every step
    first: dict[str, int] = {}
    for kind, *mask in masks:
        area = mask_area(*mask)
        first.setdefault(kind, area)
        assert abs(area / first[kind] - 1) <= SAME_AREA


def test_without_same_area_the_work_varies() -> None:
    """The default loop (what the table's worst / median reports) mixes masks of very different work."""
    areas = [mask_area(*m[1:]) for m in loop_masks(14, 16384, seed=1)]
    assert max(areas) > 3 * min(areas)


def test_profile_appends_the_tables_of_the_steps_that_miss(tmp_path, monkeypatch) -> None:
    """`--profile FILE`: each timed step's first run under torch.profiler; the tables of the steps over 1.5x
    the median (here every later step: the ratio set to 0) are appended under a header naming the step."""
    import json

    from benchmarks import mask_loop_bench

    monkeypatch.setattr(mask_loop_bench, "SLOW_RATIO", 0.0)
    prof = tmp_path / "prof.txt"
    from benchmarks.cli import main

    argv = ["mask-loop", "--device", "cpu", "--backends", "torch", "--cps", "1,2", "--tokens", "256", "--steps",
            "3", "--warmup", "1", "--warmup-widths", "none", "--heads", "2:1", "--head-dim", "16",
            "--out-dir", str(tmp_path), "--profile", str(prof)]  # fmt: skip
    assert main(argv) == 0
    text = prof.read_text()
    for cp in (1, 2):
        for i in (1, 2):
            assert f"== torch cp {cp} step {i} (" in text
    assert "step 0 (" not in text and "aten::" in text
    rows = json.loads((tmp_path / "mask_loop.json").read_text())["rows"]
    assert [r["cp"] for r in rows] == [1, 2] and all("new_mask_ms_per_rank" in r for r in rows)


def test_call_tables_of_the_simulated_ranks() -> None:
    import torch

    from benchmarks.mask_loop_bench import _calls_sim, call_tables

    mask = loop_masks(1, 1024, seed=0, kinds=("docs_causal",))[0]
    q = k = v = torch.zeros(256, 1, 8)
    rk = rv = torch.zeros(1024, 1, 8)
    ranks, _, _ = _calls_sim(mask, q, k, v, rk, rv, 4)
    tables = call_tables(ranks)
    assert len(tables) == sum(len(r) for r in ranks) > 0
    for qr, kr, tm, kk in tables:
        assert qr.shape == kr.shape == (tm.shape[0], 2) and kk.shape[1:] == (1, 8)
