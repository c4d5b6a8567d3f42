"""The fused Triton backward (``MAGI_FFA_BWD_IMPL=fused``): one kernel per (kv head, k block), dq by atomics.

Under TRITON_INTERPRET=1 on CPU tensors (or on a CUDA GPU). Every test counts kernel launches, so it fails if
the fused path were not taken (or the split kernels ran instead). Checks: dq/dk/dv against the dense fp64
reference by the tolerance rule (random slices of all four types, q/k overlaps and shared pairs, GQA 1/2/4,
softcap, small tiles, poisoned outputs), agreement with the split backward within fp32 rounding, accumulate
mode, the lse gradient through autograd, the selection rules (deterministic, invalid values), and an offline
compile of the kernel for sm_90a.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from ffa_test_helpers import check_all, dense_refs

import magi_ffa
from magi_ffa import _triton_bwd, _triton_bwd_fused
from magi_ffa import testing as T

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not CUDA and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1"
)
DEV = "cuda" if CUDA else "cpu"
SCALE = 8 if CUDA else 1  # the interpreter runs ~10 ms per tile step: tiny shapes on CPU
KERNELS = {"fused": "ffa_bwd_fused_kernel", "dq": "ffa_bwd_dq_kernel", "dkv": "ffa_bwd_dkv_kernel"}


class _Launches:
    """Stands in for a @triton.jit kernel in its module: counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.n = 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch) -> dict[str, _Launches]:
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    monkeypatch.setenv("MAGI_FFA_POISON", "1")
    monkeypatch.setenv("MAGI_FFA_BWD_IMPL", "fused")
    counters = {}
    for name, attr in KERNELS.items():
        mod = _triton_bwd_fused if name == "fused" else _triton_bwd
        counters[name] = _Launches(getattr(mod, attr))
        monkeypatch.setattr(mod, attr, counters[name])
    return counters


def _tiles(monkeypatch, tiles: str | None) -> None:
    """Small tiles on CPU: several q tiles and k blocks per slice, so interior and boundary tiles both run.
    dkv and fused share tiles, so their dk/dv walks are the same."""
    if tiles and not CUDA:
        for kind in ("FWD", "DQ", "DKV", "FUSED"):
            monkeypatch.setenv(f"MAGI_FFA_TILES_{kind}", tiles)


def _mask(tq: int, tk: int, seed: int, shared: int):
    """Banded random slices (all types, q and k overlaps, empty slices) plus ``shared`` unconstrained slices
    that share (query, key) pairs with them (the union rewrite runs before the kernels)."""
    qr, kr, tm = T.random_slices(tq, tk, seed=seed, max_bands=3)
    rng = random.Random(seed)
    extra = []
    for _ in range(shared):
        a, c = rng.randrange(tq), rng.randrange(tk)
        extra.append((a, rng.randrange(a, tq + 1), c, rng.randrange(c, tk + 1), rng.randrange(4)))
    if extra:
        x = torch.tensor(extra, dtype=torch.int32)
        qr, kr, tm = torch.cat([qr, x[:, 0:2]]), torch.cat([kr, x[:, 2:4]]), torch.cat([tm, x[:, 4]])
    return qr, kr, tm


def _zeros(*ts):
    return [torch.zeros(t.shape, dtype=torch.float32, device=DEV) for t in ts]


CASES = [
    pytest.param(torch.float32, 2, 2, 16, 0, 0.0, "16,16,4,1", id="fp32-mha-16x16"),
    pytest.param(torch.float16, 4, 2, 32, 1, 2.0, "16,16,4,1", id="fp16-gqa2-softcap-16x16"),
    pytest.param(torch.bfloat16, 4, 1, 16, 2, 0.0, "16,32,4,1", id="bf16-gqa4-16x32"),
    pytest.param(torch.float32, 4, 1, 32, 3, 3.0, "32,16,4,1", id="fp32-gqa4-softcap-32x16"),
]


@pytest.mark.parametrize("dtype,hq,hk,d,seed,softcap,tiles", CASES)
def test_fused_vs_reference_and_split(monkeypatch, launches, dtype, hq, hk, d, seed, softcap, tiles):
    _tiles(monkeypatch, tiles)
    tq, tk = (72 + 9 * seed) * SCALE, (96 - 7 * seed) * SCALE
    qr, kr, tm = _mask(tq, tk, seed, shared=2)
    q, k, v = T.random_qkv(tq, tk, hq, hk, d, dtype, DEV, seed=seed)
    do = torch.randn(q.shape, device=DEV).to(dtype)
    o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm, softcap=softcap)
    dq, dk, dv = magi_ffa.ffa_bwd(
        do, q, k, v, o, l, qr, kr, tm, softcap=softcap
    )  # dk/dv buffers NaN-poisoned
    assert launches["fused"].n == 1 and launches["dq"].n == launches["dkv"].n == 0
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, softcap=softcap, do=do)
    r64, rlp = ({n: r[n] for n in ("dq", "dk", "dv")} for r in (r64, rlp))
    check_all(dict(dq=dq, dk=dk, dv=dv), r64, rlp, dtype)
    # the same inputs through both backwards into fp32 buffers: equal up to fp32 summation order
    fused = _zeros(q, k, v)
    magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm, softcap=softcap, dq=fused[0], dk=fused[1], dv=fused[2])
    monkeypatch.setenv("MAGI_FFA_BWD_IMPL", "split")
    split = _zeros(q, k, v)
    magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm, softcap=softcap, dq=split[0], dk=split[1], dv=split[2])
    assert launches["fused"].n == 2 and launches["dq"].n == launches["dkv"].n == 1
    # dk/dv: the same walk and tiles (bitwise equal under the interpreter), only dq's summation order
    # differs (atomics over k blocks vs one loop); in half precision dS is also rounded to the input dtype
    # from S computed in the other orientation, so an ulp can flip (bf16 math is fp32 on the interpreter)
    fp32_math = dtype == torch.float32 or (dtype == torch.bfloat16 and not CUDA)
    dq_tol = 1e-5 if fp32_math else {torch.float16: 2e-4, torch.bfloat16: 2e-3}[dtype]
    for name, a, b in zip(("dq", "dk", "dv"), fused, split):
        tol = (dq_tol if name == "dq" else 1e-5) * b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= tol, f"{name}: fused vs split max diff {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_types_alone_and_lse_grad_through_autograd(monkeypatch, launches, dtype):
    """Each type alone (aligned and unaligned, sq > sk and sq < sk) with the lse gradient, via
    flex_flash_attn_func (deterministic=False, the default)."""
    _tiles(monkeypatch, "16,16,4,1")
    s = SCALE
    qr = [[0, 40 * s], [40 * s, 70 * s], [70 * s, 100 * s], [100 * s, 120 * s], [0, 40 * s]]
    kr = [[0, 64 * s], [30 * s, 50 * s], [50 * s, 100 * s], [100 * s, 128 * s], [64 * s, 90 * s]]
    tm = [1, 1, 2, 3, 2]
    q, k, v = T.random_qkv(128 * s, 128 * s, 2, 1, 32, dtype, DEV, seed=1)
    do = torch.randn(q.shape, device=DEV).to(dtype)
    dlse = torch.randn(q.shape[:2], device=DEV)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = magi_ffa.flex_flash_attn_func(*xs, qr, kr, tm)
    loss = (out.float() * do.float()).sum() + (torch.where(torch.isneginf(lse), 0, lse) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, xs)
    assert launches["fused"].n == 1 and launches["dq"].n == launches["dkv"].n == 0
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do, dlse=dlse)
    check_all(dict(dq=dq, dk=dk, dv=dv), r64, rlp, dtype)


def test_accumulate_two_stages(monkeypatch, launches):
    """Given dq/dk/dv (random, not zero) are added to; two calls over halves of the slices with the final
    out/lse, as the distributed runtime does."""
    _tiles(monkeypatch, "16,16,4,1")
    tq, tk = 80 * SCALE, 96 * SCALE
    qr, kr, tm = T.random_slices(tq, tk, seed=21, max_bands=4)
    n = qr.shape[0]
    parts = (slice(0, n // 2), slice(n // 2, n))
    q, k, v = T.random_qkv(tq, tk, 4, 2, 16, torch.bfloat16, DEV, seed=7)
    o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm)
    do = torch.randn(q.shape, device=DEV).to(q.dtype)
    init = [torch.randn(t.shape, device=DEV) for t in (q, k, v)]
    grads = [t.clone() for t in init]
    for p in parts:
        magi_ffa.ffa_bwd(do, q, k, v, o, l, qr[p], kr[p], tm[p], dq=grads[0], dk=grads[1], dv=grads[2])
    assert launches["fused"].n == 2 and launches["dq"].n == launches["dkv"].n == 0
    r64, rlp = dense_refs(q, k, v, qr, kr, tm, do=do)
    got = {n: g - i for n, g, i in zip(("dq", "dk", "dv"), grads, init)}
    check_all(got, {n: r64[n] for n in got}, {n: rlp[n] for n in got}, torch.bfloat16)


def test_selection_rules_and_empty_mask(monkeypatch, launches):
    tq = 48 * SCALE
    q, k, v = T.random_qkv(tq, tq, 2, 1, 16, torch.float16, DEV, seed=5)
    qr, kr, tm = T.random_slices(tq, tq, seed=4, max_bands=2)
    do = torch.randn(q.shape, device=DEV).to(q.dtype)
    o, l = magi_ffa.ffa_fwd(q, k, v, qr, kr, tm)
    # deterministic=True always takes the split (bitwise reproducible) backward
    magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm, deterministic=True)
    assert launches["fused"].n == 0 and launches["dq"].n == launches["dkv"].n == 1
    for value in ("split", ""):
        monkeypatch.setenv("MAGI_FFA_BWD_IMPL", value)
        magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm)
    assert launches["fused"].n == 0 and launches["dkv"].n == 3
    for backend in ("triton", "torch"):
        monkeypatch.setenv("MAGI_FFA_BACKEND", backend)
        monkeypatch.setenv("MAGI_FFA_BWD_IMPL", "fusd")
        with pytest.raises(ValueError, match=r"MAGI_FFA_BWD_IMPL.*split, fused"):
            magi_ffa.ffa_bwd(do, q, k, v, o, l, qr, kr, tm)
    monkeypatch.setenv("MAGI_FFA_BACKEND", "triton")
    monkeypatch.setenv("MAGI_FFA_BWD_IMPL", "fused")
    # no slices: dq (zero-filled for the atomics) and the poisoned dk/dv buffers come back as zeros
    o, l = magi_ffa.ffa_fwd(q, k, v, [], [], None)
    for g in magi_ffa.ffa_bwd(do, q, k, v, o, l, [], [], None):
        assert torch.equal(g, torch.zeros_like(g))
    assert launches["fused"].n == 1


# Compiles the fused kernel for sm_90a (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ptxas bundled in the
# triton wheel) without a GPU: catches what only the compiler rejects (non-constexpr globals in jit code, type
# errors in untaken interpreter branches). A fresh process, since TRITON_INTERPRET=1 swaps the jit functions.
_AOT = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from magi_ffa._triton_bwd_fused import ffa_bwd_fused_kernel as fn
from magi_ffa._triton_common import tiles_for

t = tiles_for("fused", 128, False)
ints = {"SLICES", "BLK_PTR", "BLK_IDX", "BLK_ORDER"}
for softcap, accum in ((False, False), (True, True)):
    const = dict(HEAD_DIM=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, SOFTCAP=softcap, ACCUM=accum,
                 UPCAST=False, IEEE=False)
    sig = {}
    for n in fn.arg_names:
        if n in const:
            sig[n] = "constexpr"
        elif n.isupper() and n != "GROUP":
            sig[n] = "*i32" if n in ints else "*bf16" if n in ("Q", "K", "V", "DO") else "*fp32"
        else:
            sig[n] = "fp32" if n in ("sm_scale", "softcap") else "i32"
    k = compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 64),
                options=dict(num_warps=t.num_warps, num_stages=t.num_stages))
    assert "atom.global" in k.asm["ptx"] and len(k.asm["cubin"]) > 0
print("compiled")
"""


def test_fused_kernel_compiles_for_sm90():
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("the triton wheel has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
