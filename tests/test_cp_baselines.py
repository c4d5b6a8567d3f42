"""CPU (gloo, fp64) checks of the context-parallel baselines in benchmarks/cp_baselines.py.

Every baseline (Ulysses, zigzag ring, all-gather K/V) must give the dense fp64 reference's out, lse, dq, dk
and dv to 1e-9 relative on full, causal, varlen causal, varlen full and random slice masks (all four types,
empty slices, rows with no key), at world sizes 2, 3 and 4; one launch of the ranks per world size runs
every (mask, baseline) pair. Receive buffers are NaN-poisoned (MAGI_FFA_POISON=1) so unwritten rows show.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, random_qkv, random_slices, ref_attn, varlen_slices

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


cpb = _load("cp_baselines")
SYSTEMS = tuple(cpb.CPBaseline)
RTOL = 1e-9
NUM_MASKS = 7


def _doc_lengths(total: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    out, left = [], total
    while left > 0:
        n = min(left, rng.randint(1, max(1, total // 3)))
        out.append(n)
        left -= n
    return out


def _masks(total: int, seed: int) -> dict[str, tuple]:
    docs = _doc_lengths(total, seed)
    return {
        "full": ([[0, total]], [[0, total]], [0]),
        "causal": ([[0, total]], [[0, total]], [1]),
        "varlen_causal": varlen_slices(docs, 1),
        "varlen_full": varlen_slices(docs, 0),
        "random_a": random_slices(total, total, seed=seed, max_bands=4),
        "random_b": random_slices(total, total, seed=seed + 1, max_bands=5, density=0.5),
        # slices that share pairs: the mask is their union (magi_solver rewrites them into disjoint slices)
        "shared_pairs": (
            [[0, total], [0, total // 2], [total // 3, total]],
            [[0, total], [0, total // 2], [0, total // 2]],
            [1, 0, 2],
        ),
    }


def _rel(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| over finite reference entries; infinities (lse of rows with no key) and
    NaN must match the reference exactly (a mismatch returns inf)."""
    if torch.isnan(got).any() or not torch.equal(torch.isinf(got), torch.isinf(ref)):
        return float("inf")
    fin = torch.isfinite(ref)
    if not torch.equal(got[~fin], ref[~fin]):
        return float("inf")
    scale = ref[fin].abs().max().item() if fin.any() else 1.0
    return (got[fin] - ref[fin]).abs().max().item() / max(scale, 1e-300) if fin.any() else 0.0


def _check_rank(rank: int, world_size: int, total: int, hq: int, hkv: int, seed: int) -> dict:
    os.environ["MAGI_FFA_POISON"] = "1"
    d = 8
    errors: dict[str, float] = {}
    for mname, (qr, kr, tm) in _masks(total, seed).items():
        q, k, v = random_qkv(total, total, hq, hkv, d, torch.float64, seed=seed)
        do = torch.randn(total, hq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 7))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        mask = make_attn_mask(qr, kr, tm, total, total)
        out_ref, lse_ref = ref_attn(*ref_in, mask)
        (out_ref * do).sum().backward()
        refs = {"out": out_ref.detach(), "lse": lse_ref.detach()}
        refs.update({n: t.grad for n, t in zip(("dq", "dk", "dv"), ref_in)})
        for system in SYSTEMS:
            if system == cpb.CPBaseline.ULYSSES and (hq % world_size or hkv % world_size):
                continue
            plan = cpb.plan_baseline(
                system, qr, kr, tm, total, world_size, rank, num_heads_q=hq, num_heads_kv=hkv
            )
            idx = plan.token_index()
            local = [cpb.shard_tokens(t, plan).requires_grad_() for t in (q, k, v)]
            out, lse = cpb.baseline_attn(*local, plan)
            (out * cpb.shard_tokens(do, plan)).sum().backward()
            got = {
                "out": out.detach(),
                "lse": lse,
                "dq": local[0].grad,
                "dk": local[1].grad,
                "dv": local[2].grad,
            }
            for name, g in got.items():
                errors[f"{system.value}/{mname}/{name}"] = _rel(name, g, refs[name][idx])
    return errors


@pytest.mark.parametrize(
    "world_size, total, hq, hkv",
    [
        pytest.param(2, 40, 4, 2, id="cp2-gqa2"),
        pytest.param(3, 42, 6, 3, id="cp3-gqa2"),
        pytest.param(4, 48, 8, 4, id="cp4-gqa2"),
    ],
)
def test_baselines_match_dense_fp64(world_size: int, total: int, hq: int, hkv: int) -> None:
    results = run_distributed(_check_rank, world_size, total, hq, hkv, 10 + world_size, timeout=120.0)
    checked = 0
    for rank, errors in enumerate(results):
        assert len(errors) == len(SYSTEMS) * NUM_MASKS * 5, f"rank {rank}: only {len(errors)} checks ran"
        bad = {k: v for k, v in errors.items() if not v <= RTOL}
        assert not bad, f"rank {rank} of {world_size}: relative errors above {RTOL}: {bad}"
        checked += len(errors)
    assert checked == world_size * len(SYSTEMS) * NUM_MASKS * 5


def test_ulysses_needs_heads_divisible_by_cp() -> None:
    with pytest.raises(ValueError, match=r"num_heads_kv.*divisible by `cp_size` \(3\)"):
        cpb.plan_baseline("ulysses", [[0, 48]], [[0, 48]], 1, 48, 3, 0, num_heads_q=8, num_heads_kv=2)
    plan = cpb.plan_baseline("ring_zigzag", [[0, 48]], [[0, 48]], 1, 48, 3, 0, num_heads_q=8, num_heads_kv=2)
    assert plan.token_ranges == ((0, 8), (40, 48))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"total_seqlen": 50}, "multiple of 8", id="total-not-multiple"),
        pytest.param({"system": "ring"}, "`system` must be one of", id="bad-system"),
        pytest.param({"rank": 4}, "`rank` must be an int in", id="bad-rank"),
        pytest.param({"num_heads_q": 6}, "multiple of `num_heads_kv`", id="gqa"),
        pytest.param({"cp_size": 0}, "`cp_size` must be a positive int", id="cp0"),
        pytest.param({"k_ranges": [[0, 48], [0, 8]]}, "`k_ranges` has 2", id="lengths"),
        pytest.param({"q_ranges": [[0, 60]]}, "outside the sequence", id="out-of-bounds"),
    ],
)
def test_plan_rejects_bad_input(kwargs: dict, match: str) -> None:
    args = {
        "system": "ring_zigzag",
        "q_ranges": [[0, 48]],
        "k_ranges": [[0, 48]],
        "attn_type_map": [1],
        "total_seqlen": 48,
        "cp_size": 4,
        "rank": 0,
        "num_heads_q": 8,
        "num_heads_kv": 4,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        cpb.plan_baseline(**args)


def _dense(sl, nq: int, nk: int) -> np.ndarray:
    return sl.to_dense(nq, nk) if len(sl) else np.zeros((nq, nk), dtype=np.int64)


@pytest.mark.parametrize("seed", range(40))
def test_clip_slices_equals_dense_submask(seed: int) -> None:
    """Random masks (all four types) clipped to random runs of rows and keys placed in a local buffer."""
    rng = random.Random(seed)
    total = rng.randint(8, 40)
    qr, kr, tm = random_slices(total, total, seed=seed, max_bands=4)
    keep = [i for i in range(qr.shape[0]) if qr[i, 0] < qr[i, 1] and kr[i, 0] < kr[i, 1]]
    slices = [(*qr[i].tolist(), *kr[i].tolist(), int(tm[i])) for i in keep]
    dense = make_attn_mask(qr, kr, tm, total, total).numpy()

    def pieces():
        cuts = sorted({0, total, *(rng.randrange(total) for _ in range(3))})
        runs = [(a, b) for a, b in itertools.pairwise(cuts) if rng.random() < 0.7]
        rng.shuffle(runs)
        out, loc = [], 0
        for a, b in runs:
            out.append((a, b, loc))
            loc += b - a
        return out, loc

    (qp, nq), (kp, nk) = pieces(), pieces()
    got = _dense(cpb.clip_slices(slices, qp, kp), nq, nk)
    qi = [g for a, b, _ in qp for g in range(a, b)]
    ki = [g for a, b, _ in kp for g in range(a, b)]
    want = dense[np.ix_(qi, ki)].astype(np.int64) if qi and ki else np.zeros((nq, nk), dtype=np.int64)
    assert np.array_equal(got, want), f"seed {seed}: clipped slices differ from the dense sub-mask"


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("mask", ["causal", "varlen_causal", "random_a", "shared_pairs"])
def test_plans_cover_the_mask_once(system, mask: str) -> None:
    """Over all ranks (and, for Ulysses, on each rank) the planned areas add up to the mask's area (the
    union's, when slices share pairs)."""
    total, cp = 48, 4
    qr, kr, tm = _masks(total, 3)[mask]
    area = int(make_attn_mask(qr, kr, tm, total, total).sum())
    plans = [
        cpb.plan_baseline(system, qr, kr, tm, total, cp, r, num_heads_q=8, num_heads_kv=4) for r in range(cp)
    ]
    if system == cpb.CPBaseline.ULYSSES:
        assert all(p.area == area for p in plans)
    else:
        assert sum(p.area for p in plans) == area
    assert sorted(t for p in plans for r in p.token_ranges for t in range(*r)) == list(range(total))


def _bench_rank(rank: int, world_size: int, argv: list[str]) -> list[dict]:
    return _load("cp_bench").run(*_load("cp_bench").parse_args(argv))


@pytest.mark.parametrize(
    "world_size, heads, masks",
    [
        pytest.param(2, "4:2", "varlen_causal", id="cp2"),
        pytest.param(3, "4:2", "full,causal,varlen_full,varlen_causal", id="cp3-ulysses-skipped"),
    ],
)
def test_cp_bench_smoke_on_gloo(tmp_path: Path, world_size: int, heads: str, masks: str) -> None:
    """benchmarks/cp_bench.py end to end on CPU ranks (fp64, toy sizes): every system runs, agrees with magi,
    and the JSON / markdown files appear; Ulysses is reported as skipped where the heads do not divide."""
    out = tmp_path / "cp"
    argv = [
        "--device",
        "cpu",
        "--tokens-per-gpu",
        "48",
        "--heads",
        heads,
        "--head-dim",
        "8",
        "--dtype",
        "fp64",
    ]
    argv += ["--chunk-size", "8", "--min-chunk-size", "4", "--warmup", "0", "--iters", "1", "--masks", masks]
    rows = run_distributed(_bench_rank, world_size, [*argv, "--out", str(out)], timeout=120.0)[0]
    assert len(rows) == 4 * len(masks.split(","))
    for r in rows:
        if r["system"] == "ulysses" and world_size == 3:
            assert "divisible by `cp_size` (3)" in r["skipped"], r
            continue
        assert r["rel_out"] < 1e-12 and r["rel_dq"] < 1e-12, r
        assert r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0, r
    meta = json.loads((tmp_path / "cp.json").read_text())["meta"]
    assert meta["world_size"] == world_size and meta["backend"] == "gloo"
    table = (tmp_path / "cp.md").read_text()
    assert table.count("\n| 48 |") == len(rows)


def _triton_rank(rank: int, world_size: int, masks: list[str]) -> dict:
    """fp32 on the Triton kernels (interpreter): the GPU code path, with its strided head views."""
    os.environ["MAGI_FFA_POISON"] = "1"
    total, hq, hkv, d = 32, 4, 2, 16
    errors: dict[str, float] = {}
    for mname in masks:
        qr, kr, tm = _masks(total, 5)[mname]
        q, k, v = random_qkv(total, total, hq, hkv, d, torch.float64, seed=1)
        do = torch.randn(total, hq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        out_ref, lse_ref = ref_attn(*ref_in, make_attn_mask(qr, kr, tm, total, total))
        (out_ref * do).sum().backward()
        refs = {"out": out_ref.detach(), "lse": lse_ref.detach()}
        refs.update({n: t.grad for n, t in zip(("dq", "dk", "dv"), ref_in)})
        for system in SYSTEMS:
            plan = cpb.plan_baseline(
                system, qr, kr, tm, total, world_size, rank, num_heads_q=hq, num_heads_kv=hkv
            )
            local = [cpb.shard_tokens(t.float(), plan).requires_grad_() for t in (q, k, v)]
            out, lse = cpb.baseline_attn(*local, plan)
            (out * cpb.shard_tokens(do.float(), plan)).sum().backward()
            got = {"out": out, "lse": lse, "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
            for name, g in got.items():
                errors[f"{system.value}/{mname}/{name}"] = _rel(
                    name, g.detach().double(), refs[name][plan.token_index()]
                )
    return errors


def test_baselines_on_triton_kernels_fp32() -> None:
    """The Triton backend (interpreter on CPU) in a fresh process: TRITON_INTERPRET must be set before
    Triton compiles anything, which this pytest process may already have done without it."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_cp_baselines as t; "
        "from magi_attention.testing import run_distributed; "
        "r = run_distributed(t._triton_rank, 2, ['random_a', 'shared_pairs'], timeout=300.0); "
        "print(max(max(x.values()) for x in r), sum(len(x) for x in r))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "MAGI_FFA_BACKEND": "triton", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "tests")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    worst, count = res.stdout.split()[-2:]
    assert int(count) == 2 * len(SYSTEMS) * 2 * 5
    assert float(worst) < 2e-5, f"fp32 Triton baselines: worst relative error {worst} vs dense fp64"
