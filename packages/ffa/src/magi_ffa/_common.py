"""Shared types, input validation and slice geometry for every backend.

Glossary (used in every docstring of this package):

- ``total_q`` / ``total_k``: number of query / key tokens (packed, no batch axis).
- ``num_heads_q`` / ``num_heads_kv``: query / key-value heads, ``num_heads_q % num_heads_kv == 0`` (GQA/MQA).
- ``head_dim``: the per-head feature size, equal for q, k and v.
- slice ``i``: query rows ``[q_ranges[i, 0], q_ranges[i, 1])`` attend to key rows ``[k_ranges[i, 0],
  k_ranges[i, 1])`` with the shape ``attn_type_map[i]`` (see ``magi_mask.AttnMaskType``). The mask is the union of
  the slices: slices may share query rows, key rows, and even (query, key) pairs; slices that share pairs
  are rewritten once per mask into disjoint ones (``_disjoint.py``), so every pair counts once.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from magi_mask import as_int_pairs, normalize_types, validate_slices

from . import env
from ._disjoint import disjoint_slices
from ._slice import Slice, make_slice

RangesLike = torch.Tensor | Sequence[Sequence[int]]
TypeMapLike = torch.Tensor | Sequence[int | str] | int | str | None


class KernelBackend(enum.StrEnum):
    """Which implementation of the FFA kernel runs: the one kernel-backend enum of every package.

    magi_ffa's own functions run ``TRITON`` and ``TORCH`` (``MAGI_FFA_BACKEND`` forces one, else it follows
    the device and dtype); the runtime (``magi_attention.config.KernelBackend``, this same class) also runs
    ``FA4`` and ``CUDNN`` through the packages above this one and resolves ``AUTO`` per key. It lives here,
    the lowest package that runs a kernel, so that magi_ffa needs no import of the runtime."""

    AUTO = "auto"
    """Among the backends every rank can run, the fastest for the key's mask by the shipped table of measured
    kernel times of rank 0's GPU kind (``magi_solver.kernel_choice``); without a table (or a row for the
    head_dim) FA4 when it runs on every rank, else Triton on CUDA GPUs, else torch. Refined per call by dtype
    and softcap; ``get_kernel_backend(key)`` says which and why. (The runtime's choice only.)"""
    FA4 = "fa4"
    """magi_ffa_fa4: FlashAttention-4's CuTe DSL kernels (fp16/bf16, head_dim <= 128, Hopper/Blackwell)."""
    CUDNN = "cudnn"
    """magi_ffa_cudnn: cuDNN's flex_attention kernels (fp16/bf16, head_dim a multiple of 8 up to 128 or 256,
    no softcap, Hopper/Blackwell). Chosen only when asked for (``auto`` does not pick it)."""
    TRITON = "triton"
    """magi_ffa's Triton kernels (fp16/bf16/fp32, power-of-two head_dim 16..256, any CUDA GPU)."""
    TORCH = "torch"
    """magi_ffa's blockwise torch path (any device and dtype, fp64 included; slow)."""


# the members magi_ffa's own functions run (the others are the runtime's)
_FFA_BACKENDS = (KernelBackend.TRITON, KernelBackend.TORCH)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def ranges_structure(x: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """The checks of :func:`as_ranges` that read no values (dtype, shape, device): ``x`` as ``[n, 2]``."""
    if x.dtype not in (torch.int32, torch.int64):
        _fail(f"`{name}` must be an int32 tensor of shape [num_slices, 2], got dtype {x.dtype}")
    if x.ndim != 2 or x.shape[1] != 2:
        if not (x.ndim == 1 and x.numel() == 0):
            _fail(f"`{name}` must have shape [num_slices, 2], got {tuple(x.shape)}")
        x = x.reshape(0, 2)
    if x.device != device and x.device.type != "cpu":
        _fail(f"`{name}` must be on q's device {device} (or the CPU), got {x.device}")
    return x


def as_ranges(x: RangesLike, name: str, device: torch.device) -> torch.Tensor:
    """Return ``x`` as an int32 ``[n, 2]`` tensor (tensors keep their device; lists become CPU tensors)."""
    if isinstance(x, torch.Tensor):
        x = ranges_structure(x, name, device)
        _check_fits_int32(x, name)
        return x.to(torch.int32)
    t = torch.tensor(as_int_pairs(x, name), dtype=torch.int64).reshape(-1, 2)
    if t.numel() and (t.min() < torch.iinfo(torch.int32).min or t.max() > torch.iinfo(torch.int32).max):
        _fail(f"`{name}` values must fit int32")
    return t.to(torch.int32)  # lists stay on the CPU: no host<->device round trip


def type_map_structure(x: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """The checks of :func:`as_type_map` on a tensor that read no values (dtype, shape, device)."""
    if x.dtype not in (torch.int32, torch.int64):
        _fail(f"`attn_type_map` must be an int32 tensor of shape [num_slices], got dtype {x.dtype}")
    if x.ndim != 1 or x.shape[0] != n:
        _fail(f"`attn_type_map` must have shape [{n}] (one type per slice), got {tuple(x.shape)}")
    if x.device != device and x.device.type != "cpu":
        _fail(f"`attn_type_map` must be on q's device {device} (or the CPU), got {x.device}")
    return x


def as_type_map(x: TypeMapLike, n: int, device: torch.device) -> torch.Tensor:
    """Return ``attn_type_map`` as an int32 ``[n]`` tensor (``None`` means all FULL); a tensor keeps its
    device, as in :func:`as_ranges` (the slices are read on the host: a CPU table moved to the GPU and back
    would make every call wait for the kernels queued before it).

    Besides int tensors it takes what every magi boundary takes (``magi_mask.normalize_types``): one type
    for all slices or one per slice, each an ``AttnMaskType``, a name ("causal") or an int code.
    """
    if x is None:
        return torch.zeros(n, dtype=torch.int32)  # CPU: read on the host anyway
    if not isinstance(x, torch.Tensor):
        return torch.tensor(normalize_types(x, n, "attn_type_map"), dtype=torch.int32).reshape(n)
    x = type_map_structure(x, n, device)
    _check_fits_int32(x, "attn_type_map")
    return x.to(torch.int32)


def host_tables(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three tables as contiguous int32 CPU tensors, every check but the values' made (the messages of
    :func:`as_ranges` / :func:`as_type_map`; tensors may live on ``device`` or the CPU). Tensors on a GPU
    reach the host in ONE copy (the three concatenated), and the int32 range check of int64 tables runs on
    the host copy: a new mask costs one device->host synchronization, not one per table and check."""
    qr = ranges_structure(q_ranges, "q_ranges", device) if isinstance(q_ranges, torch.Tensor) else q_ranges
    kr = ranges_structure(k_ranges, "k_ranges", device) if isinstance(k_ranges, torch.Tensor) else k_ranges
    tm = attn_type_map
    if isinstance(tm, torch.Tensor) and isinstance(qr, torch.Tensor):
        tm = type_map_structure(tm, qr.shape[0], device)
    raw = [qr, kr, tm]
    remote = [i for i, t in enumerate(raw) if isinstance(t, torch.Tensor) and t.device.type != "cpu"]
    if remote:
        flat = torch.cat([raw[i].reshape(-1).to(torch.int64) for i in remote]).cpu()  # the one copy
        for i, part in zip(remote, flat.split([raw[i].numel() for i in remote])):
            raw[i] = part.view(raw[i].shape)
    qr = as_ranges(raw[0], "q_ranges", torch.device("cpu")).contiguous()
    kr = as_ranges(raw[1], "k_ranges", torch.device("cpu")).contiguous()
    tm = as_type_map(raw[2], qr.shape[0], torch.device("cpu")).contiguous()
    return qr, kr, tm


def _check_fits_int32(x: torch.Tensor, name: str) -> None:
    """int64 values outside int32 would wrap in the int32 cast (`[0, 2**32 + 8)` would run as `[0, 8)`)."""
    if x.dtype != torch.int64 or x.numel() == 0:
        return
    lo, hi = torch.aminmax(x)  # one host sync for int64 tensors only; int32 ones are the fast path
    lo, hi = int(lo), int(hi)
    info = torch.iinfo(torch.int32)
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        _fail(
            f"`{name}` holds {bad}, which does not fit int32 (the kernels' index type); values must lie in "
            f"[{info.min}, {info.max}]"
        )


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
    packed = torch.frombuffer(bytearray(blob), dtype=torch.int32).reshape(n, 5)
    raw = validate_slices(
        packed[:, 0:2].tolist(), packed[:, 2:4].tolist(), packed[:, 4].tolist(), total_q, total_k,
        allow_empty=True, type_name="attn_type_map",
    )  # fmt: skip
    out = tuple(s for s in (make_slice(*r) for r in raw) if s is not None)
    return disjoint_slices(out)


@dataclass(frozen=True, slots=True, weakref_slot=True)
class CheckedSlices:
    """Slice tables checked once, by :func:`check_slices`, against the token counts they index: the internal
    entry of a caller that launches the same slices many times (the attention runtime checks its plan's
    slices when it builds their tensors). ``_ops.ffa_fwd_checked`` / ``ffa_bwd_checked`` take them in place of
    the three tables and only compare the counts with q and k; ``ffa_fwd`` / ``ffa_bwd`` check every call."""

    slices: tuple[Slice, ...]
    total_q: int
    total_k: int
    q_ranges: torch.Tensor | None = None
    """The checked tables themselves (int32 CPU tensors), for backends whose launch data is built from them."""
    k_ranges: torch.Tensor | None = None
    types: torch.Tensor | None = None
    prepared: dict = field(default_factory=dict, compare=False, repr=False)
    """Per-backend launch data of these slices (``magi_ffa.contract``: FA4's launch metadata, cuDNN's mask
    plan), built on first use: a plan's slices launched many times build it once."""


def slices_on_device(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three slice tables as contiguous int32 tensors on ``device`` (shapes and dtypes checked, values
    not: :func:`check_slice_values` does that). Tensors on another device are moved through the host, for the
    metadata builders that compute on one device whatever the caller passed."""

    def host(x):
        return x.cpu() if isinstance(x, torch.Tensor) and x.device != device else x

    qr = as_ranges(host(q_ranges), "q_ranges", device).to(device).contiguous()
    kr = as_ranges(host(k_ranges), "k_ranges", device).to(device).contiguous()
    tm = as_type_map(host(attn_type_map), qr.shape[0], device).to(device).contiguous()
    return qr, kr, tm


def check_slice_values(
    q_ranges: torch.Tensor, k_ranges: torch.Tensor, type_map: torch.Tensor, total_q: int, total_k: int
) -> None:
    """Raise ValueError naming the first bad slice or size (:func:`host_slices`, cached by value)."""
    if not isinstance(total_q, int) or not isinstance(total_k, int) or total_q < 0 or total_k < 0:
        _fail(f"`total_q` and `total_k` must be ints >= 0, got {total_q!r} and {total_k!r}")
    host_slices(q_ranges.cpu(), k_ranges.cpu(), type_map.cpu(), total_q, total_k)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator / lse dtype: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def validate_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dtypes: tuple[torch.dtype, ...] = _FLOAT_DTYPES
) -> None:
    """Check q ``[total_q, num_heads_q, head_dim]`` and k, v ``[total_k, num_heads_kv, head_dim]``, of one of
    ``dtypes`` (a backend with fewer dtypes passes its own)."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            _fail(f"`{name}` must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            _fail(f"`{name}` dtype must be {allowed}, got {t.dtype}")
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
    if (
        isinstance(softmax_scale, bool)
        or not isinstance(softmax_scale, int | float)
        or not 0 < softmax_scale <= _FP32_MAX
    ):
        _fail(
            f"`softmax_scale` must be a positive finite float (at most {_FP32_MAX:.3g}, the fp32 range the "
            f"kernels compute in) or None, got {softmax_scale!r}"
        )
    if isinstance(softcap, bool) or not isinstance(softcap, int | float) or not 0 <= softcap <= _FP32_MAX:
        _fail(f"`softcap` must be a finite float >= 0 (0 disables), got {softcap!r}")
    return float(softmax_scale)


_FP32_MAX = float(torch.finfo(torch.float32).max)


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


def validate_bwd_inputs(
    do: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
) -> None:
    """Check the backward's ``do`` (q's shape, dtype, device), the final ``out`` / ``lse`` and the optional
    gradient accumulators (after :func:`validate_qkv`)."""
    if out is None or lse is None:
        _fail("`out` and `lse` (the final forward results) are required by the backward")
    validate_out_lse(out, lse, q)
    if (
        not isinstance(do, torch.Tensor)
        or do.shape != q.shape
        or do.dtype != q.dtype
        or do.device != q.device
    ):
        _fail(f"`do` must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    validate_grad_buffers(dq, dk, dv, q, k)


def validate_dlse(dlse: torch.Tensor | None, lse: torch.Tensor) -> None:
    """``dlse`` (the gradient of the final lse) must be None or a tensor of lse's shape on lse's device."""
    if dlse is None:
        return
    if not isinstance(dlse, torch.Tensor) or dlse.shape != lse.shape or dlse.device != lse.device:
        _fail(f"`dlse` must be a tensor of lse's shape {tuple(lse.shape)} on {lse.device}")


def backend_for(q: torch.Tensor) -> KernelBackend:
    """Pick the backend: ``MAGI_FFA_BACKEND`` if set, else triton for CUDA fp16/bf16 and torch otherwise."""
    forced = env.backend()  # ValueError naming MAGI_FFA_BACKEND for anything but triton / torch
    if forced:
        return KernelBackend(forced)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and triton_head_dim_ok(q.shape[-1]):
        return KernelBackend.TRITON
    return KernelBackend.TORCH


def resolve_backend(q: torch.Tensor, backend: KernelBackend | str | None) -> KernelBackend:
    """An explicit ``backend`` argument wins over ``MAGI_FFA_BACKEND`` and the default of :func:`backend_for`."""
    if backend is None:
        return backend_for(q)
    try:
        chosen = KernelBackend(str(backend).strip().lower())
    except ValueError:
        chosen = None
    if chosen not in _FFA_BACKENDS:
        _fail(f"`backend` must be 'triton', 'torch' or None, got {backend!r}")
    return chosen


def triton_head_dim_ok(d: int) -> bool:
    """The Triton kernels tile head_dim in one power-of-two block."""
    return 16 <= d <= 256 and d & (d - 1) == 0
