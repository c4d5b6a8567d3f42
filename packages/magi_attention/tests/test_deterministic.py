"""Deterministic mode on CPU: the config and its default (environment variable, torch's switch), the key,
`auto`'s restriction to backends deterministic on every rank's calls, the refusal of an explicit backend
that cannot be, before any data moves, and bitwise repeatable gradients at cp 2-4 on gloo (the GroupReduce's
fixed-order torch reduction). The disagreement of one rank set differently is checked with the other key
disagreements (test_failure_modes.py); the GPU runs are in test_deterministic_gpu.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import magi_attention._runtime.kernels as kernels
import magi_attention._runtime.key_route as key_route
import magi_ffa
from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention._runtime.kernels import (
    RankBackends,
    choose_auto,
    describe_mask,
    resolve,
    restrict_deterministic,
)
from magi_attention.api import (
    calc_attn,
    clear_cache,
    dispatch,
    get_kernel_backend,
    magi_attn_flex_key,
    undispatch,
)
from magi_attention.config import KernelBackend as B
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn
from magi_ffa.validation import check_slices
from magi_group_collective import GroupCastPlan
from magi_solver.kernel_choice import MaskFeatures, busiest_rank_features

ALL = RankBackends("h200", ("cudnn", "fa4", "torch", "triton"))  # a rank that runs every shipped backend
NO_CUDNN = RankBackends("h200", ("fa4", "torch", "triton"))

# overlapping slices of all four types: FA4 takes its block-sparse path (no deterministic backward)
RANDOM_Q = [[0, 4096], [0, 4096], [2048, 8192], [4096, 8192]]
RANDOM_K = [[0, 1024], [2048, 3072], [0, 8192], [5000, 6000]]
RANDOM_T = [0, 3, 1, 2]
DOCS = [[0, 900], [900, 2500], [2500, 3100], [3100, 6000], [6000, 8192]]


# -- the config and its default -----------------------------------------------------------------------------
def test_default_follows_the_environment_variable(monkeypatch) -> None:
    monkeypatch.delenv("MAGI_ATTENTION_DETERMINISTIC_MODE", raising=False)
    assert DistAttnConfig().deterministic is False
    monkeypatch.setenv("MAGI_ATTENTION_DETERMINISTIC_MODE", "1")
    assert DistAttnConfig().deterministic is True  # resolved when built, not left None
    assert DistAttnConfig(deterministic=False).deterministic is False  # an explicit value wins
    monkeypatch.setenv("MAGI_ATTENTION_DETERMINISTIC_MODE", "maybe")
    with pytest.raises(ValueError, match="MAGI_ATTENTION_DETERMINISTIC_MODE"):
        DistAttnConfig()
    with pytest.raises(TypeError, match="deterministic"):
        DistAttnConfig(deterministic=1)


def test_default_follows_torchs_deterministic_switch(monkeypatch) -> None:
    monkeypatch.delenv("MAGI_ATTENTION_DETERMINISTIC_MODE", raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert DistAttnConfig().deterministic is True
        assert DistAttnConfig(deterministic=False).deterministic is False
        torch.use_deterministic_algorithms(False)
        assert DistAttnConfig().deterministic is False
    finally:
        torch.use_deterministic_algorithms(before)


def test_torchs_switch_in_a_fresh_process() -> None:
    code = (
        "import torch; torch.use_deterministic_algorithms(True); "
        "from magi_attention import DistAttnConfig; assert DistAttnConfig().deterministic is True"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "MAGI_ATTENTION_DETERMINISTIC_MODE"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_key_differs_by_deterministic() -> None:
    def key(det: bool):
        cfg = DistAttnConfig(kernel_backend="torch", deterministic=det)
        return magi_attn_flex_key([[0, 32]], [[0, 32]], "causal", 32, 32, 2, 1, 16, None, cfg)

    on, off = key(True), key(False)
    assert on != off and hash(on) != hash(off)
    assert on == key(True) and on.config.deterministic and not off.config.deterministic
    clear_cache()


# -- FA4's deterministic support and auto's restriction (pure functions) ------------------------------------
def _docs_call():
    return check_slices(DOCS, DOCS, [1] * len(DOCS), 8192, 8192)  # packed documents: FA4's varlen path


def _random_call():
    return check_slices(RANDOM_Q, RANDOM_K, RANDOM_T, 8192, 8192)  # FA4's block-sparse path


def test_fa4_deterministic_support_per_call_is_decided_once() -> None:
    fa4 = pytest.importorskip("magi_ffa_fa4").CAPABILITY
    assert fa4.deterministic_on(_docs_call())
    assert fa4.deterministic_on(check_slices([[0, 8192]], [[0, 8192]], [0], 8192, 8192))
    assert not fa4.deterministic_on(_random_call())
    assert fa4.deterministic_on(check_slices([], [], [], 8192, 8192))  # no slice: no kernel runs
    # the verdict is kept with the slices: the plan decides it, every call's check reads it (equal masks share
    # one mask-cache entry, so start from an empty cache)
    magi_ffa.clear_mask_caches()
    tested = []
    counting = dataclasses.replace(fa4, deterministic=lambda c: tested.append(1) or fa4.deterministic(c))
    call = _random_call()
    assert not counting.deterministic_on(call) and not counting.deterministic_on(call)
    with pytest.raises(ValueError, match="block-sparse"):
        counting.check_deterministic(True, call)
    assert tested == [1]


def _features(q, k, t, total=8192):
    return lambda: busiest_rank_features(q, k, t, [np.arange(total)])


def test_auto_in_deterministic_mode_picks_only_backends_deterministic_on_every_rank() -> None:
    feats = _features(DOCS, DOCS, [1] * len(DOCS))
    agreed = resolve("auto", 128, [ALL, ALL], deterministic=True)
    # every rank's calls run FA4's varlen path: the choice is unchanged
    docs = (DOCS, DOCS, [1] * len(DOCS))
    assert restrict_deterministic(agreed, [[_docs_call()], [_docs_call()]], docs, 128) is agreed
    # rank 1's calls do not: FA4 leaves the candidates, for every rank alike
    restricted = restrict_deterministic(agreed, [[_docs_call()], [_random_call()]], docs, 128)
    assert "fa4" not in restricted.candidates and "fa4" in agreed.candidates
    for det in (False, True):
        c = choose_auto(restricted, 128, feats, deterministic=det)
        assert B.FA4 not in (c.backend, c.backward_for(torch.bfloat16, 128)), c
        assert c.backend_for(torch.bfloat16, 128, softcap=5.0) != B.FA4  # cuDNN's softcap fallback too
    # the shipped H200 table's deterministic rows decide (packed documents: cuDNN's deterministic backward)
    c = choose_auto(restricted, 128, feats, deterministic=True)
    assert c.backend == B.CUDNN and "nearest deterministic measured row" in c.reason, c.reason
    # fragmented slices: cuDNN's deterministic backward is slow there, Triton's is free (the measured rows)
    fragmented = MaskFeatures(32768, 1, tile_fill=0.97, slices_per_row=2.84, documents=False)
    frag = choose_auto(restricted, 128, lambda: fragmented, deterministic=True)
    assert frag.backward_for(torch.bfloat16, 128) == B.TRITON, frag.reason
    # without cuDNN anywhere: Triton (the capabilities' priority without FA4)
    only = resolve("auto", 128, [NO_CUDNN, ALL], deterministic=True)
    only = restrict_deterministic(only, [[_random_call()], [_docs_call()]], docs, 128)
    c = choose_auto(only, 128, feats, deterministic=True)
    assert c.backend == B.TRITON and "deterministic mode" in c.reason, c.reason
    # auto's cuDNN pick moves a softcap call to Triton, not to FA4
    c = choose_auto(restricted, 128, feats, deterministic=True)
    assert c.backend_for(torch.bfloat16, 128, softcap=5.0) == B.TRITON
    # an explicit cuDNN is kept (it is deterministic with its flag)
    explicit = resolve("cudnn", 128, [ALL], deterministic=True)
    assert restrict_deterministic(explicit, [[_random_call()]], docs, 128).backend == B.CUDNN


def test_explicit_fa4_that_cannot_be_deterministic_raises_naming_everything() -> None:
    agreed = resolve("fa4", 128, [ALL] * 4, deterministic=True)
    calls = [[_docs_call()], [_random_call()], [_docs_call()], [_docs_call(), _random_call()]]
    with pytest.raises(ValueError) as info:
        restrict_deterministic(agreed, calls, (RANDOM_Q, RANDOM_K, RANDOM_T), 128)
    msg = str(info.value)
    for part in ("kernel_backend='fa4'", "rank(s) [1, 3]", "4 slices of types", "'cudnn'", "'triton'"):
        assert part in msg, (part, msg)
    assert describe_mask(DOCS, DOCS, [1] * 5) == "5 packed causal documents"
    assert describe_mask(DOCS, DOCS, [1, 1, 0, 1, 1]) == "5 slices of types causal, full"
    assert describe_mask([[0, 8]], [[0, 8]], [0]) == "one full slice"


def test_cudnn_has_no_deterministic_backward_above_head_dim_128() -> None:
    """cuDNN's capability (`deterministic_head_dim`, magi_ffa_cudnn.DETERMINISTIC_MAX_HEAD_DIM) refuses it."""
    assert resolve("cudnn", 128, [ALL], deterministic=True).backend == B.CUDNN
    with pytest.raises(
        ValueError, match=r"kernel_backend='cudnn' has no deterministic backward at head_dim 256.*'triton'"
    ):
        resolve("cudnn", 256, [ALL], deterministic=True)
    assert resolve("cudnn", 256, [ALL]).backend == B.CUDNN  # its default backward runs there
    auto = resolve("auto", 256, [ALL], deterministic=True)
    assert "cudnn" not in auto.candidates and "cudnn" in resolve("auto", 256, [ALL]).candidates
    assert choose_auto(auto, 256, _features(DOCS, DOCS, [1] * 5), deterministic=True).backend == B.TRITON


# -- on gloo ranks: the refusal before any data moves, auto's restriction, repeatable gradients ------------
TOTAL, HQ, HKV, D = 96, 4, 2, 16


def _cfg(backend: str, degree: int | None = 1) -> DistAttnConfig:
    return DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=8),
        overlap_config=OverlapConfig(degree=degree, min_chunk_size=8),
        kernel_backend=backend,
        deterministic=True,
    )


def _random_mask(seed: int):
    rng = np.random.default_rng(seed)
    q, k, t = [], [], []
    for _ in range(6):
        qs = int(rng.integers(0, TOTAL - 8))
        ks = int(rng.integers(0, TOTAL - 8))
        q.append([qs, int(rng.integers(qs + 8, TOTAL + 1))])
        k.append([ks, int(rng.integers(ks + 8, TOTAL + 1))])
        t.append(int(rng.integers(0, 4)))
    return q, k, t


def _refusal_and_restriction_worker(rank: int, world: int) -> list[str]:
    seen = []
    real_probe = kernels.probe_local
    kernels.probe_local = lambda requested: (
        ALL
    )  # every rank claims FA4 and cuDNN (nothing runs a kernel here)
    real_import = key_route.import_libraries
    key_route.import_libraries = lambda choice: None  # ... so no vendor is imported either
    key_route.clear_agreements()
    moved = []
    real_cast = GroupCastPlan.cast
    GroupCastPlan.cast = lambda self, *a, **kw: moved.append(1) or real_cast(self, *a, **kw)
    try:
        q, k, t = _random_mask(3)
        with pytest.raises(ValueError) as info:
            magi_attn_flex_key(q, k, t, TOTAL, TOTAL, HQ, HKV, 64, dist.group.WORLD, _cfg("fa4"))
        seen.append(str(info.value))
        assert "kernel_backend='fa4'" in seen[-1] and "'cudnn'" in seen[-1], seen[-1]
        # auto on the same mask: every rank drops FA4 and picks the same deterministic backend
        key = magi_attn_flex_key(q, k, t, TOTAL, TOTAL, HQ, HKV, 64, dist.group.WORLD, _cfg("auto"))
        backend, reason = get_kernel_backend(key, torch.bfloat16)
        # no h200 table row at head_dim 64: the capabilities' priority among the deterministic candidates
        assert backend == B.TRITON and "deterministic mode: fa4 not deterministic" in reason, reason
        assert get_kernel_backend(key, torch.bfloat16)[0] == backend
        seen.append(backend.value)
        # the same auto without deterministic mode keeps FA4 among its candidates (the table decides)
        default = dataclasses.replace(_cfg("auto"), deterministic=False)
        key = magi_attn_flex_key(q, k, t, TOTAL, TOTAL, HQ, HKV, 64, dist.group.WORLD, default)
        assert key.config.deterministic is False
        assert not moved, "data moved before the refusal"
    finally:
        kernels.probe_local = real_probe
        key_route.import_libraries = real_import
        GroupCastPlan.cast = real_cast
        key_route.clear_agreements()
        clear_cache(dist.group.WORLD)
    return seen


def test_refusal_and_restriction_are_the_same_on_every_rank_before_any_data_moves() -> None:
    pytest.importorskip("magi_ffa_fa4")
    seen = run_distributed(_refusal_and_restriction_worker, 2, timeout=120)
    assert seen[0] == seen[1]


def _repeatable_worker(rank: int, world: int) -> int:
    """Deterministic calc_attn (torch kernels, fp32, overlap degrees 0 and 2) three times: bitwise equal out,
    dq, dk, dv; and close to the fp64 reference."""
    checks = 0
    q, k, t = _random_mask(world)
    g = torch.Generator().manual_seed(0)
    x = [torch.randn(TOTAL, h, D, generator=g) for h in (HQ, HKV, HKV)]
    dout = torch.randn(TOTAL, HQ, D, generator=g)
    mask = make_attn_mask(q, k, t, TOTAL, TOTAL)
    ref = ref_attn(*(a.double() for a in x), mask)
    for degree in (0, 2):
        key = magi_attn_flex_key(q, k, t, TOTAL, TOTAL, HQ, HKV, D, dist.group.WORLD, _cfg("torch", degree))
        runs = []
        for _ in range(3):
            local = [dispatch(a, key).requires_grad_() for a in x]
            out, _ = calc_attn(*local, key)
            out.backward(dispatch(dout, key))
            runs.append([undispatch(r, key) for r in (out.detach(), *(a.grad for a in local))])
        for again in runs[1:]:
            for a, b in zip(runs[0], again, strict=True):
                assert torch.equal(a, b), f"degree {degree}: not bitwise repeatable"
        assert (runs[0][0].double() - ref[0]).abs().max() < 1e-4
        checks += 1
    clear_cache(dist.group.WORLD)
    return checks


@pytest.mark.parametrize("world", [2, 4])
def test_deterministic_calc_attn_is_bitwise_repeatable_on_gloo(world: int) -> None:
    assert run_distributed(_repeatable_worker, world, timeout=300) == [2] * world
