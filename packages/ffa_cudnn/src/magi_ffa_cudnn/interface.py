"""The FFA contract on cuDNN's ``flex_attention``: slices -> row intervals -> ``mask_func`` -> cached mask plan.

This package provides only cuDNN's launchers and its capability; the contract itself (checks, autograd, out /
lse accumulation, sinks, max logits, empty rows, ``deterministic``) is ``magi_ffa.contract``'s, bound here as
:data:`BACKEND`. Forward and backward run cuDNN's CuTe DSL kernels through the frontend's reusable-plan
classes (``cudnn.flex_attention.execution``, what ``flex_attn_func`` runs beneath its autograd wrapper, so
that the backward can start from a FINAL out / lse merged over several calls), each plan keeping its launches
(:mod:`magi_ffa_cudnn._launch`: cuDNN's per-call host work once). The packed problem is one fixed-length
sample (BSHD with batch 1), so cuDNN's sample-local key intervals are our global ones. ``deterministic=True``
selects cuDNN's deterministic backward (bitwise repeatable on every mask), with its dQ write order rewritten
on sm90 so that bands and fragmented masks do not run their key blocks one after another
(:mod:`magi_ffa_cudnn._dq_order`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from magi_ffa.contract import BackendCapability, FFABackend, Launchers, register_backend
from magi_ffa.intervals import row_intervals
from magi_ffa.mask_cache import MASKS
from magi_ffa.validation import CheckedSlices, RangesLike, TypeMapLike

from . import env
from ._dq_order import reorder_deterministic_dq
from ._launch import BackwardLaunch, ForwardLaunch, layout_key
from .mask_func import mask_func_from_intervals

INSTALL_HINT = (
    "magi_ffa_cudnn needs cuDNN's flex_attention: nvidia-cudnn-frontend==1.32.0 with the CuTe DSL "
    '(nvidia-cutlass-dsl[cu13]), CUDA only. Install row "cudnn" (python scripts/install.py cudnn, '
    "docs/install.md: the runtime with magi-ffa-cudnn) pulls both; or install the two pinned names "
    'directly: `pip install nvidia-cudnn-frontend==1.32.0 "nvidia-cutlass-dsl[cu13]"`.'
)

__all__ = [
    "BACKEND",
    "CAPABILITY",
    "DETERMINISTIC_MAX_HEAD_DIM",
    "INSTALL_HINT",
    "CudnnMaskPlan",
    "clear_mask_plan_cache",
    "cudnn_available",
    "ffa_bwd",
    "ffa_fwd",
    "flex_flash_attn_func",
    "get_mask_plan",
    "head_dim_supported",
]

_FLEX = None


def _cudnn():
    """``cudnn.flex_attention`` (imported on first use; ImportError with the install hint without it); its
    ``execution`` and ``dispatch`` submodules hold the reusable-plan forward and backward and their launches."""
    global _FLEX
    if _FLEX is not None:
        return _FLEX
    try:
        import cudnn.flex_attention as flex
        from cudnn.flex_attention import dispatch, execution  # noqa: F401  (flex.execution, flex.dispatch)
    except (ImportError, OSError) as e:  # OSError: a frontend whose shared libraries do not load
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    _FLEX = flex
    return flex


def cudnn_available() -> bool:
    """True when cuDNN's flex_attention imports (says nothing about a usable GPU)."""
    try:
        _cudnn()
    except ImportError:
        return False
    return True


DETERMINISTIC_MAX_HEAD_DIM = 128
"""The runtime runs cuDNN's deterministic backward up to this head_dim. At 256, nvidia-cudnn-frontend 1.32.0's
deterministic dQ post-processing kernel fails to compile on some shapes ("`range_constexpr()` requires all
arguments to be Python integers", `backward_postprocess.py:299`): packed causal documents of 4,096 tokens, 8:2
heads, on an H200 (GPU suite of 2026-12-05), while masks of 700-2,048 tokens compiled and repeated their bits
(2026-12-03 and 2026-12-05). The failing shapes are not characterised beyond that, so deterministic mode refuses
d 256 (its default backward runs there; the kernel API itself accepts it)."""


def head_dim_supported(head_dim: int) -> bool:
    """cuDNN flex_attention 1.32.0 takes head dims that are multiples of 8 up to 128, and 256 (q, k, v equal)."""
    return (0 < head_dim <= 128 and head_dim % 8 == 0) or head_dim == 256


# --------------------------------------------------------------------------------------------- mask plans
@dataclass(frozen=True, slots=True)
class CudnnMaskPlan:
    """cuDNN's mask plan of one mask and geometry, with what the launchers need beside it.

    Attributes:
        mask_plan: ``cudnn.flex_attention.MaskPlan`` (forward and backward payloads).
        nfunc: endpoints per row of the ``mask_func`` it was built from.
        empty_rows: int64 indices on the device of the rows that see no key, or None when there are none
            (their out is set to 0 and lse to -inf after the kernel, whatever it left there: an index fill
            touches those rows only, not the whole output).
        build_seconds: host wall time of the build (intervals, mask_func and cuDNN's plan, synchronized).
        launches: the plan's launchers by layout and options (:mod:`magi_ffa_cudnn._launch`), built on first
            use: cuDNN's per-call host work done once; under ``"dq_order"``, whether the deterministic
            backward's dQ write order was rewritten (:mod:`magi_ffa_cudnn._dq_order`, before its first use).
    """

    mask_plan: object
    nfunc: int
    empty_rows: torch.Tensor | None
    build_seconds: float
    launches: dict = field(default_factory=dict, compare=False, repr=False)


MASKS.limit("cudnn", env.plan_cache_size())


def get_mask_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike = None,
) -> CudnnMaskPlan:
    """The cached cuDNN plan of this mask for q / k's geometry (heads, head_dim, dtype, sizes, device).

    A plan binds that geometry, so it is kept per geometry in the mask's entry of magi_ffa's one mask cache
    (``magi_ffa.mask_cache.MASKS``: found by the tables' identity, else their value; at most
    ``MAGI_FFA_CUDNN_PLAN_CACHE`` masks hold cuDNN plans); the deterministic flag is not part of it (cuDNN
    builds the ordered-reduction payload into the same plan where it needs one). It is the plan the
    contract's calls on q / k use, so a training step that re-plans the same slices costs a lookup.
    """
    checked = MASKS.lookup(
        (q_ranges, k_ranges, attn_type_map), total_q=q.shape[0], total_k=k.shape[0], device=q.device
    )
    return BACKEND.prepared(q, k, checked)


def _build_plan(q: torch.Tensor, k: torch.Tensor, checked: CheckedSlices) -> CudnnMaskPlan:
    """cuDNN's plan of the checked slices for q / k's geometry (the contract's ``prepare``; cached by it)."""
    flex = _cudnn()
    total_q, total_k = checked.total_q, checked.total_k
    t0 = time.perf_counter()
    qr, kr, tm = (t.to(q.device) for t in (checked.q_ranges, checked.k_ranges, checked.types))
    iv = row_intervals(qr, kr, tm, total_q, total_k)
    func = mask_func_from_intervals(iv)
    empty = iv.counts == 0
    # the plan reads only shapes, dtype and device of the sample tensors (it keeps no reference to them)
    qs = q.detach()[None]
    ks = k.detach()[None]
    plan = flex.create_mask_plan(func, qs, ks, ks, build_backward=True) if total_q and total_k else None
    empty_idx = empty.nonzero().flatten()
    torch.cuda.synchronize(q.device)
    rows = empty_idx if empty_idx.numel() else None
    return CudnnMaskPlan(plan, func.shape[1], rows, time.perf_counter() - t0)


def clear_mask_plan_cache() -> None:
    """Drop cuDNN's mask plans from the mask cache (frees the plans' device tensors; local to this process;
    ``magi_ffa.clear_mask_caches`` empties the whole cache)."""
    MASKS.drop("cudnn")


# ----------------------------------------------------------------------------------------------- kernels
def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when cuDNN's kernels can read it in place (last dim contiguous, 16-byte aligned pointer
    and strides), else a contiguous copy: cuDNN refuses other layouts rather than copying them itself."""
    step = max(1, 16 // t.element_size())
    aligned = (
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s == 0 or s % step == 0 for s in t.stride()[:-1])
    )
    return (
        t
        if aligned
        else t.contiguous()
        if t.data_ptr() % 16 == 0
        else t.clone(memory_format=torch.contiguous_format)
    )


def _forward(
    q, k, v, plan: CudnnMaskPlan, scale: float, softcap: float, want_max: bool, zero_empty: bool = True
):
    """cuDNN forward: out ``[total_q, hq, d]`` (q's dtype), lse fp32 ``[total_q, hq]`` (a transposed view),
    max logits fp32 ``[hq]`` or None. ``zero_empty=False`` leaves the out rows of rows that see no key as the
    kernel left them (lse -inf is still set): for a result only merged into an accumulator."""
    q4, k4, v4 = (_kernel_layout(t)[None] for t in (q, k, v))
    key = ("fwd", layout_key(q4, k4, v4), want_max)
    launch = plan.launches.get(key)
    if launch is None:
        launch = plan.launches[key] = ForwardLaunch(_cudnn(), plan.mask_plan, q4, k4, v4, want_max)
    out4, lse3, max_logit = launch(q4, k4, v4, scale)
    out, lse = out4[0], lse3[0]
    if plan.empty_rows is not None:
        if zero_empty:
            out.index_fill_(0, plan.empty_rows, 0.0)
        lse.index_fill_(1, plan.empty_rows, float("-inf"))
    return out, lse.t(), max_logit


def _backward(
    do, q, k, v, out, lse, plan: CudnnMaskPlan, scale: float, softcap: float, deterministic: bool, dlse
):
    """cuDNN backward from a (possibly merged) out / lse: dq, dk, dv in q's dtype."""
    q, k, v = (_kernel_layout(t) for t in (q, k, v))
    out = _kernel_layout(out.to(q.dtype))
    do = _kernel_layout(do.to(q.dtype))
    # A row whose FINAL lse is -inf sees no key in any call, so it is one of this call's empty rows: only then
    # +inf makes every P of its (masked) scores 0 inside a Partial tile instead of exp(-inf - -inf) = NaN.
    # Otherwise the forward's own [hq, total_q] buffer goes back as it is (lse is its transposed view).
    if plan.empty_rows is not None:
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
    tensors = {
        "q": q[None], "k": k[None], "v": v[None], "o": out[None], "do": do[None], "lse": lse.t()[None].contiguous(),
        "dlse": None if dlse is None else dlse.float().t()[None].contiguous(),
    }  # fmt: skip
    key = ("bwd", layout_key(*tensors.values()), scale, bool(deterministic))
    launch = plan.launches.get(key)
    if deterministic and "dq_order" not in plan.launches:  # once per plan, before its first ordered backward
        plan.launches["dq_order"] = reorder_deterministic_dq(plan.mask_plan)
    if launch is None:
        sample = {**tensors, "dq": torch.empty_like(tensors["q"]), "dk": torch.empty_like(tensors["k"]),
                  "dv": torch.empty_like(tensors["v"])}  # fmt: skip
        launch = plan.launches[key] = BackwardLaunch(_cudnn(), plan.mask_plan, sample, bool(deterministic))
    dq, dk, dv = launch(tensors, scale)
    return dq[0], dk[0], dv[0]


CAPABILITY = BackendCapability(
    dtypes=(torch.float16, torch.bfloat16),
    head_dim_ok=head_dim_supported,
    head_dim_rule="a multiple of 8 up to 128, or 256",
    name="cudnn",
    title="cuDNN",
    package="magi_ffa_cudnn",
    architectures=(9, 10),  # cuDNN flex_attention 1.32.0 ships kernels for sm90 and sm100 / sm103
    architecture_names="Hopper (sm90) or Blackwell (sm100/sm103)",
    softcap=False,
    softcap_hint="use magi_ffa or magi_ffa_fa4 for soft-capped attention",
    max_logits=True,
    install_check=lambda: _cudnn(),
    # read from the installed metadata, never imported, when a process asks whether it could run cuDNN
    requires=(("nvidia-cudnn-frontend", "cudnn"), ("nvidia-cutlass-dsl", "cutlass")),
    install_hint='install row "cudnn": python scripts/install.py cudnn, docs/install.md',
    priority=10,  # auto picks cuDNN by its measured table; without a row, after FA4 and Triton
    deterministic_head_dim=lambda head_dim: head_dim <= DETERMINISTIC_MAX_HEAD_DIM,
)
"""cuDNN's capability: fp16/bf16, head_dim a multiple of 8 up to 128 or 256, sm90/sm100, no softcap, max logits
from the kernel, deterministic on every mask (its deterministic backward)."""

BACKEND = register_backend(FFABackend(CAPABILITY, Launchers(_forward, _backward, _build_plan)))
"""The FFA contract bound to cuDNN's launchers."""

flex_flash_attn_func, ffa_fwd, ffa_bwd = BACKEND.entry_points
