"""The vendors' own attention calls on a mask of slices, the baselines ``python -m magi_attention.info
--bench`` and ``benchmarks/`` time our backends against: FlashAttention-4's ``flash_attn_func`` /
``flash_attn_varlen_func``, cuDNN's ``flex_attn_func`` (one BSHD sample, or THD with one sample per document)
and PyTorch's SDPA with its cuDNN or flash backend, and PyTorch's FlexAttention, for the masks each can
express.

Tensors are packed ``[tokens, heads, head_dim]`` (magi-attention's layout). Each ``*_call`` builds what the
vendor needs once (block masks, mask plans, cu_seqlens: outside any timing) and returns ``(fn, leaves)``:
``fn() -> out [tokens, heads_q, head_dim]`` (FlexAttention and SDPA: ``[1, heads_q, tokens, head_dim]``) with
autograd to the returned leaf tensors. Where the per-mask work itself is measured, the parts are separate:
``fa4_local`` (cu_seqlens built, then a call on any q / k / v), ``cudnn_mask_plan`` then
``cudnn_flex_attn``. A mask a vendor cannot express, or a vendor that is not installed, raises
:class:`VendorUnavailable` saying why.

Every vendor module is imported inside the function that uses it (through magi_ffa_fa4 / magi_ffa_cudnn
first, so their compile caches are set up): ``import magi_attention.vendors`` imports no ``flash_attn``,
``cudnn``, ``cutlass``, ``quack``, ``torch._dynamo`` or ``torch._inductor`` and works on any machine.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = [
    "SliceMask",
    "VendorCall",
    "VendorUnavailable",
    "cudnn_flex_attn",
    "cudnn_flex_call",
    "cudnn_mask_plan",
    "cudnn_varlen_call",
    "fa4_call",
    "fa4_local",
    "flex_attention_call",
    "import_vendor",
    "sdpa_call",
    "standard_masks",
]

Ranges = Sequence[Sequence[int]]
VendorCall = tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...]]
"""``(fn, leaf inputs)``: ``fn()`` runs the forward; gradients flow to the leaves."""


class VendorUnavailable(Exception):
    """This vendor cannot run this case here; the message says why (missing package, mask not expressible)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceMask:
    """A mask over ``total`` tokens (self-attention): slices ``(q_ranges[i], k_ranges[i], types[i])``, types 0
    FULL, 1 CAUSAL (bottom-right aligned), 2 INV_CAUSAL, 3 BI_CAUSAL (magi-attention's convention).
    ``window``: when set, the mask is also causal sliding-window attention over the whole sequence, row q
    seeing keys ``q - window .. q`` (how FA4 and FlexAttention express it)."""

    q_ranges: tuple[tuple[int, int], ...]
    k_ranges: tuple[tuple[int, int], ...]
    types: tuple[int, ...]
    total: int
    name: str = ""
    window: int | None = None

    @classmethod
    def of(
        cls, q_ranges: Ranges, k_ranges: Ranges, types: Sequence[int], total: int, **kw: object
    ) -> SliceMask:
        return cls(
            q_ranges=tuple((int(a), int(b)) for a, b in q_ranges),
            k_ranges=tuple((int(a), int(b)) for a, b in k_ranges),
            types=tuple(int(t) for t in types),
            total=int(total),
            **kw,
        )

    def dense_causal(self) -> bool | None:
        """True / False when the mask is causal / full over the whole square; None otherwise."""
        whole = ((0, self.total),)
        if self.q_ranges == whole and self.k_ranges == whole and self.types in ((0,), (1,)):
            return self.types == (1,)
        return None

    def varlen(self) -> tuple[list[int], bool] | None:
        """``(cu_seqlens, causal)`` when the mask is packed documents (diagonal squares tiling the sequence
        in order, all FULL or all CAUSAL); None otherwise."""
        if not self.q_ranges or self.q_ranges != self.k_ranges or len(set(self.types)) != 1:
            return None
        if self.types[0] not in (0, 1):
            return None
        cu = [0]
        for a, b in self.q_ranges:
            if a != cu[-1] or b <= a:
                return None
            cu.append(b)
        return (cu, self.types[0] == 1) if cu[-1] == self.total else None

    def slices(self) -> list[tuple[int, int, int, int, int]]:
        """``(q_start, q_end, k_start, k_end, type)`` per slice (``magi_solver.kernel_choice``'s form)."""
        return [(*q, *k, t) for q, k, t in zip(self.q_ranges, self.k_ranges, self.types, strict=True)]

    def area(self) -> int:
        """Visible (q, k) pairs: the FLOP count's base (slices do not overlap in the standard masks)."""
        from magi_solver.kernel_choice import mask_features

        return mask_features(self.slices(), self.total).area


def standard_masks(total: int, window: int = 1024) -> list[SliceMask]:
    """The masks of ``info --bench``: ``causal``; ``docs``, packed causal documents (lengths cycling
    1/8, 1/4, 1/16, 1/16 of ``total``: a mix of long and short ones); ``window``, causal sliding window of
    ``window`` keys before each query."""
    from magi_solver import make_sliding_window_mask

    if total % 16:
        raise ValueError(f"total must be a multiple of 16, got {total}")
    lengths = []
    for f in itertools.cycle((8, 4, 16, 16)):
        n = min(total // f, total - sum(lengths))
        if n <= 0:
            break
        lengths.append(n)
    cu = list(itertools.accumulate(lengths, initial=0))
    docs = [(a, b) for a, b in itertools.pairwise(cu)]
    spec = make_sliding_window_mask([0, total], (window, 0))
    return [
        SliceMask.of([(0, total)], [(0, total)], [1], total, name="causal"),
        SliceMask.of(docs, docs, [1] * len(docs), total, name="docs"),
        SliceMask.of(
            [(r.start, r.end) for r in spec.q_ranges],
            [(r.start, r.end) for r in spec.k_ranges],
            [int(t) for t in spec.types],
            total,
            name="window",
            window=window,
        ),
    ]


def import_vendor(name: str, what: str) -> ModuleType:
    """``importlib.import_module(name)``, VendorUnavailable (with ``what``) when it does not import. Our
    backend package of the vendor is imported first, so its compile cache is on before the vendor loads."""
    first = {"flash_attn": "magi_ffa_fa4", "cudnn": "magi_ffa_cudnn"}.get(name.split(".")[0])
    try:
        if first is not None:
            importlib.import_module(first)
        return importlib.import_module(name)
    except ImportError as exc:  # also a broken install (e.g. a CuTe DSL library missing)
        raise VendorUnavailable(f"{what} not importable: {exc}") from None


def _first(out):
    """FA4 returns out or (out, lse, ...) depending on the version and flags."""
    return out[0] if isinstance(out, tuple | list) else out


def fa4_local(
    mask: SliceMask, device: torch.device, fa: ModuleType | None = None
) -> tuple[Callable[..., torch.Tensor], str]:
    """``(attn(q, k, v) -> out, label)``: FlashAttention-4's native call for ``mask`` on packed
    ``[tokens, heads, head_dim]`` tensors (``flash_attn_func`` for full / causal / a causal window,
    ``flash_attn_varlen_func`` for packed documents); ``fa`` = the ``flash_attn.cute`` module (imported when
    None)."""
    causal = mask.dense_causal()
    varlen = mask.varlen() if causal is None else None
    if causal is None and varlen is None and mask.window is None:
        raise VendorUnavailable(
            "mask not expressible: FA4 takes full / causal, a causal window, or packed documents "
            "(cu_seqlens) all full or all causal"
        )
    fa = fa if fa is not None else import_vendor("flash_attn.cute", "flash_attn.cute (FlashAttention-4)")
    if causal is not None or varlen is None:
        window = (mask.window, 0) if causal is None else None
        kw = {"causal": True, "window_size": window} if window else {"causal": causal}

        def dense(q, k, v):
            return _first(fa.flash_attn_func(q[None], k[None], v[None], **kw))[0]

        what = "causal" if causal else "full" if causal is not None else f"window {mask.window}"
        return dense, f"FA4 flash_attn_func ({what})"
    cu_list, causal = varlen
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in itertools.pairwise(cu_list))

    def packed(q, k, v):
        return _first(
            fa.flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                causal=causal,
            )
        )  # fmt: skip

    docs = f"{len(cu_list) - 1} docs{', causal' if causal else ''}"
    return packed, f"FA4 flash_attn_varlen_func ({docs})"


def _leaves(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.detach().requires_grad_() for x in xs)


def fa4_call(mask: SliceMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> VendorCall:
    """FlashAttention-4's native call (``fa4_local``) on fresh leaves of ``q``, ``k``, ``v``."""
    attn, _ = fa4_local(mask, q.device)
    leaves = _leaves(q, k, v)
    return (lambda: attn(*leaves)), leaves


def _cudnn_flex() -> ModuleType:
    return import_vendor("cudnn.flex_attention", "cudnn.flex_attention (nvidia-cudnn-frontend)")


def cudnn_mask_plan(mask: SliceMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
    """cuDNN's mask plan (forward and backward) of ``mask`` for packed ``[tokens, heads, head_dim]`` inputs of
    ``q``'s, ``k``'s and ``v``'s shapes and dtype, the problem as one BSHD sample: the mask becomes magi_ffa's
    per-row key intervals (on ``q``'s device), turned into cuDNN's ``mask_func``. This is cuDNN's per-mask
    work; the plan serves every later call of those shapes (``cudnn_flex_attn``)."""
    flex = _cudnn_flex()
    from magi_ffa_cudnn import mask_func_from_intervals

    from magi_ffa.intervals import row_intervals

    def table(rows):
        return torch.tensor(rows, dtype=torch.int32, device=q.device).reshape(-1, 2)

    types = torch.tensor(mask.types, dtype=torch.int32, device=q.device)
    iv = row_intervals(table(mask.q_ranges), table(mask.k_ranges), types, mask.total, mask.total)
    q4, k4, v4 = (x[None] for x in (q, k, v))  # as the calls will pass them (the plan records their layout)
    return flex.create_mask_plan(mask_func_from_intervals(iv), q4, k4, v4, build_backward=True)


def cudnn_flex_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object) -> torch.Tensor:
    """cuDNN's own ``flex_attn_func`` on packed ``[tokens, heads, head_dim]`` q / k / v (one BSHD sample) with
    a plan of ``cudnn_mask_plan``: out ``[tokens, heads_q, head_dim]``, differentiable in q, k, v."""
    flex = _cudnn_flex()
    return _first(flex.flex_attn_func(q[None], k[None], v[None], mask_plan=plan))[0]


def cudnn_flex_call(mask: SliceMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> VendorCall:
    """cuDNN's own ``flex_attn_func`` on fresh leaves of ``q``, ``k``, ``v``, its mask plan
    (``cudnn_mask_plan``) built here."""
    leaves = _leaves(q, k, v)
    plan = cudnn_mask_plan(mask, *leaves)
    return (lambda: cudnn_flex_attn(*leaves, plan)), leaves


def cudnn_varlen_call(mask: SliceMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> VendorCall:
    """cuDNN's own ``flex_attn_func`` on the THD layout for packed documents (``SliceMask.varlen``): one
    sample per document (cu_seqlens), each row's key end local to its document, the plan built here."""
    flex = _cudnn_flex()
    varlen = mask.varlen()
    if varlen is None:
        raise VendorUnavailable("mask not expressible: cuDNN's THD path here takes packed documents only")
    cu_list, causal = varlen
    cu = torch.tensor(cu_list, dtype=torch.int32, device=q.device)
    lengths = cu.diff()
    longest = int(lengths.max())
    pos = torch.arange(mask.total, device=q.device) - torch.repeat_interleave(cu[:-1], lengths)
    end = pos + 1 if causal else torch.repeat_interleave(lengths, lengths)
    func = end.to(torch.int32).reshape(1, 1, mask.total).contiguous()
    leaves = _leaves(q, k, v)
    plan = flex.create_mask_plan(func, *leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                 max_seqlen_k=longest, build_backward=True)  # fmt: skip
    return (lambda: _first(flex.flex_attn_func(*leaves, mask_plan=plan))), leaves


def sdpa_call(
    mask: SliceMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "cudnn"
) -> VendorCall:
    """PyTorch's ``scaled_dot_product_attention`` restricted to one backend (``"cudnn"`` or ``"flash"``) for a
    full or causal mask (``SliceMask.dense_causal``), on ``[1, heads, tokens, head_dim]`` leaves."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    if backend not in backends:
        raise ValueError(f"backend must be one of {sorted(backends)}, got {backend!r}")
    causal = mask.dense_causal()
    if causal is None:
        raise VendorUnavailable("mask not expressible: SDPA takes a full or causal mask")
    gqa = q.shape[1] != k.shape[1]
    qb, kb, vb = (x.detach().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))  # [1, h, S, d]

    def fn() -> torch.Tensor:
        with sdpa_kernel([backends[backend]]):
            return scaled_dot_product_attention(qb, kb, vb, is_causal=causal, enable_gqa=gqa)

    return fn, (qb, kb, vb)


_FLEX: dict[str, Callable] = {}


def flex_attention_call(mask: SliceMask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> VendorCall:
    """PyTorch's FlexAttention (``torch.compile``-d, one block mask built here) for causal, packed causal
    documents and causal windows."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    causal, varlen, window = mask.dense_causal(), mask.varlen(), mask.window
    if "fn" not in _FLEX:
        # (imported under its own name: `import torch._dynamo` would make `torch` local to this function)
        from torch._dynamo import config as dynamo_config

        # one compiled kernel per mask and shape: raise the limits or Flex falls back to an eager O(N^2) path
        dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 256)
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    if causal is not None:
        mod = None if not causal else (lambda b, h, qi, ki: qi >= ki)
    elif window is not None:
        mod = lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= window)  # noqa: E731
    elif varlen is not None:
        cu, is_causal = varlen
        doc = torch.repeat_interleave(
            torch.arange(len(cu) - 1, device=q.device), torch.tensor(cu, device=q.device).diff()
        )

        def mod(b, h, qi, ki):
            same = doc[qi] == doc[ki]
            return same & (qi >= ki) if is_causal else same
    else:
        raise VendorUnavailable("mask not expressible here: FlexAttention runs causal, documents, windows")
    s = mask.total
    block = None if mod is None else create_block_mask(mod, 1, 1, s, s, device=q.device)
    gqa = q.shape[1] != k.shape[1]
    qb, kb, vb = (x.detach().transpose(0, 1)[None].requires_grad_() for x in (q, k, v))  # [1, h, S, d]
    fn = _FLEX["fn"]
    return (lambda: fn(qb, kb, vb, block_mask=block, enable_gqa=gqa)[0].transpose(0, 1)), (qb, kb, vb)
