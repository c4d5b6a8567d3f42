"""Deterministic mode on a GPU: four forward + backward runs on the same inputs give the same bits.

Through `calc_attn` at cp 1 with kernel_backend auto, fa4, cudnn and triton, and on every rank of a
simulated cp 8 run (the plan's kernel calls of each rank, as `magi_attention.simulate` runs them, each with
`deterministic=True`): out, lse, dq, dk, dv bitwise equal across the four runs. Masks: random overlapping
slices of all four types, packed causal documents, a causal sliding window; GQA 8:2; d 128 on every mask,
64 and 256 on the packed documents where the backend takes them. Where FA4 cannot run the backward
deterministically (its block-sparse path), and for cuDNN at d 256 (its deterministic backward compiles up to
d 128), the test asserts the refusal and its message instead, and that `auto` picked another backend. A backend that is not installed is skipped (its reason printed).

    python -m pytest -m gpu packages/magi_attention/tests/test_deterministic_gpu.py -q
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from magi_attention import DistAttnConfig
from magi_attention._runtime.kernels import (
    attn_kernel,
    choose_auto,
    probe_local,
    resolve,
    restrict_deterministic,
)
from magi_attention.api import calc_attn, clear_cache, get_kernel_backend, magi_attn_flex_key
from magi_attention.config import KernelBackend as B
from magi_attention.simulate import rank_calls, token_index
from magi_ffa.validation import check_slices
from magi_solver import PlanOptions, plan_attention
from magi_solver.kernel_choice import busiest_rank_features, kernel_key_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:Argument aux_data"),  # FA4's varlen forward (see test_fa4_gpu.py)
]

HQ, HKV = 8, 2
RUNS = 4
BACKENDS = ("auto", "fa4", "cudnn", "triton")


def _overlapping_slices(total: int, seed: int, n: int = 12):
    rng = random.Random(seed)
    q, k, t = [], [], []
    for i in range(n):
        qs, ks = rng.randrange(0, total - 256), rng.randrange(0, total - 256)
        q.append([qs, rng.randrange(qs + 128, total + 1)])
        k.append([ks, rng.randrange(ks + 128, total + 1)])
        t.append(i % 4)  # all four types
    return q, k, t


def _docs(total: int, seed: int):
    rng, cuts = random.Random(seed), [0]
    while cuts[-1] < total:
        cuts.append(min(total, cuts[-1] + rng.randrange(total // 10, total // 3)))
    d = [[a, b] for a, b in itertools.pairwise(cuts)]
    return d, [list(x) for x in d], [1] * len(d)


def _mask(name: str, total: int):
    if name == "random":
        return _overlapping_slices(total, 7)
    if name == "docs":
        return _docs(total, 3)
    if name == "swa":  # a causal window of 512 keys per row: a causal head and a bi-causal band
        w = 512
        return [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
    raise ValueError(name)


CASES = [(m, 128) for m in ("random", "docs", "swa")] + [("docs", 64), ("docs", 256)]


def _inputs(total: int, d: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = [torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV)]
    do = torch.randn(total, HQ, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return x, do


def _assert_bitwise(runs: list[tuple[torch.Tensor, ...]], what: str) -> None:
    names = ("out", "lse", "dq", "dk", "dv")
    for i, again in enumerate(runs[1:], start=1):
        for name, a, b in zip(names, runs[0], again, strict=True):
            assert not torch.isnan(a).any(), f"{what}: {name} has NaN"
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().max().item()
                raise AssertionError(f"{what}: {name} of run {i} differs from run 0 (max |d| {diff:.3e})")


def fa4_deterministic_supported(q_ranges, k_ranges, types, total_q: int, total_k: int) -> bool:
    """Whether FA4 runs these slices' backward deterministically (its varlen path); False without FA4."""
    try:
        import magi_ffa_fa4
    except ImportError:
        return False
    return bool(magi_ffa_fa4.deterministic_supported(q_ranges, k_ranges, types, total_q, total_k))


def _unavailable(exc: ValueError) -> bool:
    """The backend cannot run here at all (not installed, no such GPU, head_dim out of its range)."""
    text = str(exc)
    return "cannot run on every rank" in text or "needs head_dim" in text


def _check_refusal(exc: ValueError, backend: str) -> None:
    text = str(exc)
    assert f"kernel_backend='{backend}'" in text and "deterministic" in text, text
    assert "block-sparse" in text and ("'cudnn'" in text or "'triton'" in text), text


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("mask", "d"), CASES, ids=[f"{m}-d{d}" for m, d in CASES])
def test_calc_attn_cp1_is_bitwise_repeatable(mask: str, d: int, backend: str) -> None:
    total = 4096
    q_ranges, k_ranges, types = _mask(mask, total)
    clear_cache()
    config = DistAttnConfig(kernel_backend=backend, deterministic=True)
    try:
        key = magi_attn_flex_key(q_ranges, k_ranges, types, total, total, HQ, HKV, d, None, config)
    except ValueError as exc:
        if _unavailable(exc):
            pytest.skip(f"{backend} at d {d}: {exc}")
        if backend == "fa4" and not fa4_deterministic_supported(q_ranges, k_ranges, types, total, total):
            _check_refusal(exc, "fa4")
            return
        if backend == "cudnn" and d > 128:  # cuDNN's deterministic backward compiles up to d 128
            assert "kernel_backend='cudnn' has no deterministic backward at head_dim" in str(exc), exc
            assert "'triton'" in str(exc), exc
            return
        raise
    if backend == "fa4":  # accepted: FA4 takes its deterministic (varlen) path on this mask
        assert fa4_deterministic_supported(q_ranges, k_ranges, types, total, total)
    chosen, reason = get_kernel_backend(key, torch.bfloat16)
    if not fa4_deterministic_supported(q_ranges, k_ranges, types, total, total):
        assert chosen != B.FA4, f"auto chose FA4 where its backward is not deterministic: {reason}"
    (q0, k0, v0), do = _inputs(total, d)
    runs = []
    for _ in range(RUNS):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, meta = calc_attn(q, k, v, key)
        out.backward(do)
        runs.append((out.detach(), meta.lse.detach(), q.grad, k.grad, v.grad))
    torch.cuda.synchronize()
    _assert_bitwise(runs, f"calc_attn cp 1 {mask} d {d} {backend} ({chosen})")


def _sim_backend(backend: str, d: int, plan, q_ranges, k_ranges, types, total: int):
    """The backend the runtime would use for this simulated plan in deterministic mode (the same steps as
    `_runtime.key_route.build_key`, with this process standing for every rank); raises as it would."""
    agreed = resolve(backend, d, [probe_local(backend)], deterministic=True)
    checked, ok = [], []
    for rank_plan in plan.ranks:
        kv = plan.kv_layout
        calls = [(rank_plan.host_slices, rank_plan.host_token_ranges)] + [
            (s.remote_slices, s.remote_k_ranges) for s in rank_plan.stages
        ]
        rows = rank_plan.host_token_ranges.total_seqlen
        mine = []
        for i, (slices, kr) in enumerate(calls):
            n_k = (kv.host_token_ranges(rank_plan.rank) if kv and i == 0 else kr).total_seqlen
            mine.append(check_slices(slices.q_ranges, slices.k_ranges, slices.types, rows, n_k))
        checked.append(mine)
        ok.append(
            all(fa4_deterministic_supported(c.q_ranges, c.k_ranges, c.types, rows, c.total_k) for c in mine)
        )
    rows = [np.asarray(plan.dispatch.position_ids(r)) for r in range(plan.cp_size)]
    keys = kernel_key_ids(rows, plan.kv_layout)

    def features():
        return busiest_rank_features(q_ranges, k_ranges, types, rows, rank_keys=keys)

    choice = choose_auto(agreed, d, features, deterministic=True)
    restricted = restrict_deterministic(choice, checked, (q_ranges, k_ranges, types), d)
    if (restricted.backend, restricted.backward) != (choice.backend, choice.backward):
        restricted = choose_auto(restricted, d, features, deterministic=True)
    return restricted, ok


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask", ["random", "docs", "swa"])
def test_simulated_cp8_every_rank_is_bitwise_repeatable(mask: str, backend: str) -> None:
    cp, d, per_rank = 8, 128, 1024
    total = cp * per_rank
    q_ranges, k_ranges, types = _mask(mask, total)
    plan = plan_attention(
        q_ranges,
        k_ranges,
        types,
        total,
        cp,
        chunk_size=256,
        options=PlanOptions(overlap_degree=2, min_chunk_size=256),
    )
    try:
        choice, ok = _sim_backend(backend, d, plan, q_ranges, k_ranges, types, total)
    except ValueError as exc:
        if _unavailable(exc):
            pytest.skip(f"{backend}: {exc}")
        assert backend == "fa4", exc
        _check_refusal(exc, "fa4")
        return
    fwd_b = choice.backend_for(torch.bfloat16, d)
    bwd_b = choice.backward_for(torch.bfloat16, d)
    if not all(ok):
        assert B.FA4 not in (fwd_b, bwd_b), choice.reason
    kernel = attn_kernel(fwd_b, bwd_b)
    (q, k, v), do = _inputs(total, d, seed=1)
    for rank_plan in plan.ranks:
        rc = rank_calls(rank_plan, k, v, merged=plan.overlap_degree == 0)  # the calls the runtime makes
        q_index = token_index(rank_plan.host_token_ranges, q.device)
        lq, ldo = q[q_index], do[q_index]
        runs = []
        for _ in range(RUNS):
            out = torch.zeros(lq.shape, dtype=torch.float32, device="cuda")
            lse = torch.full(lq.shape[:2], float("-inf"), dtype=torch.float32, device="cuda")
            for (qr, kr, tr), kk, vv in rc.calls:
                if qr.shape[0]:
                    kernel.fwd(lq, kk, vv, qr, kr, tr, out=out, lse=lse, deterministic=True)
            out_q = out.to(lq.dtype)
            dq = torch.zeros(lq.shape, dtype=torch.float32, device="cuda")
            dks, dvs = [], []
            for (qr, kr, tr), kk, vv in rc.calls:
                dk = torch.zeros(kk.shape, dtype=torch.float32, device="cuda")
                dv = torch.zeros(vv.shape, dtype=torch.float32, device="cuda")
                if qr.shape[0]:
                    kernel.bwd(
                        ldo, lq, kk, vv, out_q, lse, qr, kr, tr, dq=dq, dk=dk, dv=dv, deterministic=True
                    )
                dks.append(dk)
                dvs.append(dv)
            runs.append((out_q, lse, dq, torch.cat(dks), torch.cat(dvs)))
        torch.cuda.synchronize()
        _assert_bitwise(runs, f"simulated cp 8 rank {rank_plan.rank} {mask} {backend} ({fwd_b}/{bwd_b})")


def test_hf_transformers_training_is_bitwise_repeatable(tmp_path) -> None:
    """The HF Transformers integration, trained twice for 5 steps in deterministic mode with
    torch.use_deterministic_algorithms(True): identical losses and parameters (a subprocess: the script
    sets CUBLAS_WORKSPACE_CONFIG before CUDA starts)."""
    pytest.importorskip("transformers")
    pytest.importorskip("magi_attention_transformers")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    out = tmp_path / "hf_deterministic.json"
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.integration_runs.hf_deterministic_run", "--steps", "5", "--tokens",
         "8192", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert out.is_file()
