"""Shared types, input validation and slice geometry for every backend.

Glossary (used in every docstring of this package):

- ``total_q`` / ``total_k``: number of query / key tokens (packed, no batch axis).
- ``num_heads_q`` / ``num_heads_kv``: query / key-value heads, ``num_heads_q % num_heads_kv == 0`` (GQA/MQA).
- ``head_dim``: the per-head feature size, equal for q, k and v.
- slice ``i``: query rows ``[q_ranges[i, 0], q_ranges[i, 1])`` attend to key rows ``[k_ranges[i, 0],
  k_ranges[i, 1])`` with the shape ``attn_type_map[i]`` (see :class:`AttnType`). The mask is the union of
  the slices: slices may share query rows, key rows, and even (query, key) pairs; slices that share pairs
  are rewritten once per mask into disjoint ones (``_disjoint.py``), so every pair counts once.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

RangesLike = torch.Tensor | Sequence[Sequence[int]]
TypeMapLike = torch.Tensor | Sequence[int] | None


class AttnType(enum.IntEnum):
    """Shape of one slice's visible region (local row ``i``, local column ``j``, sizes ``sq``, ``sk``).

    ``FULL`` (all pairs), ``CAUSAL`` (bottom-right aligned: ``j <= i + sk - sq``), ``INV_CAUSAL`` (top-left
    aligned: ``j >= i``), ``BI_CAUSAL`` (both). For ``sq=3, sk=4``::

        FULL     CAUSAL   INV_CAUSAL  BI_CAUSAL
        1111     1100     1111        1100
        1111     1110     0111        0110
        1111     1111     0011        0011
    """

    FULL = 0
    CAUSAL = 1
    INV_CAUSAL = 2
    BI_CAUSAL = 3


class Backend(enum.StrEnum):
    """Compute backend; ``MAGI_FFA_BACKEND`` forces one, else it follows the device and dtype."""

    TRITON = "triton"
    TORCH = "torch"


@dataclass(frozen=True, slots=True)
class Slice:
    """One non-empty slice after trimming rows that see no key (host ints, half-open ranges).

    ``q_start``/``q_end`` are the *effective* query rows (a CAUSAL slice with ``sq > sk`` loses its first
    ``sq - sk`` rows); ``dk = k_end - q_end`` and ``dk_inv = k_start - q_start`` are the diagonal offsets:
    global key ``c`` is visible from global row ``r`` iff ``c <= r + dk`` (causal part) and ``c >= r +
    dk_inv`` (inverse-causal part), intersected with ``[k_start, k_end)``.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    attn_type: AttnType
    dk: int
    dk_inv: int

    def __post_init__(self) -> None:
        assert 0 <= self.q_start < self.q_end and 0 <= self.k_start < self.k_end, f"empty slice {self}"

    @property
    def is_causal(self) -> bool:
        return self.attn_type in (AttnType.CAUSAL, AttnType.BI_CAUSAL)

    @property
    def is_inv_causal(self) -> bool:
        return self.attn_type in (AttnType.INV_CAUSAL, AttnType.BI_CAUSAL)

    def k_bounds(self, r0: int, r1: int) -> tuple[int, int]:
        """Key range ``[lo, hi)`` visible from any row in ``[r0, r1)`` (clipped to this slice)."""
        lo, hi = self.k_start, self.k_end
        if self.is_causal:
            hi = min(hi, r1 - 1 + self.dk + 1)
        if self.is_inv_causal:
            lo = max(lo, r0 + self.dk_inv)
        return lo, hi

    def q_bounds(self, c0: int, c1: int) -> tuple[int, int]:
        """Query range ``[lo, hi)`` that sees any key in ``[c0, c1)`` (clipped to this slice)."""
        lo, hi = self.q_start, self.q_end
        if self.is_causal:
            lo = max(lo, c0 - self.dk)
        if self.is_inv_causal:
            hi = min(hi, c1 - 1 - self.dk_inv + 1)
        return lo, hi


def make_slice(qs: int, qe: int, ks: int, ke: int, t: int) -> Slice | None:
    """Trim one raw slice to its non-empty rows; ``None`` when it covers no (query, key) pair."""
    sq, sk = qe - qs, ke - ks
    if sq <= 0 or sk <= 0:
        return None
    at = AttnType(t)
    # the diagonals are anchored to the untrimmed corners: causal to (q_end, k_end), inverse to the start
    dk, dk_inv = ke - qe, ks - qs
    if at == AttnType.CAUSAL:
        qs = max(qs, qe - sk)  # bottom-right aligned: the first sq - sk rows are empty
    elif at == AttnType.INV_CAUSAL:
        qe = min(qe, qs + sk)  # top-left aligned: rows past sk are empty
    elif at == AttnType.BI_CAUSAL and sq > sk:
        return None
    return Slice(qs, qe, ks, ke, at, dk=dk, dk_inv=dk_inv)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def as_ranges(x: RangesLike, name: str, device: torch.device) -> torch.Tensor:
    """Return ``x`` as an int32 ``[n, 2]`` tensor (tensors keep their device; lists become CPU tensors)."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64):
            _fail(f"`{name}` must be an int32 tensor of shape [num_slices, 2], got dtype {x.dtype}")
        if x.ndim != 2 or x.shape[1] != 2:
            if not (x.ndim == 1 and x.numel() == 0):
                _fail(f"`{name}` must have shape [num_slices, 2], got {tuple(x.shape)}")
            x = x.reshape(0, 2)
        if x.device != device and x.device.type != "cpu":
            _fail(f"`{name}` must be on q's device {device} (or the CPU), got {x.device}")
        return x.to(torch.int32)
    try:
        t = torch.tensor([list(r) for r in x], dtype=torch.int64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"`{name}` must be a [num_slices, 2] int tensor or list of pairs: {e}") from None
    if t.numel() == 0:
        t = t.reshape(0, 2)
    if t.ndim != 2 or t.shape[1] != 2:
        _fail(f"`{name}` must be a list of (start, end) pairs, got shape {tuple(t.shape)}")
    if t.numel() and (t.min() < torch.iinfo(torch.int32).min or t.max() > torch.iinfo(torch.int32).max):
        _fail(f"`{name}` values must fit int32")
    return t.to(torch.int32)  # lists stay on the CPU: no host<->device round trip


def as_type_map(x: TypeMapLike, n: int, device: torch.device) -> torch.Tensor:
    """Return ``attn_type_map`` as an int32 ``[n]`` tensor (``None`` means all FULL)."""
    if x is None:
        return torch.zeros(n, dtype=torch.int32)  # CPU: read on the host anyway
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.tensor(list(x), dtype=torch.int64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"`attn_type_map` must be an int tensor or list of ints: {e}") from None
        if x.ndim == 1 and x.shape[0] == n:
            return x.to(torch.int32)
    if x.dtype not in (torch.int32, torch.int64):
        _fail(f"`attn_type_map` must be an int32 tensor of shape [num_slices], got dtype {x.dtype}")
    if x.ndim != 1 or x.shape[0] != n:
        _fail(f"`attn_type_map` must have shape [{n}] (one type per slice), got {tuple(x.shape)}")
    if x.device != device and x.device.type != "cpu":
        _fail(f"`attn_type_map` must be on q's device {device} (or the CPU), got {x.device}")
    return x.to(device=device, dtype=torch.int32)


def host_slices(
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, type_map: torch.Tensor, total_q: int, total_k: int
) -> tuple[Slice, ...]:
    """Check range values and return the non-empty slices as host dataclasses.

    Costs one device->host copy when the ranges live on a GPU (pass CPU tensors or lists to avoid the sync);
    the result is cached by the ranges' *values* (bytes), never by tensor identity.
    """
    n = q_ranges.shape[0]
    if k_ranges.shape[0] != n:
        _fail(
            f"`q_ranges` and `k_ranges` must have the same number of slices, got {n} and {k_ranges.shape[0]}"
        )
    if n == 0:
        return ()
    packed = torch.cat([q_ranges.cpu(), k_ranges.cpu(), type_map.cpu()[:, None]], dim=1).contiguous()
    return _host_slices_cached(packed.numpy().tobytes(), n, total_q, total_k)


@functools.lru_cache(maxsize=256)
def _host_slices_cached(blob: bytes, n: int, total_q: int, total_k: int) -> tuple[Slice, ...]:
    packed = torch.frombuffer(bytearray(blob), dtype=torch.int32).reshape(n, 5).tolist()
    out = []
    for i, (qs, qe, ks, ke, t) in enumerate(packed):
        if not (0 <= qs <= qe <= total_q):
            _fail(f"`q_ranges[{i}]` = [{qs}, {qe}) must satisfy 0 <= start <= end <= total_q={total_q}")
        if not (0 <= ks <= ke <= total_k):
            _fail(f"`k_ranges[{i}]` = [{ks}, {ke}) must satisfy 0 <= start <= end <= total_k={total_k}")
        if t not in (0, 1, 2, 3):
            _fail(f"`attn_type_map[{i}]` = {t} must be 0 (FULL), 1 (CAUSAL), 2 (INV_CAUSAL) or 3 (BI_CAUSAL)")
        s = make_slice(qs, qe, ks, ke, t)
        if s is not None:
            out.append(s)
    from ._disjoint import disjoint_slices  # late: _disjoint builds on this module's Slice

    return disjoint_slices(tuple(out))


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator / lse dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def validate_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Check q ``[total_q, num_heads_q, head_dim]`` and k, v ``[total_k, num_heads_kv, head_dim]``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            _fail(f"`{name}` must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            _fail(f"`{name}` dtype must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        _fail(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        _fail(f"`k` and `v` must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        _fail(f"head_dim of q ({q.shape[2]}) and k/v ({k.shape[2]}) must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        _fail(f"num_heads_q ({q.shape[1]}) must be a multiple of num_heads_kv ({k.shape[1]})")


def validate_scalars(softmax_scale: float | None, softcap: float, head_dim: int) -> float:
    """Return the softmax scale (default ``head_dim ** -0.5``) after checking both scalars."""
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if not isinstance(softmax_scale, int | float) or not softmax_scale > 0:
        _fail(f"`softmax_scale` must be a positive float or None, got {softmax_scale!r}")
    if not isinstance(softcap, int | float) or not softcap >= 0:
        _fail(f"`softcap` must be a float >= 0 (0 disables), got {softcap!r}")
    return float(softmax_scale)


def validate_out_lse(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    q: torch.Tensor,
    names: tuple[str, str] = ("out", "lse"),
) -> None:
    """Check a caller-given (out, lse) pair: out ``[total_q, num_heads_q, head_dim]`` fp32 or q's dtype,
    lse ``[total_q, num_heads_q]`` fp32 (fp64 for fp64 inputs)."""
    if (out is None) != (lse is None):
        _fail(f"`{names[0]}` and `{names[1]}` must be given together (accumulate mode) or both be None")
    if out is None:
        return
    if out.shape != q.shape:
        _fail(f"`{names[0]}` must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if out.dtype not in (q.dtype, acc_dtype(q.dtype)):
        _fail(f"`{names[0]}` dtype must be {q.dtype} or {acc_dtype(q.dtype)}, got {out.dtype}")
    if lse.shape != q.shape[:2]:
        _fail(f"`{names[1]}` must have shape {tuple(q.shape[:2])}, got {tuple(lse.shape)}")
    if lse.dtype != acc_dtype(q.dtype):
        _fail(f"`{names[1]}` dtype must be {acc_dtype(q.dtype)}, got {lse.dtype}")
    if out.device != q.device or lse.device != q.device:
        _fail(f"`{names[0]}`/`{names[1]}` must be on q's device {q.device}")


def validate_grad_buffers(
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
) -> None:
    """Check caller-given gradient accumulators (fp32, fp64 for fp64 inputs, shapes of q/k/v)."""
    want = acc_dtype(q.dtype)
    for name, buf, ref in (("dq", dq, q), ("dk", dk, k), ("dv", dv, k)):
        if buf is None:
            continue
        if buf.shape != ref.shape:
            _fail(f"`{name}` must have shape {tuple(ref.shape)}, got {tuple(buf.shape)}")
        if buf.dtype != want:
            _fail(f"`{name}` accumulator dtype must be {want}, got {buf.dtype}")
        if buf.device != q.device:
            _fail(f"`{name}` must be on q's device {q.device}, got {buf.device}")


def backend_for(q: torch.Tensor) -> Backend:
    """Pick the backend: ``MAGI_FFA_BACKEND`` if set, else triton for CUDA fp16/bf16 and torch otherwise."""
    forced = os.environ.get("MAGI_FFA_BACKEND", "").strip().lower()
    if forced:
        try:
            return Backend(forced)
        except ValueError:
            _fail(f"MAGI_FFA_BACKEND must be 'triton' or 'torch', got {forced!r}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and triton_head_dim_ok(q.shape[-1]):
        return Backend.TRITON
    return Backend.TORCH


def resolve_backend(q: torch.Tensor, backend: Backend | str | None) -> Backend:
    """An explicit ``backend`` argument wins over ``MAGI_FFA_BACKEND`` and the default of :func:`backend_for`."""
    if backend is None:
        return backend_for(q)
    try:
        return Backend(str(backend).strip().lower())
    except ValueError:
        _fail(f"`backend` must be 'triton', 'torch' or None, got {backend!r}")


def triton_head_dim_ok(d: int) -> bool:
    """The Triton kernels tile head_dim in one power-of-two block."""
    return 16 <= d <= 256 and d & (d - 1) == 0


def merge_out_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attention results over disjoint key sets (online-softmax correction).

    out_* ``[total_q, num_heads_q, head_dim]``, lse_* ``[total_q, num_heads_q]``; the result is in lse's dtype.
    Rows whose lse is -inf contribute nothing (their out is ignored, even if it holds garbage); rows that are
    -inf in both stay out 0 / lse -inf. Differentiable, NaN-free on empty rows.
    """
    dt = lse_a.dtype
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    s = torch.exp(lse_a - m_safe) + torch.exp(lse_b - m_safe)
    pos = s > 0
    lse = torch.where(pos, m_safe + torch.log(torch.where(pos, s, torch.ones_like(s))), m)
    lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - lse_safe)[..., None]
    w_b = torch.exp(lse_b - lse_safe)[..., None]
    zero = torch.zeros((), dtype=dt, device=out_a.device)
    out = torch.where(torch.isneginf(lse_a)[..., None], zero, out_a.to(dt) * w_a) + torch.where(
        torch.isneginf(lse_b)[..., None], zero, out_b.to(dt) * w_b
    )
    return out, lse


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    softmax_scale: float | None,
    softcap: float,
) -> tuple[tuple[Slice, ...], float]:
    """Validate the common arguments of every entry point; return the non-empty slices and the scale."""
    validate_qkv(q, k, v)
    qr = as_ranges(q_ranges, "q_ranges", q.device)
    kr = as_ranges(k_ranges, "k_ranges", q.device)
    tm = as_type_map(attn_type_map, qr.shape[0], q.device)
    scale = validate_scalars(softmax_scale, softcap, q.shape[-1])
    return host_slices(qr, kr, tm, q.shape[0], k.shape[0]), scale
