"""CPU (gloo, fp64) checks of the context-parallel baselines library (benchmarks/baselines/: same_kernel.py
and user.py), and of benchmarks/cp_bench.py end to end.

Every baseline (Ulysses, zigzag ring, all-gather K/V) must give the dense fp64 reference's out, lse, dq, dk
and dv to 1e-9 relative on full, causal, varlen causal, varlen full and random slice masks (all four types,
empty slices, rows with no key), at world sizes 2, 3 and 4; one launch of the ranks per world size runs
every (mask, baseline) pair. Receive buffers are NaN-poisoned (MAGI_FFA_POISON=1) so unwritten rows show.
"""

from __future__ import annotations

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

import benchmarks.baselines.same_kernel as cpb
import benchmarks.baselines.user as user_baselines
from benchmarks import cp_bench
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, random_banded_slices, random_qkv, ref_attn, varlen_slices

ROOT = Path(__file__).resolve().parents[1]


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
        "random_a": random_banded_slices(total, total, seed=seed, max_bands=4),
        "random_b": random_banded_slices(total, total, seed=seed + 1, max_bands=5, density=0.5),
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
    qr, kr, tm = random_banded_slices(total, total, seed=seed, max_bands=4)
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
    return cp_bench.run(*cp_bench.parse_args(argv))


# systems that may report "skipped" on a CPU run over gloo (no GPU, no FlashAttention-4, no NCCL)
CPU_SKIPPABLE = {"ulysses_fa4", "ulysses_cudnn", "torch_cp", "ulysses_ffa_fa4", "ulysses_ffa_cudnn"}


@pytest.mark.parametrize(
    "world_size, heads, masks",
    [
        pytest.param(2, "4:2", "varlen_causal", id="cp2"),
        pytest.param(3, "4:2", "full,causal,varlen_full,varlen_causal", id="cp3-ulysses-skipped"),
    ],
)
def test_cp_bench_smoke_on_gloo(tmp_path: Path, world_size: int, heads: str, masks: str) -> None:
    """benchmarks/cp_bench.py end to end on CPU ranks (fp64, toy sizes), every system: the same-kernel ones run
    and agree with magi, the user baselines run or skip with a reason, and the JSON / markdown files appear;
    Ulysses is reported as skipped where the heads do not divide."""
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
    assert len(rows) == len(cp_bench.System) * len(masks.split(","))
    for r in rows:
        if r["system"] == "ulysses" and world_size == 3:
            assert "divisible by `cp_size` (3)" in r["skipped"], r
            continue
        if "skipped" in r:
            assert r["system"] in CPU_SKIPPABLE, r
            head, _, detail = r["skipped"].partition(":")
            assert head and detail.strip(), f"a skip names its reason: {r}"
            if world_size == 3 and r["system"].startswith("ulysses") and r["mask"] in ("full", "causal"):
                assert "divisible by cp (3)" in r["skipped"] or "not importable" in r["skipped"], r
            continue
        assert r["kernel"], r
        assert r["rel_out"] < 1e-12 and r["rel_dq"] < 1e-12, r
        assert r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0, r
        assert r["fwd_iqr_ms"][0] <= r["fwd_ms"] <= r["fwd_iqr_ms"][1], r
        assert r["peak_mem_gib"] is None, r  # CPU: n/a
    ran = {r["system"] for r in rows if "skipped" not in r}
    assert {"magi", "ring_zigzag", "allgather_kv"} <= ran
    torch_cp = [r for r in rows if r["system"] == "torch_cp"]
    assert all("skipped" in r for r in torch_cp)
    assert any("needs CUDA + NCCL" in r["skipped"] for r in torch_cp) == any(
        m in ("full", "causal") for m in masks.split(",")
    )
    meta = json.loads((tmp_path / "cp.json").read_text())["meta"]
    assert meta["world_size"] == world_size and meta["backend"] == "gloo"
    table = (tmp_path / "cp.md").read_text()
    assert table.count("\n| 48 |") == len(rows)


# -- the user baselines on CPU, with stand-ins for the CUDA-only kernels --------------------------------------
def _dense_attn(q, k, v, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention ``[t, hq, d]`` under a dense bool mask ``[t, t]`` (GQA by repeating K/V heads)."""
    g = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(g, dim=1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v), lse.t()


def _fake_fa4_func(q, k, v, *, causal: bool):
    """flash_attn.cute.flash_attn_func stand-in: ``[b, s, h, d]``, returns out only."""
    assert q.ndim == 4 and q.shape[0] == 1, q.shape
    t = q.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool)
    allowed = allowed.tril() if causal else allowed
    return _dense_attn(q[0], k[0], v[0], allowed)[0][None]


def _fake_fa4_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal: bool):
    """flash_attn.cute.flash_attn_varlen_func stand-in: ``[total, h, d]``, returns (out, lse)."""
    assert cu_seqlens_q.dtype == torch.int32 and torch.equal(cu_seqlens_q, cu_seqlens_k)
    lengths = torch.diff(cu_seqlens_q.long())
    assert max_seqlen_q == max_seqlen_k == int(lengths.max()) and int(cu_seqlens_q[-1]) == q.shape[0]
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    pos = torch.arange(q.shape[0])
    allowed = doc[:, None] == doc[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    return _dense_attn(q, k, v, allowed)


def _fake_ffa_fa4(q, k, v, q_ranges, k_ranges, attn_type_map):
    """magi_ffa_fa4.flex_flash_attn_func stand-in: int32 ranges, dense mask of the slices."""
    assert q_ranges.dtype == k_ranges.dtype == attn_type_map.dtype == torch.int32
    allowed = make_attn_mask(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0]).bool()
    return _dense_attn(q, k, v, allowed)


def _install_stand_ins() -> None:
    """In a rank process only: FA4 and magi_ffa_fa4 stand-ins that run on CPU tensors, under their own module
    names (magi_attention's kernel probe still sees the real packages)."""
    import types

    cute = types.ModuleType("cp_test_fa4_stand_in")
    cute.flash_attn_func, cute.flash_attn_varlen_func = _fake_fa4_func, _fake_fa4_varlen
    ffa4 = types.ModuleType("cp_test_ffa_fa4_stand_in")
    ffa4.fa4_available, ffa4.flex_flash_attn_func = (lambda: True), _fake_ffa_fa4
    ffa_cudnn = types.ModuleType("cp_test_ffa_cudnn_stand_in")  # the same FFA contract
    ffa_cudnn.cudnn_available, ffa_cudnn.flex_flash_attn_func = (lambda: True), _fake_ffa_fa4
    sys.modules.update({m.__name__: m for m in (cute, ffa4, ffa_cudnn)})
    user_baselines.KERNEL_MODULES.update(
        fa4=cute.__name__, ffa_fa4=ffa4.__name__, ffa_cudnn=ffa_cudnn.__name__
    )


def _ulysses_routing(rank: int, world_size: int) -> bool:
    """seq_to_heads / heads_to_seq by value: each element encodes its global token and head."""
    ub = user_baselines
    t, h, d = 5, 2 * world_size, 3
    tok = torch.arange(rank * t, (rank + 1) * t, dtype=torch.float64)
    x = (tok[:, None, None] * 100 + torch.arange(h, dtype=torch.float64)[None, :, None]).expand(t, h, d)
    xh = ub.seq_to_heads(x.contiguous())
    every = torch.arange(world_size * t, dtype=torch.float64)
    mine = torch.arange(rank * (h // world_size), (rank + 1) * (h // world_size), dtype=torch.float64)
    want = (every[:, None, None] * 100 + mine[None, :, None]).expand_as(xh)
    return torch.equal(xh, want) and torch.equal(ub.heads_to_seq(xh), x)


def _user_bench_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    _install_stand_ins()
    routing = _ulysses_routing(rank, world_size)
    return {"routing": routing, "rows": cp_bench.run(*cp_bench.parse_args(argv))}


def test_cp_bench_user_baselines_with_stand_in_kernels(tmp_path: Path) -> None:
    """cp 2 on gloo, every mask, magi at degrees 0, 1 and dynamic and the four user baselines, FA4 and
    magi_ffa_fa4 replaced by dense CPU stand-ins with the same call signatures: each baseline runs exactly on
    the masks its kernel expresses (and matches magi to fp64 rounding), skips the others with a reason;
    torch_cp skips (CUDA + NCCL only); one magi row per degree; one profile per mask."""
    masks = "full,causal,varlen_full,varlen_causal,varlen_block_causal"
    argv = [
        "--device",
        "cpu",
        "--tokens-per-gpu",
        "48",
        "--heads",
        "4:2",
        "--head-dim",
        "8",
        "--dtype",
        "fp64",
    ]
    argv += ["--chunk-size", "8", "--min-chunk-size", "4", "--warmup", "0", "--iters", "2", "--masks", masks]
    argv += [
        "--systems",
        "magi,ulysses_fa4,ulysses_cudnn,torch_cp,ulysses_ffa_fa4,ulysses_ffa_cudnn",
        "--degrees",
        "0,1,dynamic",
    ]
    argv += ["--block-size", "8", "--profile", str(tmp_path / "prof"), "--out", str(tmp_path / "cp")]
    results = run_distributed(_user_bench_rank, 2, argv, timeout=120.0)
    assert all(r["routing"] for r in results), "Ulysses all-to-all routed an element to the wrong place"
    rows = results[0]["rows"]
    runs = {
        "ulysses_fa4": {"full", "causal", "varlen_full", "varlen_causal"},
        "ulysses_cudnn": {"full", "causal"},
        "torch_cp": set(),
        "ulysses_ffa_fa4": set(masks.split(",")),
        "ulysses_ffa_cudnn": set(masks.split(",")),
    }
    kernels = {
        "ulysses_fa4": "FA4 flash_attn",
        "ulysses_cudnn": "SDPA math",
        "ulysses_ffa_fa4": "magi_ffa_fa4",
        "ulysses_ffa_cudnn": "magi_ffa_cudnn",
    }
    assert len(rows) == 5 * (3 + 5)
    for mask in masks.split(","):
        magi = [r for r in rows if r["mask"] == mask and r["system"] == "magi"]
        assert [r["degree"] for r in magi] == [0, 1, "dynamic"], magi
        assert [r["degree_used"] for r in magi[:2]] == [0, 1], magi
        assert isinstance(magi[2]["degree_used"], int) and magi[2]["degree_used"] >= 0, magi[2]
        for r in magi:
            assert r["rel_out"] < 1e-12 and r["rel_dq"] < 1e-12, r
            assert r["fwd_speedup"] > 0 and r["bwd_best_baseline"] in runs, r
        for system, ok in runs.items():
            (r,) = [r for r in rows if r["mask"] == mask and r["system"] == system]
            if mask in ok:
                assert "skipped" not in r, r
                assert kernels[system] in r["kernel"], r
                assert r["rel_out"] < 1e-12 and r["rel_dq"] < 1e-12, r
            elif system == "torch_cp" and mask in ("full", "causal"):
                assert r["skipped"].startswith("needs CUDA + NCCL"), r
            else:
                assert r["skipped"].startswith("mask not expressible"), r
        profile = (tmp_path / "prof" / f"profile_{mask}.txt").read_text()
        assert "DistAttnFunc" in profile, profile[:500]
    table = (tmp_path / "cp.md").read_text()
    assert table.count("| magi (auto) | dynamic (") == 5 and "skipped: needs CUDA + NCCL" in table


def _torch_cp_shard_rank(rank: int, world_size: int) -> dict:
    """enter_torch_cp on gloo: which tokens each rank holds, and what it leaves behind."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental._attention import _cp_options

    ub = user_baselines
    mesh = ub._mesh("cpu", world_size)
    total, sdpa, lb = 16, F.scaled_dot_product_attention, _cp_options.enable_load_balance
    out = {}
    for causal in (True, False):
        x = torch.arange(2 * total * 3, dtype=torch.float64).reshape(1, 2, total, 3)
        x4, pos = x.clone(), torch.arange(total)
        stack = ub.enter_torch_cp(mesh, [x4, pos], [2, 0], causal)
        patched = F.scaled_dot_product_attention is not sdpa
        own_storage = x4.untyped_storage().nbytes() == x4.numel() * x4.element_size()
        out[causal] = (pos.tolist(), torch.equal(x4, x[:, :, pos]), patched, own_storage)
        stack.close()
    out["restored"] = F.scaled_dot_product_attention is sdpa and _cp_options.enable_load_balance == lb
    return out


def test_torch_cp_sharding_on_gloo() -> None:
    """torch_cp's setup (context_parallel's buffer sharding) on CPU: head-tail chunks for causal, contiguous
    shards for full, the token positions match the sharded data, SDPA is patched only while it is entered."""
    results = run_distributed(_torch_cp_shard_rank, 2, timeout=60.0)
    chunks = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    assert results[0][True][0] == chunks[0] + chunks[3] and results[1][True][0] == chunks[1] + chunks[2]
    assert results[0][False][0] == list(range(8)) and results[1][False][0] == list(range(8, 16))
    for r in results:
        assert all(r[c][1:] == (True, True, True) for c in (True, False)), r
        assert r["restored"], r


def test_varlen_block_causal_mask_equals_dense_reference() -> None:
    """The varlen_block_causal slices against a dense mask built from the document and block of each token."""
    cpbench = cp_bench
    checked = 0
    for total, seed, block in [(96, 0, 8), (96, 3, 5), (200, 1, 7), (64, 2, 1), (64, 2, 4096), (333, 4, 16)]:
        docs = cpbench.varlen_docs(total, seed)
        qr, kr, tm = cpbench.make_mask("varlen_block_causal", total, seed, block)
        assert set(tm) == {0}
        doc_of = torch.empty(total, dtype=torch.long)
        start_of = torch.empty(total, dtype=torch.long)
        for i, (a, b) in enumerate(docs):
            doc_of[a:b], start_of[a:b] = i, a
        pos = torch.arange(total)
        blk = (pos - start_of) // block
        want = (doc_of[:, None] == doc_of[None, :]) & (blk[None, :] <= blk[:, None])
        got = make_attn_mask(qr, kr, tm, total, total).bool()
        assert torch.equal(got, want), f"total {total} seed {seed} block {block}"
        assert cpbench.mask_area(qr, kr, tm) == int(want.sum())
        # the q blocks tile the sequence once, each within one document and at most `block` long
        assert [t for a, b in qr for t in range(a, b)] == list(range(total))
        assert all(b - a <= block and doc_of[a] == doc_of[b - 1] for a, b in qr)
        checked += 1
    # with a document longer than a block, FA4 varlen and SDPA cannot express it (the user baselines skip)
    qr, kr, tm = cpbench.make_mask("varlen_block_causal", 96, 0, 8)
    assert any(q != k for q, k in zip(qr, kr))
    mask = user_baselines.Mask.of(qr, kr, tm, 96)
    assert mask.varlen() is None and mask.dense_causal() is None
    assert checked == 6


def test_user_mask_recognition() -> None:
    """Which masks the user baselines' kernels take: dense full / causal, packed documents (cu_seqlens)."""
    Mask = user_baselines.Mask
    assert Mask.of([[0, 8]], [[0, 8]], [1], 8).dense_causal() is True
    assert Mask.of([[0, 8]], [[0, 8]], [0], 8).dense_causal() is False
    assert Mask.of([[0, 8]], [[0, 8]], [2], 8).dense_causal() is None
    assert Mask.of([[0, 3], [3, 8]], [[0, 3], [3, 8]], [1, 1], 8).varlen() == ([0, 3, 8], True)
    assert Mask.of([[0, 8]], [[0, 8]], [0], 8).varlen() == ([0, 8], False)
    assert Mask.of([[0, 3], [3, 8]], [[0, 3], [3, 8]], [0, 1], 8).varlen() is None  # mixed types
    assert Mask.of([[0, 3], [4, 8]], [[0, 3], [4, 8]], [0, 0], 8).varlen() is None  # a gap
    assert Mask.of([[0, 3], [3, 8]], [[0, 3], [0, 8]], [0, 0], 8).varlen() is None  # not diagonal
    assert Mask.of([[0, 3], [3, 6]], [[0, 3], [3, 6]], [0, 0], 8).varlen() is None  # does not reach the end


@pytest.mark.parametrize(
    "args, degrees",
    [
        pytest.param([], ("dynamic",), id="default"),
        pytest.param(["--degree", "2"], (2,), id="degree-alias"),
        pytest.param(["--degrees", "0,1,dynamic"], (0, 1, "dynamic"), id="list"),
        pytest.param(["--degrees", "Dynamic,3"], ("dynamic", 3), id="case"),
    ],
)
def test_degrees_argument(args: list[str], degrees: tuple) -> None:
    cpbench = cp_bench
    cfg, _ = cpbench.parse_args(args)
    assert cfg.degrees == degrees
    for d in degrees:
        overlap = cpbench._dist_attn_config(cfg, d, "auto").overlap_config
        assert overlap.degree == (None if d == "dynamic" else d)
        assert overlap.min_chunk_size == cfg.min_chunk_size


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--degrees", "1", "--degree", "2"], id="both"),
        pytest.param(["--degrees", "-1"], id="negative"),
        pytest.param(["--degrees", "two"], id="word"),
        pytest.param(["--kernel-backend", "cuda"], id="backend"),
        pytest.param(["--kernel-backend", "auto,cuda"], id="backend-list"),
        pytest.param(["--block-size", "0"], id="block"),
    ],
)
def test_bad_arguments_exit(args: list[str]) -> None:
    with pytest.raises(SystemExit):
        cp_bench.parse_args(args)


def test_kernel_backend_reaches_dist_attn_config() -> None:
    cpbench = cp_bench
    for backend in cpbench.KERNEL_BACKENDS:
        cfg, _ = cpbench.parse_args(["--kernel-backend", backend, "--grad-reduce", "bf16"])
        assert cfg.kernel_backends == (backend,)
        config = cpbench._dist_attn_config(cfg, "dynamic", backend)
        assert str(config.kernel_backend) == backend
        assert config.high_precision_grad_reduce is False
    cfg, _ = cpbench.parse_args(["--kernel-backend", "auto, fa4,cudnn"])
    assert cfg.kernel_backends == ("auto", "fa4", "cudnn")


def test_cp_bench_times_each_kernel_backend_on_the_same_inputs(tmp_path: Path) -> None:
    """One magi row per (kernel backend, degree), in the order asked, each cross-checked against the first:
    on CPU fp64 `auto` resolves to the torch path, so both backends compute the same attention."""
    argv = ["--device", "cpu", "--tokens-per-gpu", "48", "--heads", "4:2", "--head-dim", "8", "--dtype", "fp64",
            "--chunk-size", "8", "--min-chunk-size", "4", "--warmup", "0", "--iters", "1", "--masks",
            "varlen_causal", "--systems", "magi", "--kernel-backend", "torch,auto", "--degrees", "0,1",
            "--out", str(tmp_path / "cp")]  # fmt: skip
    rows = run_distributed(_bench_rank, 2, argv, timeout=120.0)[0]
    assert [(r["kernel_backend"], r["degree"]) for r in rows] == [
        ("torch", 0),
        ("torch", 1),
        ("auto", 0),
        ("auto", 1),
    ]
    assert all(r["kernel"] == cp_bench.MAGI_KERNELS["torch"] for r in rows), rows
    assert all(r["rel_out"] < 1e-12 and r["rel_dq"] < 1e-12 for r in rows), rows
    table = (tmp_path / "cp.md").read_text()
    assert "| magi (torch) | 0 |" in table and "| magi (auto) | 1 |" in table


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
        "import test_cp_baselines as t; "
        "from magi_attention.testing import run_distributed; "
        "r = run_distributed(t._triton_rank, 2, ['random_a', 'shared_pairs'], timeout=300.0); "
        "print(max(max(x.values()) for x in r), sum(len(x) for x in r))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "MAGI_FFA_BACKEND": "triton", "OMP_NUM_THREADS": "1"}
    # the fresh process imports this module (from tests/) and the benchmarks package (from the repository root,
    # as pytest.ini's pythonpath gives this one)
    paths = [str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    res = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    worst, count = res.stdout.split()[-2:]
    assert int(count) == 2 * len(SYSTEMS) * 2 * 5
    assert float(worst) < 2e-5, f"fp32 Triton baselines: worst relative error {worst} vs dense fp64"
