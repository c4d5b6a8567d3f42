"""The kernel law: its shipped constants, how it prices a rank, and the fit script that writes it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from magi_solver.dispatch import dispatch_slices
from magi_solver.kernel_law import DirectionLaw, KernelLaw, get_kernel_law, law_for_mask, load_law_table
from magi_solver.mask import normalize_mask
from magi_solver.pricing import price_plan


def test_shipped_law_has_its_provenance_and_error() -> None:
    table = load_law_table("h200")
    assert table is not None and table["gpu_kind"] == "h200" and table["data"]
    for backend in ("cudnn", "fa4"):
        for direction in ("fwd", "bwd"):
            entry = table["laws"][backend][direction]
            assert entry["source"]
            if not entry.get("estimate", False):
                assert entry["r2"] > 0.99 and entry["median_error"] < 0.1
    law = get_kernel_law("h200", "cudnn")
    # the backward law of docs/benchmarks/scaling.md
    assert (law.bwd.tiles, law.bwd.key_columns) == (2.08, 9.91)


def test_backward_charges_every_key_a_rank_reads() -> None:
    law = get_kernel_law("h200", "cudnn")
    area, own = 32e6, 8192
    few, many = law.bwd_ms(area, own + 64, own), law.bwd_ms(area, own + 4096, own)
    # 4032 more keys: 31.5 columns at 9.91 us
    assert many - few == pytest.approx(4032 / 128 * 9.91e-3)
    assert law.bwd_ms(0, own, own) == 0.0  # no tiles: the runtime skips the call
    assert law.scaled(32, 128).bwd_ms(area, own, own) == pytest.approx(0.5 * law.bwd_ms(area, own, own))


def test_law_rejects_bad_constants_and_backends() -> None:
    with pytest.raises(ValueError, match="tiles"):
        DirectionLaw("x", -1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="backend"):
        get_kernel_law("h200", "nope")
    with pytest.raises(ValueError, match="num_heads_q"):
        get_kernel_law().scaled(0, 128)
    # an unknown GPU kind prices with the H200's law (the choice needs ratios only)
    assert get_kernel_law("mi300x", "cudnn").gpu == "h200"


def test_auto_law_is_a_pure_function_of_the_mask() -> None:
    sl = normalize_mask([[0, 4096]], [[0, 4096]], "full", 4096, 4096)
    a, b = law_for_mask(sl, 4096), law_for_mask(list(sl), 4096)
    assert a == b and isinstance(a, KernelLaw)


def test_price_counts_received_keys_as_columns() -> None:
    total, cp = 4096, 4
    sl = normalize_mask([[0, total]], [[0, total]], "causal", total, total)
    plan = dispatch_slices(sl, total, cp, 256, "sequential")
    law = get_kernel_law("h200", "cudnn")
    price = price_plan(plan, sl, law)
    # sequential causal: rank r receives every earlier key
    assert price.remote.tolist() == [0, 1024, 2048, 3072]
    assert np.allclose(price.key_columns, (1024 + price.remote) / 128)
    assert price.time_imbalance > 1.5 and price.step_ms > price.fwd_ms.max() + price.bwd_ms.max()


def test_fit_script_recovers_known_constants(tmp_path) -> None:
    from benchmarks.cli import main

    rng = np.random.default_rng(0)
    ranks = []
    for _ in range(40):
        tiles, cols, rows = rng.uniform(100, 5000), rng.uniform(64, 600), 64
        ranks.append({"area": tiles * 128**2, "tiles": tiles, "key_columns": cols, "rows": rows,
                      "fwd_ms": (0.8 * tiles + 0.5 * cols + 4.0 * rows) / 1e3,
                      "bwd_ms": (2.0 * tiles + 10.0 * cols) / 1e3, "full_timing": True})  # fmt: skip
    sims = [
        {"mask": m, "cp": 8, "backend": "cudnn", "tokens_per_gpu": 8192, "ranks": ranks[i::2]}
        for i, m in enumerate(("a", "b"))
    ]
    src = tmp_path / "scaling.json"
    src.write_text(json.dumps({"sim": sims}))
    out = tmp_path / "law.json"
    assert main(["fit-law", str(src), "--out", str(out)]) == 0
    laws = json.loads(out.read_text())["laws"]
    assert laws["cudnn"]["bwd"]["tiles"] == pytest.approx(2.0, abs=1e-3)
    assert laws["cudnn"]["bwd"]["key_columns"] == pytest.approx(10.0, abs=1e-3)
    assert laws["cudnn"]["fwd"]["rows"] == pytest.approx(4.0, abs=1e-2)
    assert laws["fa4"]["fwd"]["estimate"] is True  # no FA4 ranks: cuDNN's constants, marked


def test_overlap_cost_model_prices_kernels_by_the_law() -> None:
    from magi_solver.cost_model import OverlapCostModel, get_profile

    law = get_kernel_law("h200", "cudnn")
    plain = OverlapCostModel(get_profile("h200", "fa4"), 64, 8, 128)
    m = OverlapCostModel(get_profile("h200", "fa4"), 64, 8, 128, law=law)
    area, local, remote = 30e6, 8192, 20000
    # degree 0: one merged call over own + received keys
    got = m.schedule_time(0, area, [1e6], [remote], local, backward=True)
    rest = plain.schedule_time(0, area, [1e6], [remote], local, backward=True) - plain.kernel(
        area + 1e6, True
    )
    kernel = m.profile.kernel_fixed_s + float(law.bwd_ms(area + 1e6, local + remote, local)) * 1e-3
    assert got == pytest.approx(rest + kernel)
    # more received keys cost the law's columns, not only bandwidth
    more = m.schedule_time(0, area, [1e6], [2 * remote], local, backward=True)
    assert more - got > plain.schedule_time(0, area, [1e6], [2 * remote], local, backward=True) - (
        plain.schedule_time(0, area, [1e6], [remote], local, backward=True)
    )
    with pytest.raises(TypeError, match="law"):
        OverlapCostModel(get_profile("h200", "fa4"), 64, 8, 128, law="cudnn")


def test_efficiency_bound_counts_the_keys_pieces_must_read() -> None:
    from magi_solver.bounds import efficiency_bound

    law = get_kernel_law("h200", "cudnn")
    total, cp = 8192, 4
    full = normalize_mask([[0, total]], [[0, total]], "full", total, total)
    b = efficiency_bound(full, total, cp, law)
    # one unit cut into 4 pieces, each reading the other 3 pieces' keys
    assert b.extra_keys == cp * (cp - 1) * (total // cp) and b.cut_units == 1
    whole = float(law.bwd_ms(total * total, total, total))
    assert b.bwd == pytest.approx(whole / (whole + 9.91e-3 * b.extra_keys / 128))
    causal = normalize_mask([[0, total]], [[0, total]], "causal", total, total)
    assert efficiency_bound(causal, total, cp, law).extra_keys == (total // cp) * cp * (cp - 1) // 2
    # packed documents no longer than a rank's share: nothing to read, E 1
    docs = normalize_mask([[0, 2048], [2048, 4096]], [[0, 2048], [2048, 4096]], "causal", 4096, 4096)
    assert efficiency_bound(docs, 4096, 2, law).bwd == 1.0
    with pytest.raises(ValueError, match="cp"):
        efficiency_bound(docs, 4096, 0, law)


def test_balance_bound_is_the_least_spread_of_the_tiles() -> None:
    import dataclasses

    from magi_solver.bounds import balance_bound

    law = get_kernel_law("h200", "cudnn")
    total, cp = 9216, 3
    sl = normalize_mask([[0, 3072], [3072, total]], [[0, 3072], [3072, total]], "causal", total, total)
    plan = dispatch_slices(sl, total, cp, 256, alg="min_heap")
    price = price_plan(plan, sl, law)
    bound = balance_bound(plan, price, law)
    mean = float(price.fwd_ms.mean() + price.bwd_ms.mean())
    assert mean * (1 - 1e-9) <= bound <= float(price.fwd_ms.max() + price.bwd_ms.max()) * (1 + 1e-9)
    # brute force over the splits of the tiles (each rank's keys and rows as the plan has them)
    tiles = sum(plan.rank_areas) / 128**2
    cols = np.asarray(price.key_columns, dtype=np.float64)
    rows = np.asarray(plan.shard_seqlens, dtype=np.float64)
    grid = np.linspace(0.0, tiles, 601)
    t1, t2 = np.meshgrid(grid, grid)
    t3 = tiles - t1 - t2
    ok = t3 >= 0
    ts = [t1[ok], t2[ok], t3[ok]]
    f = np.max([law.fwd_ms(t * 128**2, cols[r] * 128, rows[r]) for r, t in enumerate(ts)], axis=0)
    b = np.max([law.bwd_ms(t * 128**2, cols[r] * 128, rows[r]) for r, t in enumerate(ts)], axis=0)
    assert bound <= float((f + b).min()) * (1 + 1e-9)
    assert bound == pytest.approx(float((f + b).min()), rel=5e-3)
    # equal key columns and rows: the tiles split evenly, every rank at the mean
    even = dataclasses.replace(price, key_columns=np.full(cp, cols.mean()))
    fwd = float(law.fwd_ms(tiles * 128**2 / cp, cols.mean() * 128, rows[0]))
    bwd = float(law.bwd_ms(tiles * 128**2 / cp, cols.mean() * 128, rows[0]))
    assert balance_bound(plan, even, law) == pytest.approx(fwd + bwd, rel=1e-6)
