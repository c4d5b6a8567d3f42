"""A kernel call on a mask seen before never waits for the GPU: no synchronizing CUDA call on the host.

A call that synchronizes makes the host wait for every kernel queued before it, so the host can no longer run
ahead of the GPU and its own per-call work (checks, cache lookups, launches) shows up as idle GPU time in
every attention call of a training step. Checked with ``torch.cuda.set_sync_debug_mode("error")`` on the
second call of each entry (the first builds the mask's launch data) for every installed backend: the
functional ``ffa_fwd`` / ``ffa_bwd`` on host slice tables, the autograd ``flex_flash_attn_func`` (forward and
backward), and the runtime's launchers on slices checked once (``AttnKernel.fwd_slices`` / ``bwd_slices``);
the kernel API on range tables that live on the GPU (int32 and int64: a known mask is found by the tables'
identity, before any conversion, so nothing is copied to the host); and ``calc_attn`` on a built key.

    python -m pytest -m gpu packages/magi_attention/tests/test_no_sync_gpu.py -q
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from magi_attention import DistAttnConfig
from magi_attention._runtime.cache import KernelSlices
from magi_attention._runtime.kernels import attn_kernel, ffa_backend
from magi_attention.api import calc_attn, clear_cache, magi_attn_flex_key
from magi_attention.config import KernelBackend as B

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:Argument aux_data"),  # FA4's varlen forward (see test_fa4_gpu.py)
    pytest.mark.filterwarnings("ignore:.*synchroniz"),  # set_sync_debug_mode's own notice
]

TOTAL, HQ, HKV, D = 2048, 8, 2, 128


@contextlib.contextmanager
def _no_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _tables():
    """Packed causal documents plus one FULL slice across two of them, as int32 host tensors."""
    docs = [[0, 300], [300, 1100], [1100, 1500], [1500, TOTAL]]
    q = [*docs, [1100, 1500]]
    k = [*docs, [0, 1100]]
    t = [1, 1, 1, 1, 0]
    return tuple(torch.tensor(x, dtype=torch.int32) for x in (q, k, t))


def _backend_or_skip(name: str):
    try:
        impl = ffa_backend(B(name))
        if impl.capability.install_check is not None:
            impl.capability.install_check()
    except ImportError as e:
        pytest.skip(f"{name} not installed: {e}")
    return impl


@pytest.mark.parametrize("name", ["triton", "fa4", "cudnn"])
def test_calls_on_a_known_mask_do_not_synchronize(name: str) -> None:
    impl = _backend_or_skip(name)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(TOTAL, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(TOTAL, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(TOTAL, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(TOTAL, HQ, D, device=dev, dtype=torch.bfloat16)
    qr, kr, tm = _tables()
    flex, ffa_fwd, ffa_bwd = impl.entry_points
    kern = attn_kernel(B(name))
    sl = KernelSlices(qr, kr, tm, int(tm.shape[0]))

    def functional():
        with torch.no_grad():
            out, lse = ffa_fwd(q, k, v, qr, kr, tm)[:2]
            ffa_bwd(do, q, k, v, out, lse, qr, kr, tm)

    def autograd():
        out = flex(q, k, v, qr, kr, tm)[0]
        torch.autograd.grad(out, (q, k, v), do)

    def runtime():
        with torch.no_grad():
            out, lse = kern.fwd_slices(q, k, v, sl)[:2]
            kern.bwd_slices(do, q, k, v, out, lse, sl)

    for entry in (functional, autograd, runtime):
        entry()  # builds (or finds) the mask's launch data
        torch.cuda.synchronize()
        with _no_sync():
            entry()
    torch.cuda.synchronize()


def _qkv_do():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    q = torch.randn(TOTAL, HQ, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(TOTAL, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(TOTAL, HKV, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, torch.randn(TOTAL, HQ, D, device=dev, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("name", ["triton", "fa4", "cudnn"])
def test_kernel_api_on_cuda_tables_does_not_synchronize(name: str, dtype: torch.dtype) -> None:
    """``flex_flash_attn_func`` forward + backward, range tables as CUDA tensors (as FA4 users pass
    ``cu_seqlens``): the repeated calls copy nothing to the host (no check, no int32 range check, no
    ``.cpu()`` in the custom ops)."""
    impl = _backend_or_skip(name)
    q, k, v, do = _qkv_do()
    qr, kr, tm = (t.to(device="cuda", dtype=dtype) for t in _tables())
    flex = impl.entry_points[0]

    def step():
        out = flex(q, k, v, qr, kr, tm)[0]
        torch.autograd.grad(out, (q, k, v), do)

    step()  # a new mask: one host copy and one check, its launch data built
    torch.cuda.synchronize()
    with _no_sync():
        step()
        step()
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["auto", "triton", "fa4", "cudnn"])
def test_calc_attn_on_a_built_key_does_not_synchronize(name: str) -> None:
    """``calc_attn`` forward + backward at cp 1 on a key built beforehand."""
    if name != "auto":
        _backend_or_skip(name)
    clear_cache()
    q, k, v, do = _qkv_do()
    qr, kr, tm = _tables()
    types = ["causal" if t else "full" for t in tm.tolist()]
    config = DistAttnConfig(kernel_backend=name)
    key = magi_attn_flex_key(qr.tolist(), kr.tolist(), types, TOTAL, TOTAL, HQ, HKV, D, None, config)

    def step():
        out, _meta = calc_attn(q, k, v, key)
        torch.autograd.grad(out, (q, k, v), do)

    step()
    torch.cuda.synchronize()
    with _no_sync():
        step()
    torch.cuda.synchronize()
