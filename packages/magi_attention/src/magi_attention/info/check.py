"""``--check``: every kernel backend that runs here against dense float64 attention (``magi_ffa.testing``)
on three small masks, forward (out, lse) and backward (dq, dk, dv), under the test suite's acceptance rule
(``magi_ffa.testing.assert_close_to_ref``); see ``magi_attention.info``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .report import BACKENDS

__all__ = ["check_backend", "kernel_fns", "run_checks"]


def _check_masks(total: int) -> list[tuple[str, list, list, list]]:
    from ..vendors import standard_masks

    masks = standard_masks(total, window=total // 4)
    return [
        (m.name, [list(r) for r in m.q_ranges], [list(r) for r in m.k_ranges], list(m.types)) for m in masks
    ]


def kernel_fns(backend: str) -> tuple[Callable, Callable]:
    """``(fwd, bwd)`` of ``backend`` with ``magi_ffa.ffa_fwd`` / ``ffa_bwd``'s contract (the runtime's)."""
    from .._runtime.kernels import attn_kernel
    from ..config import KernelBackend

    kernel = attn_kernel(KernelBackend(backend))
    return kernel.fwd, kernel.bwd


def _check_shape(backend: str, cuda: bool) -> tuple[int, int, int, int, torch.dtype]:
    """(tokens, heads_q, heads_kv, head_dim, dtype) of a check: small, GQA, the dtype users train in; on a
    CPU float32 and, for Triton's interpreter (~10 ms per tile step), tiny."""
    if cuda:
        return 512, 4, 2, 128, torch.bfloat16
    if backend == "triton":
        return 64, 2, 1, 16, torch.float32
    return 128, 2, 1, 32, torch.float32


def check_backend(backend: str) -> list[dict]:
    """One row per mask: passed, the worst error ratio, and the failure message when it failed."""
    from magi_ffa.testing import assert_close_to_ref, make_attn_mask, random_qkv, ref_attn

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    total, hq, hk, d, dtype = _check_shape(backend, cuda)
    fwd, bwd = kernel_fns(backend)
    rows = []
    for name, qr, kr, types in _check_masks(total):
        t0 = time.perf_counter()
        q, k, v = random_qkv(total, total, hq, hk, d, dtype, device, seed=1)
        do = random_qkv(total, total, hq, hk, d, dtype, device, seed=2)[0]
        mask = make_attn_mask(qr, kr, types, total, total)
        refs = {}
        for rdt in (torch.float64, dtype):
            leaves = [x.detach().to(rdt).requires_grad_() for x in (q, k, v)]
            out, lse = ref_attn(*leaves, mask)
            out.backward(do.to(rdt))
            refs[rdt] = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
                         "dv": leaves[2].grad}  # fmt: skip
        row = {"backend": backend, "mask": name, "tokens": total, "dtype": str(dtype).removeprefix("torch.")}
        try:
            qt, kt, tt = (torch.tensor(x, dtype=torch.int32, device=device) for x in (qr, kr, types))
            out, lse = fwd(q, k, v, qt, kt, tt)
            dq, dk, dv = bwd(do, q, k, v, out, lse, qt, kt, tt)
            got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
            ratio, failure = 0.0, ""
            for key, actual in got.items():
                ratio = max(ratio, _error_ratio(actual, refs[torch.float64][key], refs[dtype][key]))
                try:
                    assert_close_to_ref(key, actual, refs[torch.float64][key], refs[dtype][key], dtype)
                except AssertionError as exc:
                    failure = failure or str(exc)
            row.update(passed=not failure, ratio=round(ratio, 3), error=failure)
        except Exception as exc:  # a crash is a failed check, reported with its message
            row.update(passed=False, ratio=None, error=f"{type(exc).__name__}: {exc}")
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def _error_ratio(actual: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor) -> float:
    """max |actual - ref64| / max |ref_lp - ref64| over the finite entries (1.0 = as good as the naive
    computation in the same dtype; 0 when both are exact)."""
    a, r, lp = (x.detach().to(torch.float64).cpu() for x in (actual, ref64, ref_lp))
    fin = torch.isfinite(r)
    if not fin.any():
        return 0.0
    err = (a[fin] - r[fin]).abs().max().item()
    err_lp = (torch.nan_to_num(lp[fin], nan=0.0, posinf=0.0, neginf=0.0) - r[fin]).abs().max().item()
    if err != err:  # NaN
        return float("inf")
    return err / err_lp if err_lp > 0 else (0.0 if err == 0 else float("inf"))


def run_checks(status: dict[str, str]) -> dict:
    """Every backend that runs here, checked; the ones that cannot run are listed with the reason."""
    rows, skipped = [], {}
    for backend in BACKENDS:
        if status[backend]:
            skipped[backend] = status[backend]
            continue
        rows.extend(check_backend(backend))
    return {"rows": rows, "skipped": skipped, "passed": all(r["passed"] for r in rows)}
