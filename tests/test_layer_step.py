"""`python -m benchmarks layer-step` on the CPU (the torch path, toy sizes): every mode
gives each runner its timed steps, the per-mask work runs once with the same mask and every step with a new
one, a runner this machine lacks is reported, and the ratios are the vendors' medians over ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import layer_step
from benchmarks.cli import main


def test_layer_step_runs_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    prepared: dict[str, int] = {}
    make = layer_step.make_runner

    def counting(name, sample):  # counts each runner's per-mask work
        r = make(name, sample)

        def prepare(mask):
            prepared[name] = prepared.get(name, 0) + 1
            return r.prepare(mask)

        return layer_step.Runner(prepare, r.layer)

    monkeypatch.setattr(layer_step, "make_runner", counting)
    argv = ["layer-step", "--device", "cpu", "--seqlens", "384", "--heads", "2:1", "--head-dim", "16",
            "--layers", "2", "--steps", "2", "--warmup-steps", "1", "--runners", "ffa,calc_torch,cudnn_flex",
            "--out-dir", str(tmp_path), "--tag", "ls", "--modes", "same"]  # fmt: skip
    assert main(argv) == 0
    same = {r["runner"]: r for r in json.loads((tmp_path / "ls.json").read_text())["rows"]}
    assert prepared == {"ffa": 1, "calc_torch": 1}  # the same mask: its per-mask work once, before the timing
    assert main([*argv[:-1], "new"]) == 0
    new = {r["runner"]: r for r in json.loads((tmp_path / "ls.json").read_text())["rows"]}
    assert prepared == {"ffa": 1 + 3, "calc_torch": 1 + 3}  # a new mask: every step (1 warm-up + 2 timed)
    for rows, mode in ((same, "same"), (new, "new")):
        assert list(rows) == ["ffa", "calc_torch", "cudnn_flex"] and all(
            r["mode"] == mode for r in rows.values()
        )
        for name in ("ffa", "calc_torch"):
            r = rows[name]
            assert r["steps"] == 2 and len(r["times_ms"]) == 2 and r["median_ms"] > 0, r
            assert r["spread_ms"] == pytest.approx(max(r["times_ms"]) - min(r["times_ms"]), abs=2e-3)
        assert "cudnn" in rows["cudnn_flex"]["error"]  # no cuDNN frontend on the CPU: reported, not hidden
    text = (tmp_path / "ls.md").read_text()
    assert (
        "| kernel API / calc_attn | ffa / calc_torch |" in text and "| cudnn_flex | unavailable | - |" in text
    )


def test_ratios_are_the_vendor_median_over_ours() -> None:
    base = dict(mode="same", tokens=8192, heads="64:8", d=128, layers=32, dtype="bfloat16", spread_ms=1.0)
    rows = [dict(base, runner="ffa_fa4", median_ms=127.9), dict(base, runner="fa4", median_ms=91.5),
            dict(base, runner="auto", median_ms=92.4), dict(base, runner="cudnn_flex", error="missing")]  # fmt: skip
    text = "\n".join(layer_step.render(rows))
    assert "| vs vendor | ffa_fa4 / fa4 | 0.72 |" in text and "| vs vendor | auto / fa4 | 0.99 |" in text
    assert "cudnn_flex |" not in text.split("| ratio")[1]  # no ratio against a runner that did not run
    with pytest.raises(ValueError, match="unknown runners"):
        layer_step.layer_step(["ffa", "fa5"], 256, device="cpu")


def test_vendor_runners_do_their_per_mask_work_as_each_mode_says(monkeypatch) -> None:
    """FA4's and cuDNN's runners, with the vendors' calls stood in for (no FA4 or cuDNN on the CPU): the
    cu_seqlens / mask plan are built once with the same mask, every step with a new one, and each layer's call
    gets what its mask's preparation returned."""
    from magi_attention import vendors

    calls = {"fa4_local": [], "cudnn_mask_plan": [], "cudnn_flex_attn": set()}

    def fa4_local(mask, device, fa=None):
        calls["fa4_local"].append(mask.name)
        return (lambda q, k, v: q * 1.0), "FA4"

    def cudnn_mask_plan(mask, q, k, v):
        calls["cudnn_mask_plan"].append(mask.name)
        return ("plan", mask.name)

    def cudnn_flex_attn(q, k, v, plan):
        assert plan[0] == "plan"
        calls["cudnn_flex_attn"].add(plan[1])
        return q * 1.0

    monkeypatch.setattr(vendors, "import_vendor", lambda name, what: object())
    monkeypatch.setattr(vendors, "fa4_local", fa4_local)
    monkeypatch.setattr(vendors, "cudnn_mask_plan", cudnn_mask_plan)
    monkeypatch.setattr(vendors, "cudnn_flex_attn", cudnn_flex_attn)
    rows = layer_step.layer_step(["fa4", "cudnn_flex"], 512, heads=(2, 1), head_dim=8, layers=2, steps=2,
                                 warmup=1, device="cpu", dtype=torch.float32)  # fmt: skip
    assert all("error" not in r and r["steps"] == 2 for r in rows), rows
    same = ["docs seed 0"]
    new = [f"docs seed {i}" for i in (1, 2, 3)]
    assert calls["fa4_local"] == same + new and calls["cudnn_mask_plan"] == same + new
    assert calls["cudnn_flex_attn"] == set(same + new)
