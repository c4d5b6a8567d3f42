"""The FFA contract, written once, for every kernel backend.

A backend is a :class:`BackendCapability` (what it accepts: dtypes, head dims, GPU architectures, softcap,
whether its forward reports max logits, on which masks it is deterministic, the device it needs) and its
:class:`Launchers` (the kernels, called on CHECKED slices only: no argument checks inside).
:class:`FFABackend` binds the two and provides everything else, once:

- the argument checks (ValueError / TypeError naming the argument and the backend, before any kernel starts);
- the autograd path: the ``torch.library`` custom ops ``magi_ffa::fwd`` / ``magi_ffa::bwd``, generic over the
  registered backends (so ``torch.compile`` traces every backend's ``flex_flash_attn_func``);
- the out / lse accumulation (:func:`~magi_ffa.merge_out_lse`, :func:`~magi_ffa.merge_out_lse_`), the
  attention sinks (:func:`~magi_ffa.merge_sink`, :func:`~magi_ffa.sink_grad`), the max logits (the kernel's
  own, or a separate QK pass on magi_ffa's Triton kernel when the capability says the kernel has none), empty
  inputs and empty rows, the ``dlse`` handling and the ``deterministic`` flag;
- the public functions ``flex_flash_attn_func`` / ``ffa_fwd`` / ``ffa_bwd`` of each package
  (:func:`public_functions`: one template each, so ``inspect.signature`` shows every parameter of every
  backend and no package writes the parameter list again);
- the runtime's entry on slices checked once per plan: :meth:`FFABackend.fwd_checked` /
  :meth:`FFABackend.bwd_checked` (no value checks of the slice tables, no host sync, the per-mask launch data
  of :meth:`Launchers.prepare` kept in the mask's entry of :data:`magi_ffa.mask_cache.MASKS`).

The public functions find a mask's entry with one lookup (the tables' identity and version, else their
value); the eager path then carries one frozen :class:`~magi_ffa._call.FFACall` to the forward and backward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import env
from ._call import BwdIO, FFACall, Options, checked_of
from ._common import (
    CheckedSlices,
    RangesLike,
    TypeMapLike,
    acc_dtype,
    as_ranges,
    as_type_map,
    validate_bwd_inputs,
    validate_dlse,
    validate_out_lse,
    validate_qkv,
    validate_scalars,
)
from ._docstrings import (
    _BACKEND_ARG,
    _BWD_ARGS,
    _BWD_TAIL,
    _FLEX_RETURNS,
    _FWD_ARGS,
    _FWD_RETURNS,
    _SHARED_ARGS,
)
from ._eager import EagerAttention
from ._merge import merge_out_lse, merge_out_lse_
from ._sink import merge_sink, sink_grad, validate_sink
from .availability import cuda_arch_major, missing_distributions
from .mask_cache import MASKS

__all__ = [
    "BackendCapability",
    "FFABackend",
    "Launchers",
    "always_deterministic",
    "get_backend",
    "public_functions",
    "register_backend",
]


def always_deterministic(checked: CheckedSlices) -> bool:
    """The determinism predicate of a backend whose forward and backward are bitwise repeatable on every
    mask."""
    return True


@dataclass(frozen=True)
class BackendCapability:
    """What one kernel backend accepts; the contract's argument checks read it.

    Attributes:
        name: the backend's name in the runtime (``"triton"``, ``"torch"``, ``"fa4"``, ``"cudnn"``).
        title: how messages name it (``"FA4"``, ``"cuDNN"``, ...).
        package: the package that provides it (messages, e.g. ``"magi_ffa_fa4"``).
        dtypes: the q / k / v dtypes it takes.
        head_dim_ok: predicate on ``head_dim``.
        head_dim_rule: the rule in words, for the message (``"a multiple of 8 and at most 128"``).
        architectures: CUDA compute-capability majors it runs on, or ``"any"``.
        architecture_names: those majors in words (``"Hopper (sm90) or Blackwell (sm100/sm110)"``).
        softcap: whether it soft-caps scores (``softcap > 0``).
        softcap_hint: what to use instead when it does not.
        max_logits: whether its forward reports the max logits (else a separate QK pass computes them).
        deterministic: predicate on the checked slices: True where its forward and backward are bitwise
            repeatable (``deterministic=True`` is refused, before any kernel starts, where it is False).
        nondeterministic_masks: the masks the predicate refuses, in words (the refusal names them).
        device: ``"cuda"`` (CUDA tensors only), ``"cuda_or_interpret"`` (CUDA, or the CPU under
            ``TRITON_INTERPRET=1``) or ``"any"``.
        accumulates: its launchers accumulate into caller-given out / lse and dq / dk / dv in the kernel (else
            the contract merges and adds).
        install_check: called first by every public function; raises ImportError saying what to install when
            the kernel library is missing (None: nothing to import).
        requires: ``(distribution, module)`` pairs the backend needs installed, e.g. ``("flash-attn-4",
            "flash_attn")``: :meth:`missing` reads them without importing anything.
        install_hint: what to install when one of ``requires`` is missing (messages).
        priority: ``auto``'s order where its measured table has no row (the highest available wins; the
            torch reference, 0, takes what no other backend can).
        deterministic_head_dim: predicate on ``head_dim``: whether the runtime may run the backend's backward
            deterministically there (with :attr:`deterministic` on the slices: :meth:`deterministic_at`).
    """

    name: str
    title: str
    package: str
    dtypes: tuple[torch.dtype, ...]
    head_dim_ok: Callable[[int], bool]
    head_dim_rule: str
    architectures: tuple[int, ...] | str = "any"
    architecture_names: str = ""
    softcap: bool = True
    softcap_hint: str = ""
    max_logits: bool = True
    deterministic: Callable[[CheckedSlices], bool] = always_deterministic
    nondeterministic_masks: str = ""
    device: str = "cuda"
    accumulates: bool = False
    install_check: Callable[[], object] | None = None
    requires: tuple[tuple[str, str], ...] = ()
    install_hint: str = ""
    priority: int = 0
    deterministic_head_dim: Callable[[int], bool] = lambda head_dim: True

    def deterministic_at(self, checked: CheckedSlices | None, head_dim: int) -> bool:
        """Whether the backward on these slices (None: not known yet, the head_dim alone) at this head_dim is
        bitwise repeatable."""
        if not self.deterministic_head_dim(head_dim):
            return False
        return checked is None or self.deterministic_on(checked)

    def deterministic_on(self, checked: CheckedSlices) -> bool:
        """:attr:`deterministic` on these slices, evaluated once per slices and backend: the verdict is kept
        beside the backend's launch data in ``checked.prepared`` (a plan decides it when it is built; every
        call's :meth:`check_deterministic` on the same slices reads it)."""
        key = (self.name, "deterministic")
        verdict = checked.prepared.get(key)
        if verdict is None:
            verdict = checked.prepared[key] = bool(self.deterministic(checked))
        return verdict

    # ------------------------------------------------------------------------------------- availability
    def missing(self) -> str:
        """Why this process cannot run the backend, or ``""`` when it can: a distribution of ``requires``
        not installed, no CUDA GPU, or this GPU's architecture. Nothing of the kernel library is imported
        (:mod:`magi_ffa.availability`); a library that is installed but fails to import raises at
        :attr:`install_check`."""
        absent = missing_distributions(self.requires)
        if absent:
            hint = f" ({self.install_hint})" if self.install_hint else ""
            return f"{' and '.join(absent)} not installed{hint}"
        if self.device == "any":
            return ""
        major = cuda_arch_major()
        if major is None:
            if self.device == "cuda_or_interpret":
                return "" if env.triton_interpret() else "no CUDA GPU (and TRITON_INTERPRET is not set)"
            return "no CUDA GPU"
        if self.architectures != "any" and major not in self.architectures:
            return f"the GPU is sm{major}x; {self.title} needs {self.architecture_names}"
        return ""

    def available(self) -> bool:
        """Whether this process can run the backend (:meth:`missing` is empty), without importing it."""
        return not self.missing()

    # ------------------------------------------------------------------------------------------ checks
    def check_inputs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        softmax_scale: float | None,
        softcap: float,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> float:
        """Check q / k / v (structure, then this backend's dtype, head_dim, softcap and device) and the
        accumulators; return the softmax scale. The GPU architecture is checked by :meth:`check_arch`."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if isinstance(t, torch.Tensor) and t.ndim == 3 and t.dtype not in self.dtypes:
                names = [str(d).removeprefix("torch.") for d in self.dtypes]
                allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
                raise ValueError(
                    f"`{name}` dtype must be {allowed} on the {self.title} backend, got {t.dtype}"
                )
        validate_qkv(q, k, v)
        d = q.shape[2]
        if not self.head_dim_ok(d):
            raise ValueError(f"head_dim must be {self.head_dim_rule} on the {self.title} backend, got {d}")
        scale = validate_scalars(softmax_scale, softcap, d)
        if softcap != 0 and not self.softcap:
            raise ValueError(
                f"`softcap` must be 0 on the {self.title} backend ({self.title} has no soft-capping), got "
                f"{softcap!r}; {self.softcap_hint}"
            )
        if self.device == "cuda" and not q.is_cuda:
            raise ValueError(f"q, k, v must be on one CUDA device, got {q.device}, {k.device}, {v.device}")
        if self.device == "cuda_or_interpret" and not q.is_cuda and not env.triton_interpret():
            raise ValueError(
                f"the {self.title} backend needs CUDA tensors (or TRITON_INTERPRET=1), got device {q.device}"
            )
        validate_out_lse(out, lse, q)
        return scale

    def check_arch(self, device: torch.device) -> None:
        """ValueError when this CUDA device's architecture is not one the backend runs on."""
        if self.architectures == "any" or device.type != "cuda":
            return
        major = _arch_major(device.index if device.index is not None else torch.cuda.current_device())
        if major not in self.architectures:
            raise ValueError(f"{self.package} needs a {self.architecture_names} GPU, got sm{major}x")

    def check_deterministic(self, deterministic: bool, checked: CheckedSlices) -> None:
        """ValueError, before any kernel starts, when ``deterministic=True`` and these slices are a mask on
        which the backend is not bitwise repeatable."""
        if not deterministic or self.deterministic_on(checked):
            return
        raise ValueError(
            f"`deterministic=True` is not available on the {self.title} backend ({self.package}) for this "
            f"mask: {self.nondeterministic_masks}. Use a backend that is deterministic on every mask: "
            "`cudnn` (magi_ffa_cudnn, its deterministic backward) or `triton` (magi_ffa, always "
            "deterministic)"
        )


@functools.cache
def _arch_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _host_slices_of(q: torch.Tensor, k: torch.Tensor, checked: CheckedSlices) -> Any:
    return checked.slices


@dataclass(frozen=True)
class Launchers:
    """The kernels of one backend, on CHECKED inputs (the contract checks everything before calling them);
    they see only calls with at least one slice, one query and one key token.

    Attributes:
        forward: ``forward(q, k, v, prepared, scale, softcap, want_max, zero_empty) -> (out, lse, max_logits |
            None)``: out in q's dtype, lse ``[total_q, num_heads_q]`` (any strides) in the accumulator dtype;
            rows that see no key get lse -inf and (with ``zero_empty``) out 0. Launchers of a capability that
            ``accumulates`` also take ``out=`` / ``lse=`` accumulators, merge into them in place and return
            them.
        backward: ``backward(do, q, k, v, out, lse, prepared, scale, softcap, deterministic, dlse) -> (dq, dk,
            dv)`` of this call's slices from the FINAL out / lse (``dlse``: the final lse's gradient, already 0
            on rows whose lse is -inf), fresh tensors in the inputs' dtypes; with ``accumulates`` also
            ``dq=`` / ``dk=`` / ``dv=`` fp32 accumulators, added to and returned.
        prepare: ``prepare(q, k, checked) -> prepared``, the per-mask launch data (FA4's launch metadata,
            cuDNN's mask plan; default: the host slices), kept by the contract in the mask's entry of the mask
            cache (:mod:`magi_ffa.mask_cache`) per backend and geometry.
    """

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    prepare: Callable[[torch.Tensor, torch.Tensor, CheckedSlices], Any] = _host_slices_of


_REGISTRY: dict[str, FFABackend] = {}


def register_backend(backend: FFABackend) -> FFABackend:
    """Make ``backend`` reachable by name from the custom ops (one backend per name; the last wins)."""
    _REGISTRY[backend.capability.name] = backend
    return backend


def get_backend(name: str) -> FFABackend:
    """The registered backend of this name (magi_ffa's ``triton`` / ``torch``; ``fa4`` / ``cudnn`` once their
    package is imported)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"no FFA backend named {name!r} is registered (known: {sorted(_REGISTRY)})"
        ) from None


def _empty_lse(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape[:2], float("-inf"), dtype=acc_dtype(q.dtype), device=q.device)


def _no_max(q: torch.Tensor) -> torch.Tensor:
    return torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)


class FFABackend:
    """One kernel backend bound to the contract (see the module docstring)."""

    def __init__(self, capability: BackendCapability, launchers: Launchers) -> None:
        self.capability = capability
        self.launchers = launchers
        self.flex_flash_attn_func, self.ffa_fwd, self.ffa_bwd = public_functions(
            lambda q, backend: self._fixed(backend), capability, selectable=False
        )

    def __repr__(self) -> str:
        return f"FFABackend({self.capability.name!r})"

    @property
    def entry_points(self) -> tuple[Callable[..., tuple], Callable[..., tuple], Callable[..., tuple]]:
        """``(flex_flash_attn_func, ffa_fwd, ffa_bwd)`` of this backend (what its package exports)."""
        return self.flex_flash_attn_func, self.ffa_fwd, self.ffa_bwd

    def _fixed(self, backend: object) -> FFABackend:
        if backend is not None:
            raise TypeError(f"{self.capability.package}'s launchers take no `backend` argument")
        return self

    # ------------------------------------------------------------------------------------- pieces
    def check(self, q, k, v, softmax_scale, softcap, out=None, lse=None) -> float:
        """Every check of the tensors and scalars (the capability's), the install check first; the scale."""
        cap = self.capability
        if cap.install_check is not None:
            cap.install_check()
        scale = cap.check_inputs(q, k, v, softmax_scale, softcap, out, lse)
        cap.check_arch(q.device)
        return scale

    def checked_slices(self, q: torch.Tensor, k: torch.Tensor, checked: CheckedSlices) -> CheckedSlices:
        if not isinstance(checked, CheckedSlices):
            raise ValueError(
                "`slices` must be CheckedSlices (magi_ffa.validation.check_slices), got "
                f"{type(checked).__name__}"
            )
        if (q.shape[0], k.shape[0]) != (checked.total_q, checked.total_k):
            raise ValueError(
                f"the slices were checked for {checked.total_q} query and {checked.total_k} key tokens, "
                f"got q with {q.shape[0]} and k with {k.shape[0]}"
            )
        return checked

    def prepared(self, q: torch.Tensor, k: torch.Tensor, checked: CheckedSlices) -> Any:
        """The launchers' per-mask data, in the mask's entry of the mask cache per backend and geometry."""
        key = (self.capability.name, q.shape[1], k.shape[1], q.shape[2], q.dtype, str(q.device))
        return MASKS.prepared(checked, key, lambda: self.launchers.prepare(q, k, checked))

    def max_logits(self, q, k, checked: CheckedSlices, scale: float, softcap: float) -> torch.Tensor:
        """Max logits of these slices alone (no gradient): the separate QK pass on magi_ffa's Triton
        kernel."""
        from ._max_logits import max_logits_pass

        if not FFACall(q, k, k, checked, scale).runs:
            return _no_max(q)
        return max_logits_pass(q.detach(), k.detach(), checked.slices, scale, softcap)

    # ---------------------------------------------------------------------------- forward / backward
    def _forward(self, call: FFACall, out=None, lse=None):
        """Forward of a checked call: (out, lse, max | None), sinks merged into this call's result and then
        (given ``out`` / ``lse``) merged into the accumulators in place."""
        cap, run, q, sink = self.capability, call.runs, call.q, call.sink
        accumulate = out is not None
        fused = accumulate and sink is None and cap.accumulates
        kernel_max = call.want_max and cap.max_logits
        if run:
            # merged into an accumulator without sinks: the merge ignores rows of -inf lse, so the kernel
            # need not zero their out
            zero_empty = not accumulate or sink is not None
            o, l, mx = self.launchers.forward(
                q, call.k, call.v, self.prepared(q, call.k, call.checked), call.scale, call.softcap, kernel_max,
                zero_empty, *((out, lse) if fused else ()),
            )  # fmt: skip
        else:
            o, l, mx = (out, lse, None) if fused else (torch.zeros_like(q), _empty_lse(q), None)
        if call.want_max and not (kernel_max and run):
            if run or not cap.max_logits:
                mx = self.max_logits(q, call.k, call.checked, call.scale, call.softcap)
            else:
                mx = _no_max(q)
        if sink is not None:
            o, l = merge_sink(o, l, sink)
        if accumulate and not fused:
            if run or sink is not None:
                _merge_into(out, lse, o, l)
            o, l = out, lse
        elif not accumulate:
            l = l.contiguous()
        return o, l, mx

    def _backward(self, call: FFACall, io: BwdIO):
        """dq, dk, dv of a checked call (accumulated into ``io``'s buffers when given)."""
        bufs = io.grads
        q, k, v = call.q, call.k, call.v
        if not call.runs:
            return tuple(torch.zeros_like(t) if b is None else b for t, b in zip((q, k, v), bufs))
        dlse = io.dlse
        if dlse is not None:  # rows without keys: no gradient
            dlse = torch.where(torch.isneginf(io.lse), 0.0, dlse.to(io.lse.dtype))
        head = (io.do, q, k, v, io.out, io.lse, self.prepared(q, k, call.checked), call.scale, call.softcap)
        if self.capability.accumulates:
            return self.launchers.backward(*head, call.deterministic, dlse, *bufs)
        grads = self.launchers.backward(*head, call.deterministic, dlse)
        return tuple(g if b is None else b.add_(g) for g, b in zip(grads, bufs))

    # ------------------------------------------------------------------------------ runtime entries
    def fwd_checked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        checked: CheckedSlices,
        *,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        deterministic: bool = False,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
        return_max_logits: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """``ffa_fwd`` on slices checked once (:func:`magi_ffa.validation.check_slices`): the runtime's entry.
        The tensors and scalars are checked as in ``ffa_fwd``; the slices only against the token counts."""
        scale = self.check(q, k, v, softmax_scale, softcap, out, lse)
        opts = Options(softmax_scale, softcap, deterministic, sink, return_max_logits)
        return self._fwd_on(self._call(q, k, v, self.checked_slices(q, k, checked), opts, scale), out, lse)

    def _call(self, q, k, v, checked: CheckedSlices, opts: Options, scale: float) -> FFACall:
        """The call object, after the checks of the sinks and the deterministic flag (``scale``: from
        :meth:`check`, which the caller ran first)."""
        validate_sink(opts.sink, q)
        self.capability.check_deterministic(bool(opts.deterministic), checked)
        return FFACall(q, k, v, checked, scale, float(opts.softcap), bool(opts.deterministic), opts.sink,
                       bool(opts.return_max_logits))  # fmt: skip

    def _fwd_on(self, call: FFACall, out, lse) -> tuple[torch.Tensor, ...]:
        o, l, mx = self._forward(call, out, lse)
        return (o, l, mx) if call.want_max else (o, l)

    def bwd_checked(
        self,
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        checked: CheckedSlices,
        *,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        deterministic: bool = False,
        dq: torch.Tensor | None = None,
        dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
        dlse: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """``ffa_bwd`` on slices checked once: the runtime's entry (see :meth:`fwd_checked`)."""
        scale = self.check(q, k, v, softmax_scale, softcap)
        opts, io = Options(softmax_scale, softcap, deterministic, sink), BwdIO(do, out, lse, dlse, dq, dk, dv)
        return self._bwd_on(q, k, v, self.checked_slices(q, k, checked), opts, io, scale)

    def _bwd_on(self, q, k, v, checked: CheckedSlices, opts: Options, io: BwdIO, scale: float) -> tuple:
        validate_bwd_inputs(io.do, io.out, io.lse, q, k, *io.grads)
        validate_dlse(io.dlse, io.lse)
        call = self._call(q, k, v, checked, opts, scale)
        sink = opts.sink
        extra = () if sink is None else (sink_grad(io.do, io.out, io.lse, sink, _zero_dead(io.dlse, io.lse)),)
        return (*self._backward(call, io), *extra)

    # --------------------------------------------------------------------------- table entries
    def _fwd_tables(self, q, k, v, tables, opts: Options, out, lse) -> tuple[torch.Tensor, ...]:
        scale = self.check(q, k, v, opts.softmax_scale, opts.softcap, out, lse)  # the tensors' messages first
        return self._fwd_on(self._call(q, k, v, checked_of(tables, q, k), opts, scale), out, lse)

    def _bwd_tables(self, q, k, v, tables, opts: Options, io: BwdIO) -> tuple[torch.Tensor, ...]:
        scale = self.check(q, k, v, opts.softmax_scale, opts.softcap)
        return self._bwd_on(q, k, v, checked_of(tables, q, k), opts, io, scale)

    def _flex(self, q, k, v, tables, opts: Options, out, lse) -> tuple[torch.Tensor, ...]:
        scale = self.check(q, k, v, opts.softmax_scale, opts.softcap, out, lse)
        sink, ret_max, cap = opts.sink, bool(opts.return_max_logits), float(opts.softcap)
        needs_graph = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sink)
        )
        if torch.compiler.is_compiling():
            # traced: the op finds (or checks) the slices itself, at run time
            qr = as_ranges(tables[0], "q_ranges", q.device)
            kr = as_ranges(tables[1], "k_ranges", q.device)
            tm = as_type_map(tables[2], qr.shape[0], q.device)
            if kr.shape[0] != qr.shape[0]:
                raise ValueError(
                    f"`q_ranges` and `k_ranges` must have the same number of slices, got {qr.shape[0]} and "
                    f"{kr.shape[0]}"
                )
            validate_sink(sink, q)
            o, l, m = torch.ops.magi_ffa.fwd(
                q, k, v, qr, kr, tm, scale, cap, bool(opts.deterministic), sink, ret_max, self.capability.name
            )
        else:
            call = self._call(q, k, v, checked_of(tables, q, k), opts, scale)
            if needs_graph:  # eager autograd carries the call itself (no custom-op dispatch per call)
                o, l, m = EagerAttention.apply(q, k, v, sink, self, call)
            else:  # no graph needed: skip the op's dispatch and autograd bookkeeping (host time per call)
                o, l, m = self._forward(call)
        if out is not None:
            if o.requires_grad or l.requires_grad or out.requires_grad or lse.requires_grad:
                # autograd saves the previous out/lse for the merge backward: clones (the buffers are
                # overwritten)
                o2, l2 = merge_out_lse(out.clone(), lse.clone(), o, l)
                out.copy_(o2)
                lse.copy_(l2)
            else:
                _merge_into(out, lse, o, l)
            o, l = out, lse
        return (o, l, m) if ret_max else (o, l)


def _zero_dead(dlse: torch.Tensor | None, lse: torch.Tensor) -> torch.Tensor | None:
    return None if dlse is None else torch.where(torch.isneginf(lse), 0.0, dlse.to(lse.dtype))


def _merge_into(out, lse, o, l) -> None:
    """Merge (o, l) into the accumulators in place: one fused Triton kernel where it runs (fp32 lse, CUDA or
    the interpreter), else torch ops."""
    if lse.dtype == torch.float32 and (out.is_cuda or env.triton_interpret()) and out.stride(-1) == 1:
        merge_out_lse_(out, lse, o if o.stride(-1) == 1 else o.contiguous(), l)
        return
    o2, l2 = merge_out_lse(out, lse, o, l)
    out.copy_(o2)
    lse.copy_(l2)


# ---------------------------------------------------------------------------------------------------------
# The custom ops: functional forward / backward of any registered backend, with fake implementations
# (torch.compile) and autograd. The slices arrive as tables: the op finds their entry of the mask cache by
# the tables' identity (the eager path passes the entry's own tables), else by value (checked on a miss).


@torch.library.custom_op("magi_ffa::fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
    sink: torch.Tensor | None = None,
    return_max_logits: bool = False,
    backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    be = get_backend(backend)
    checked = checked_of((q_ranges, k_ranges, attn_type_map), q, k)  # by identity: no host copy
    be.capability.check_deterministic(deterministic, checked)
    call = FFACall(q, k, v, checked, softmax_scale, softcap, deterministic, sink, return_max_logits)
    o, l, m = be._forward(call)
    # max logits: [num_heads_q] when asked for, else an empty placeholder (an op's outputs are fixed)
    m = m if return_max_logits else q.new_empty(0, dtype=torch.float32)
    return o.contiguous(), l.contiguous(), m


@_fwd_op.register_fake
def _fwd_fake(
    q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic, sink=None,
    return_max_logits=False, backend="triton",
):  # fmt: skip
    m = q.new_empty(q.shape[1] if return_max_logits else 0, dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype)), m


@torch.library.custom_op("magi_ffa::bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    q_ranges: torch.Tensor,
    k_ranges: torch.Tensor,
    attn_type_map: torch.Tensor,
    softmax_scale: float,
    softcap: float,
    deterministic: bool,
    backend: str = "triton",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    be = get_backend(backend)
    checked = checked_of((q_ranges, k_ranges, attn_type_map), q, k)  # the saved tables: by identity
    call = FFACall(q, k, v, checked, softmax_scale, softcap, deterministic)
    dq, dk, dv = be._backward(call, BwdIO(do, out, lse, dlse))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_bwd_op.register_fake
def _bwd_fake(
    do, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic,
    backend="triton",
):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output) -> None:
    q, k, v, q_ranges, k_ranges, attn_type_map, softmax_scale, softcap, deterministic, sink, _, backend = (
        inputs
    )
    out, lse, max_logits = output
    ctx.mark_non_differentiable(max_logits)
    ctx.has_sink = sink is not None
    saved_sink = sink if sink is not None else q.new_empty(0)
    ctx.save_for_backward(q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, saved_sink)
    ctx.args = (softmax_scale, softcap, deterministic, backend)


def _fwd_backward(ctx, dout, dlse, _dmax):
    q, k, v, out, lse, q_ranges, k_ranges, attn_type_map, sink = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dout = dout.contiguous()
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, dlse, q_ranges, k_ranges, attn_type_map, *ctx.args)
    dsink = sink_grad(dout, out, lse, sink, _zero_dead(dlse, lse)) if ctx.has_sink else None
    return dq, dk, dv, None, None, None, None, None, None, dsink, None, None


_fwd_op.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ---------------------------------------------------------------------------------------------------------
# The public functions: one template each. A package binds them to its backend (``selectable=False``: no
# ``backend`` parameter) or, like magi_ffa, to a choice among its backends (``backend=`` picks one); their
# shared docstring sections are in ``_docstrings``.


def _limits(cap: BackendCapability) -> str:
    dts = "/".join(str(d).removeprefix("torch.") for d in cap.dtypes)
    parts = [f"{dts} inputs", f"head_dim {cap.head_dim_rule}"]
    if cap.architectures != "any":
        parts.append(f"a {cap.architecture_names} GPU")
    elif cap.device == "cuda":
        parts.append("CUDA tensors")
    elif cap.device == "cuda_or_interpret":
        parts.append("CUDA tensors (or the CPU under TRITON_INTERPRET=1)")
    if not cap.softcap:
        parts.append("``softcap`` 0")
    text = f"\n\n    {cap.title} backend ({cap.package}): " + ", ".join(parts) + "."
    text += " Max logits from the kernel." if cap.max_logits else " Max logits from a separate QK pass."
    if cap.nondeterministic_masks:
        text += f" ``deterministic=True`` is refused on {cap.nondeterministic_masks}."
    return text


def public_functions(
    resolve: Callable[[torch.Tensor, object], FFABackend],
    capability: BackendCapability | None,
    *,
    selectable: bool,
) -> tuple[Callable[..., tuple], Callable[..., tuple], Callable[..., tuple]]:
    """``(flex_flash_attn_func, ffa_fwd, ffa_bwd)`` bound to the backend ``resolve(q, backend)`` returns.

    One template each: the signatures and docstrings are the contract's. ``selectable=False`` drops the
    ``backend`` parameter from ``ffa_fwd`` / ``ffa_bwd`` (a package with one backend); ``capability`` adds its
    limits to the docstrings (None: a package whose backends differ, e.g. magi_ffa's triton / torch).
    """

    def flex_flash_attn_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_ranges: RangesLike,
        k_ranges: RangesLike,
        attn_type_map: TypeMapLike = None,
        *,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        deterministic: bool = False,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
        return_max_logits: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        opts = Options(softmax_scale, softcap, deterministic, sink, return_max_logits)
        return resolve(q, None)._flex(q, k, v, (q_ranges, k_ranges, attn_type_map), opts, out, lse)

    def ffa_fwd(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_ranges: RangesLike,
        k_ranges: RangesLike,
        attn_type_map: TypeMapLike = None,
        *,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        deterministic: bool = False,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        backend: str | None = None,
        sink: torch.Tensor | None = None,
        return_max_logits: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        opts = Options(softmax_scale, softcap, deterministic, sink, return_max_logits)
        return resolve(q, backend)._fwd_tables(q, k, v, (q_ranges, k_ranges, attn_type_map), opts, out, lse)

    def ffa_bwd(
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        q_ranges: RangesLike,
        k_ranges: RangesLike,
        attn_type_map: TypeMapLike = None,
        *,
        softmax_scale: float | None = None,
        softcap: float = 0.0,
        deterministic: bool = False,
        dq: torch.Tensor | None = None,
        dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
        backend: str | None = None,
        dlse: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        opts = Options(softmax_scale, softcap, deterministic, sink)
        io = BwdIO(do, out, lse, dlse, dq, dk, dv)
        return resolve(q, backend)._bwd_tables(q, k, v, (q_ranges, k_ranges, attn_type_map), opts, io)

    limits = "" if capability is None else _limits(capability)
    backend_arg = _BACKEND_ARG if selectable else ""
    flex_flash_attn_func.__doc__ = (
        "Attention whose mask is the union of slices ``(q_ranges[i], k_ranges[i], attn_type_map[i])``, "
        "forward and backward." + limits + "\n" + _SHARED_ARGS + _FWD_ARGS + _FLEX_RETURNS
    )
    ffa_fwd.__doc__ = (
        "Forward launcher (no autograd)."
        + limits
        + "\n"
        + _SHARED_ARGS
        + _FWD_ARGS
        + backend_arg
        + _FWD_RETURNS
    )
    ffa_bwd.__doc__ = (
        "Backward launcher (no autograd) for the contribution of this call's slices." + limits + "\n"
        + _BWD_ARGS + backend_arg + _BWD_TAIL
    )  # fmt: skip
    if not selectable:
        for fn in (ffa_fwd, ffa_bwd):
            sig = inspect.signature(fn)
            fn.__signature__ = sig.replace(
                parameters=[p for p in sig.parameters.values() if p.name != "backend"]
            )
    if capability is not None:
        for fn in (flex_flash_attn_func, ffa_fwd, ffa_bwd):
            fn.__module__ = capability.package
            fn.__qualname__ = fn.__name__
    return flex_flash_attn_func, ffa_fwd, ffa_bwd
