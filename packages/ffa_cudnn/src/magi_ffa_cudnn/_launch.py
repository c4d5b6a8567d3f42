"""Launches of cuDNN's flex_attention kernels whose per-call host work is done once per plan and layout.

cuDNN's reusable-plan entry points (``cudnn.flex_attention.execution``) re-derive the launch on every call:
tensor and plan signatures, the plan's compile key, geometry checks, the kernel configuration and, in the
backward, the normalized block-sparse payload. That host work is fixed per mask plan, layout and options,
and at 8k tokens it is as long as the kernels themselves (a call on a short sequence waited for the host, not
the GPU). So each plan keeps one launcher per (layout, options): built with cuDNN's own classes and checks
the first time, then a call allocates its outputs and workspace and launches the compiled kernels.

- :class:`ForwardLaunch`: cuDNN's resolved forward dispatch and compiled kernel, launched by the frontend's
  own launch function.
- :class:`BackwardLaunch`: the backward's kernel calls (preprocess, main, dq / dk / dv postprocess) recorded
  from one call through ``FlexAttentionBwd.execute``, with every per-call tensor (inputs, outputs, workspace
  views) marked by its role; a later call replays them with its own tensors. Tensors that are no role (the
  plan's payload) are the plan's and stay as they were. A recording call whose inputs alias (one tensor as
  both ``k`` and ``v``) is not replayed.

Pinned to nvidia-cudnn-frontend 1.32.0 (the package's requirement): these are the frontend's private pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BackwardLaunch", "ForwardLaunch", "compile_key", "layout_key"]


def layout_key(*tensors: torch.Tensor | None) -> tuple:
    """What a compiled launch binds of its tensors: shapes, strides, dtypes (the device is the plan's)."""
    return tuple(None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in tensors)


def compile_key(
    *,
    dtype: torch.dtype,
    head_dim: int,
    num_heads_q: int,
    num_heads_kv: int,
    nfunc: int,
    deterministic: bool = False,
    want_max: bool = False,
    has_dlse: bool = False,
    arch: int = 90,
    narrow_workset: bool = False,
) -> tuple:
    """The cuDNN flex_attention kernels one call of a mask runs (forward, backward), as a hashable tuple.

    A pure function mirroring what nvidia-cudnn-frontend 1.32.0's compile keys read
    (``cudnn.flex_attention.dispatch``: the forward's ``compile_key`` plus its output broadcast patterns,
    the backward's ``compile_key`` plus ``dlse is not None``; the mask-plan builder's classify / materialize
    kernels key on the tile configuration only). This backend always calls with one fixed-length sample
    (batch 1, not varlen), lse on, contiguous or 16-byte aligned layouts (no stride-0 dimension) and
    ``pack_gqa`` left to cuDNN (a function of the heads), so what varies is the configuration below.

    What a mask sets never enters: ``nfunc`` (the endpoints per row of :func:`~magi_ffa_cudnn.mask_func.
    mask_func_from_intervals`) and the plan's block counts are runtime values of cuDNN's kernels. The one
    mask-dependent flag is sm100's ``narrow_workset`` (fewer than 7 non-empty blocks per block row: the
    plan builder's hint that selects the overlapped q-stage-1 schedule), which only sm100's q-stage-1
    one-CTA forward reads; pass it from the plan there (it is dropped on sm90).

    Args:
        dtype: q's dtype (fp16 / bf16).
        head_dim: q / k / v head dim.
        num_heads_q, num_heads_kv: heads of q and of k / v.
        nfunc: endpoints per row of the mask function (odd, positive): checked, not keyed.
        deterministic: the backward's deterministic mode.
        want_max: the forward also returns max logits.
        has_dlse: the backward receives an lse gradient.
        arch: ``major * 10 + minor`` (90 Hopper, 100 / 103 Blackwell).
        narrow_workset: see above (sm100 only).
    """
    if isinstance(nfunc, bool) or not isinstance(nfunc, int) or nfunc <= 0 or nfunc % 2 == 0:
        raise ValueError(f"`nfunc` must be a positive odd int, got {nfunc!r}")
    gqa = num_heads_q // num_heads_kv
    hd256 = head_dim == 256 and arch in (100, 103)
    narrow = bool(narrow_workset) if arch in (100, 103) else None
    fwd = ("fwd", arch, dtype, head_dim, gqa, want_max, hd256, narrow)
    bwd = ("bwd", arch, dtype, head_dim, gqa, bool(deterministic), hd256, bool(has_dlse))
    return fwd, bwd


class ForwardLaunch:
    """The forward of one plan and layout: out ``[1, S, hq, dv]``, lse fp32 ``[1, hq, S]``, max logits."""

    def __init__(
        self, flex: Any, mask_plan: Any, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, want_max: bool
    ):
        execution, dispatch = flex.execution, flex.dispatch
        md = mask_plan.metadata
        device = q4.device
        self.out_shape = (md.batch_size, md.total_q // md.batch_size, md.num_q_heads, md.head_dim_v)
        self.lse_shape = (md.batch_size, md.num_q_heads, md.total_q // md.batch_size)
        self.num_heads = md.num_q_heads
        o = torch.empty(self.out_shape, dtype=q4.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        ml = torch.empty((md.num_q_heads,), dtype=torch.float32, device=device) if want_max else None
        api = execution.FlexAttentionFwd(q4, k4, v4, o, mask_plan, lse, sample_max_logit=ml)
        api.check_support()  # cuDNN's own checks of this layout against the plan, once
        api.compile()  # a compile-cache hit for every plan of the same kernel configuration
        self._dispatch = api._prepare(q4, k4, v4, mask_plan)
        self._kernel = api._compiled_kernel
        self._launch = dispatch._launch_flex_attn_fwd
        self._cu_q, self._cu_k, _, _ = execution._sequence_args(mask_plan)
        self._scheduler = self._dispatch.arch == 90  # sm90 kernels take a tile counter (zeroed per launch)
        self.want_max = want_max

    def __call__(self, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float):
        device = q4.device
        o = torch.empty(self.out_shape, dtype=q4.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        ml = torch.empty((self.num_heads,), dtype=torch.float32, device=device) if self.want_max else None
        counter = torch.empty((1,), dtype=torch.int32, device=device) if self._scheduler else None
        with torch.cuda.device(device):
            self._launch(
                self._dispatch, self._kernel, q4, k4, v4, o, lse, scale, self._cu_q, self._cu_k, counter,
                max_logit=ml,
            )  # fmt: skip
        return o, lse, ml


@dataclasses.dataclass(frozen=True)
class _Role:
    """A per-call tensor in a recorded kernel call: an input / output by name, or a workspace view."""

    name: str


class _Recorder:
    """Stands in for one compiled kernel during the recording call: runs it and keeps its arguments."""

    def __init__(self, fn: Callable, calls: list):
        self.fn, self.calls = fn, calls

    def __call__(self, *args):
        self.calls.append((self.fn, args))
        return self.fn(*args)


_ZEROED = (
    "dk_accum",
    "dv_accum",
    "dq_semaphore",
    "dk_semaphore",
    "dv_semaphore",
)  # what cuDNN zeroes per call


class BackwardLaunch:
    """The backward of one plan, layout, scale, deterministic flag and dlse presence: dq, dk, dv in q's dtype.

    The first call goes through ``FlexAttentionBwd.execute`` (cuDNN's checks and dispatch) with its kernels
    recorded; later calls replay the recorded kernel calls with their own tensors and a fresh workspace.
    """

    _INPUTS = ("q", "k", "v", "o", "do", "lse", "dlse", "dq", "dk", "dv")

    def __init__(
        self, flex: Any, mask_plan: Any, sample: dict[str, torch.Tensor | None], deterministic: bool
    ):
        execution = flex.execution
        s = sample
        api = execution.FlexAttentionBwd(
            s["q"], s["k"], s["v"], s["o"], s["do"], s["lse"], s["dq"], s["dk"], s["dv"], mask_plan, s["dlse"],
            deterministic=deterministic,
        )  # fmt: skip
        api.check_support()
        api.compile()
        self._api, self._plan, self._execution = api, mask_plan, execution
        self._specs = api._compiled_kernel.workspace_specs
        self.workspace_size = api.workspace_size
        self._calls: list[tuple[Callable, tuple]] | None = None  # None: not recorded yet; []: never replayed

    def _workspace(self, device: torch.device) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
        if not self.workspace_size:
            return None, {}
        ws = torch.empty((self.workspace_size,), dtype=torch.uint8, device=device)
        carver = self._execution._WorkspaceCarver(ws, self.workspace_size, device, "FlexAttentionBwd")
        views = {name: carver.take(shape, dtype) for name, shape, dtype in self._specs}
        return ws, views

    def __call__(self, tensors: dict[str, torch.Tensor | None], scale: float) -> tuple[torch.Tensor, ...]:
        """``tensors``: q, k, v, o, do, lse, dlse (or None) in the compiled layout; returns dq, dk, dv."""
        q, k, v = tensors["q"], tensors["k"], tensors["v"]
        device = q.device
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ws, views = self._workspace(device)
        roles = {**tensors, "dq": dq, "dk": dk, "dv": dv}
        if self._calls is None:
            self._record(roles, ws, views, scale)
            return dq, dk, dv
        if not self._calls:  # not replayable (see _record): cuDNN's own dispatch every time
            self._execute(roles, ws, scale)
            return dq, dk, dv
        for name in _ZEROED:
            if views.get(name) is not None:
                views[name].zero_()
        roles.update(views)
        with torch.cuda.device(device):
            for fn, args in self._calls:
                fn(*(roles[a.name] if isinstance(a, _Role) else a for a in args))
        return dq, dk, dv

    def _execute(self, roles: dict, ws: torch.Tensor | None, scale: float) -> None:
        self._api.execute(
            roles["q"], roles["k"], roles["v"], roles["o"], roles["do"], roles["lse"], roles["dq"], roles["dk"],
            roles["dv"], self._plan, roles["dlse"], workspace=ws, softmax_scale=scale,
        )  # fmt: skip

    def _record(self, roles: dict, ws: torch.Tensor | None, views: dict, scale: float) -> None:
        """One call through cuDNN's execute with the kernels recorded, then each argument marked by role.

        Two inputs that are one tensor in this call (``k`` passed as ``v``, say) cannot be told apart in the
        kernels' arguments, so such a launch is never replayed: every call then takes cuDNN's own dispatch."""
        bundle = self._api._compiled_kernel
        calls: list[tuple[Callable, tuple]] = []
        fields = ("preprocess", "main", "post_dq", "post_dk", "post_dv")
        recording = dataclasses.replace(
            bundle,
            **{f: _Recorder(getattr(bundle, f), calls) for f in fields if getattr(bundle, f) is not None},
        )
        self._api._compiled_kernel = recording
        try:
            self._execute(roles, ws, scale)
        finally:
            self._api._compiled_kernel = bundle
        by_ptr: dict[tuple, str] = {}
        for name, t in (*((n, roles[n]) for n in self._INPUTS), *views.items()):
            if t is not None and by_ptr.setdefault((t.data_ptr(), tuple(t.shape), t.dtype), name) != name:
                self._calls = []
                return

        def mark(a):
            if isinstance(a, torch.Tensor):
                name = by_ptr.get((a.data_ptr(), tuple(a.shape), a.dtype))
                return a if name is None else _Role(name)
            return a

        self._calls = [(fn, tuple(mark(a) for a in args)) for fn, args in calls]
        # a recorded call must depend on this call's tensors only through roles: the kernels' own arguments
        # are tensors and plain values (the plan's payload travels as a tuple of the plan's tensors)
        if not any(isinstance(a, _Role) for _, args in self._calls for a in args):
            raise RuntimeError(
                "cuDNN's backward kernels took none of the call's tensors: unexpected frontend"
            )
