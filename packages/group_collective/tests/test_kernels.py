"""Triton gather/scatter/reduce kernels against the plain torch ops (CPU tensors, Triton interpreter).

The kernels are the CUDA path; on CPU they run under ``TRITON_INTERPRET=1``. When this process was not
started with it (and has no GPU), the checks re-run in a child process that sets it before Triton loads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from magi_group_collective._ops import ReduceIndex, lse_reduce_rows, reduce_rows

_IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _random_red(gen, n_out: int, n_recv: int) -> ReduceIndex:
    r2o = torch.randint(0, max(1, n_out), (n_recv,), generator=gen)
    return ReduceIndex.build(r2o, torch.device(DEV))


def check_copy() -> None:
    from magi_group_collective._triton_kernels import copy_rows

    gen = torch.Generator().manual_seed(0)
    for dtype, trailing in ((torch.float32, (3,)), (torch.bfloat16, (2, 5)), (torch.int32, ()),
                            (torch.bool, (7,)), (torch.float64, (1,)), (torch.float16, (3,))):  # fmt: skip
        src = torch.randint(-100, 100, (37, *trailing), generator=gen).to(dtype).to(DEV)
        rows = src.reshape(37, -1)
        gather_idx = torch.randint(0, 37, (50,), generator=gen).to(DEV)  # repeats: multicast gather
        out = torch.zeros(50, rows.shape[1], dtype=dtype, device=DEV)
        copy_rows(rows, out, src_idx=gather_idx, dst_idx=None)
        assert torch.equal(out, rows[gather_idx]), f"gather {dtype}"
        perm = torch.randperm(60, generator=gen)[:37].to(DEV)  # scatter into a poisoned buffer
        dst = torch.full((60, rows.shape[1]), 3, dtype=dtype, device=DEV)
        want = dst.clone()
        want[perm] = rows
        copy_rows(rows, dst, src_idx=None, dst_idx=perm)
        assert torch.equal(dst, want), f"scatter {dtype}"
        sub = torch.randperm(37, generator=gen)[:20].to(DEV)  # both indices
        dst2 = torch.full((60, rows.shape[1]), 5, dtype=dtype, device=DEV)
        want2 = dst2.clone()
        want2[perm[:20]] = rows[sub]
        copy_rows(rows, dst2, src_idx=sub, dst_idx=perm[:20])
        assert torch.equal(dst2, want2), f"move {dtype}"
    # odd row sizes fall back to narrower words (3 bf16 = 6 bytes -> int16 words)
    odd = torch.randn(9, 3, generator=gen).to(torch.bfloat16).to(DEV)
    out = torch.empty(4, 3, dtype=torch.bfloat16, device=DEV)
    idx = torch.tensor([8, 0, 0, 4], device=DEV)
    copy_rows(odd, out, src_idx=idx, dst_idx=None)
    assert torch.equal(out, odd[idx])
    copy_rows(odd, out, src_idx=torch.empty(0, dtype=torch.int64, device=DEV), dst_idx=None)  # empty: no-op


def check_reduce() -> None:
    from magi_group_collective._triton_kernels import reduce_rows_csr

    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-13), (torch.bfloat16, 1e-2)):
        for with_w in (False, True):
            out0 = torch.randn(23, 6, generator=gen, dtype=torch.float64).to(dtype).to(DEV)
            recv = torch.randn(40, 6, generator=gen, dtype=torch.float64).to(dtype).to(DEV)
            red = _random_red(gen, 23, 40)
            w = torch.rand(40, generator=gen).to(DEV) if with_w else None
            got, want = out0.clone(), out0.clone()
            reduce_rows_csr(got, recv, red, w)
            ref = out0.double().index_add(
                0, red.recv_to_out, recv.double() * (1 if w is None else w[:, None])
            )
            assert (got.double() - ref).abs().max() <= tol * (1 + ref.abs().max()), (
                f"reduce {dtype} w={with_w}"
            )
            reduce_rows(want, recv, red, w)  # torch path agrees too (same rounding points for half)
            assert (got.double() - want.double()).abs().max() <= tol * (1 + ref.abs().max())
            untouched = torch.ones(23, dtype=torch.bool, device=DEV)
            untouched[red.touched] = False
            assert torch.equal(got[untouched], out0[untouched]), "rows without contributions must not change"


def check_lse() -> None:
    from magi_group_collective._triton_kernels import lse_reduce_rows_csr

    gen = torch.Generator().manual_seed(2)
    ninf = float("-inf")
    for dtype, tol in ((torch.float32, 2e-6), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        H, D = 3, 5
        out0 = torch.randn(17, H, D, generator=gen, dtype=torch.float64).to(dtype).to(DEV)
        lse0 = (torch.randn(17, H, generator=gen) * 2).to(DEV)
        lse0[torch.rand(17, H, generator=gen) < 0.4] = ninf
        out0[(lse0 == ninf).to("cpu")] = float("nan")  # "nothing yet": must never leak into the result
        recv = torch.randn(30, H, D, generator=gen, dtype=torch.float64).to(dtype).to(DEV)
        rlse = (torch.randn(30, H, generator=gen) * 2).to(DEV)
        rlse[torch.rand(30, H, generator=gen) < 0.4] = ninf
        red = _random_red(gen, 17, 30)
        got, got_lse = out0.clone(), lse0.clone()
        lse_reduce_rows_csr(got, got_lse, recv, rlse, red)
        want, want_lse = out0.clone(), lse0.clone()
        lse_reduce_rows(want, want_lse, recv, rlse, red)  # torch path, fp32/fp64 math
        assert not got_lse.isnan().any(), "lse must never be NaN"
        assert torch.equal(got_lse == ninf, want_lse == ninf), "empty rows"
        fin = want_lse != ninf
        assert torch.allclose(got_lse[fin], want_lse[fin], atol=1e-5), f"lse {dtype}"
        assert torch.equal(got.isnan(), want.isnan()), f"NaN pattern {dtype}"
        diff = (got.double() - want.double()).nan_to_num(0).abs().max()
        assert diff <= tol * (1 + want.double().nan_to_num(0).abs().max()), f"lse out {dtype}: {diff}"


CHECKS = {"copy": check_copy, "reduce": check_reduce, "lse": check_lse}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_kernel(name: str) -> None:
    if _IN_PROCESS:
        CHECKS[name]()
        return
    # Triton reads TRITON_INTERPRET when a kernel is defined: run in a child that sets it first.
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('k', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.CHECKS[sys.argv[2]]()"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, __file__, name], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_fixed_order_reduction_is_a_loop_in_received_order(dtype) -> None:
    """The deterministic torch reduction (the fallback's, used on CUDA without Triton or for a non-contiguous
    output) adds each output row's sources one at a time in received order: bitwise a plain Python loop."""
    gen = torch.Generator().manual_seed(5)
    out0 = torch.randn(19, 2, 3, generator=gen, dtype=torch.float64).to(dtype)
    recv = (torch.randn(45, 2, 3, generator=gen, dtype=torch.float64) * 1e3).to(dtype)  # rounding shows
    red = ReduceIndex.build(torch.randint(0, 19, (45,), generator=gen), torch.device("cpu"))
    assert len(red.levels) == int(torch.bincount(red.recv_to_out).max()) > 2
    acc_dt = torch.float32 if dtype == torch.bfloat16 else dtype
    want = out0.to(acc_dt).clone()
    for k in range(recv.shape[0]):  # received order
        want[red.recv_to_out[k]] = want[red.recv_to_out[k]] + recv[k].to(acc_dt)
    want = want.to(dtype)
    for _ in range(2):
        got = out0.clone()
        reduce_rows(got, recv, red, deterministic=True)
        assert torch.equal(got, want)
    # the lse merge's fixed-order path gives the default path's bits on CPU (index_add_ there is a loop too)
    lse0 = torch.randn(19, 2, generator=gen)
    rlse = torch.randn(45, 2, generator=gen)
    a, a_lse, b, b_lse = out0.clone(), lse0.clone(), out0.clone(), lse0.clone()
    lse_reduce_rows(a, a_lse, recv, rlse, red, deterministic=True)
    lse_reduce_rows(b, b_lse, recv, rlse, red)
    assert torch.equal(a, b) and torch.equal(a_lse, b_lse)
