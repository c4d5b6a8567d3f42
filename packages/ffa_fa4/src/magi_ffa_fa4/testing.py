"""Test helpers: dense masks and the dense attention reference (magi_ffa's, which this package's tests share),
mask generators and the tolerance rule. Independent of the interval and block code they check.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from magi_ffa._deprecation import deprecated_aliases
from magi_ffa.testing import make_attn_mask, random_overlapping_slices, ref_attn
from magi_ffa.validation import RangesLike, TypeMapLike

__all__ = [
    "assert_close_to_ref",
    "assert_same_meta",
    "dense_mask",
    "random_overlapping_slices",
    "ref_attention",
    "slice_tensors",
]


def dense_mask(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, total_q: int, total_k: int
) -> torch.Tensor:
    """Bool ``[total_q, total_k]``: the union of the slice masks, on the CPU (``magi_ffa.testing.make_attn_mask``,
    itself the one dense oracle ``magi_mask.dense_mask``)."""
    return make_attn_mask(q_ranges, k_ranges, attn_type_map, total_q, total_k)


ref_attention = functools.partial(ref_attn, dtype=torch.float64)
ref_attention.__doc__ = """Dense masked attention in float64 (``dtype=`` another one), differentiable:
``magi_ffa.testing.ref_attn(q, k, v, mask, softmax_scale=None, softcap=0.0, dtype=torch.float64)`` on copies of
q, k, v in that dtype. Returns ``(out, lse)`` in it (rows with no key: out 0, lse -inf)."""


def assert_close_to_ref(
    name: str,
    x: torch.Tensor,
    ref64: torch.Tensor,
    ref_lp: torch.Tensor,
    *,
    rtol: float,
    atol: float = 1e-8,
    norm_floor: float = 1e-6,
    max_mismatch: float = 0.75,
) -> None:
    """The FFA test rule (study 3.4): ``x`` against the fp64 reference, with the error budget set by how far
    the same-dtype torch reference ``ref_lp`` is from it.

    (a) ``max|x - ref64| <= max(norm_floor, 2 * max|ref_lp - ref64|)``;
    (b) the fraction of elements outside ``atol + rtol * |ref64|`` is at most
        ``clamp(2 * that fraction for ref_lp, 1e-6, max_mismatch)``.
    Infinite entries must match exactly (same positions, same sign); NaN never passes.
    """
    x64, lp64 = x.detach().double(), ref_lp.detach().double()
    r = ref64.detach().double()
    if torch.isnan(x64).any():
        raise AssertionError(f"{name}: NaN in result")
    inf_x, inf_r = torch.isinf(x64), torch.isinf(r)
    if not torch.equal(inf_x, inf_r) or not torch.equal(x64[inf_x], r[inf_r]):
        raise AssertionError(f"{name}: infinite entries differ from the reference")
    fin = ~inf_r
    x64, lp64, r = x64[fin], lp64[fin], r[fin]
    if r.numel() == 0:
        return
    err = (x64 - r).abs().max().item()
    base = (lp64 - r).abs()
    base = base[torch.isfinite(base)]
    budget = max(norm_floor, 2.0 * (base.max().item() if base.numel() else 0.0))
    if not err <= budget:
        raise AssertionError(f"{name}: max error {err:.3e} > budget {budget:.3e}")
    tol = atol + rtol * r.abs()
    frac = ((x64 - r).abs() > tol).double().mean().item()
    frac_lp = ((lp64 - r).abs() > tol).double().mean().item()
    allowed = min(max(2.0 * frac_lp, 1e-6), max_mismatch)
    if not frac <= allowed:
        raise AssertionError(f"{name}: mismatch ratio {frac:.3e} > allowed {allowed:.3e}")
    if not math.isfinite(err):
        raise AssertionError(f"{name}: non-finite error")


def slice_tensors(q_ranges, k_ranges, attn_type_map) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Python slice lists as the int32 CPU tables the launch-metadata builders take: ``[n, 2]``, ``[n, 2]``,
    ``[n]`` (an empty mask gives ``[0, 2]`` tables)."""
    return (
        torch.tensor(q_ranges, dtype=torch.int32).reshape(-1, 2),
        torch.tensor(k_ranges, dtype=torch.int32).reshape(-1, 2),
        torch.tensor(attn_type_map, dtype=torch.int32),
    )


def assert_same_meta(a, b, *, layout: bool = False, path: str = "meta") -> None:
    """Assert two launch metadata (dataclasses, tuples, lists, tensors, plain values) are equal, field by
    field; tensors by dtype and values, and with ``layout`` also by shape, strides and device. The message
    names the first differing field."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        if layout:
            assert (a.shape, a.stride(), a.device) == (b.shape, b.stride(), b.device), path
        assert torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same_meta(getattr(a, f.name), getattr(b, f.name), layout=layout, path=f"{path}.{f.name}")
    elif isinstance(a, tuple | list):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_meta(x, y, layout=layout, path=f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


# old names, for one release (docs/migration.md): this module's `random_slices` was magi_ffa's
# random_overlapping_slices, not magi_ffa.testing's random_slices (now random_banded_slices)
__getattr__ = deprecated_aliases(__name__, {"random_slices": "random_overlapping_slices"})
