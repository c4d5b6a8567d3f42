"""`graph_break`: what `@torch.compiler.disable` does for a public call, without importing `torch._dynamo`.

`torch.compiler.disable` imports `torch._dynamo` (about 5 s on a GPU machine) when the decorator runs, that
is when the module that uses it is imported. A process that never compiles should not pay for it, so this
decorator returns a plain wrapper that

- carries the marker `torch.compile` reads while tracing a caller (`_torchdynamo_disable`): the trace stops
  at the call, exactly where a `torch.compiler.disable`-d function stops it (one graph break per call);
- runs the function directly while `torch._dynamo` is not imported (nothing can be compiling then);
- once it is imported, runs the function through `torch.compiler.disable` (built on that first call), so
  that nothing the function calls is compiled either.

The wrapper's own frame is marked to be skipped by the compiler (a C-level flag of torch, no import), so
that running it after the graph break is not traced; where this torch lacks that flag, the compiler traces
the wrapper once, finds nothing to compile, and skips it from then on.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

_P = ParamSpec("_P")
_R = TypeVar("_R")

_REASON = "magi_attention: one graph break per call (docs/packages/magi_attention.md)"


def graph_break(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` wrapped so that `torch.compile` graph-breaks at each call and never traces into it; importing
    `torch._dynamo` is left to the first call made while it is already imported."""
    disabled: list[Callable[_P, _R]] = []

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if "torch._dynamo" not in sys.modules:  # nothing compiles without it
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, reason=_REASON))
        return disabled[0](*args, **kwargs)

    # the marker dynamo's tracer reads (inspect.getattr_static) on a callee: stop the graph at this call
    wrapper._torchdynamo_disable = True  # type: ignore[attr-defined]
    wrapper._torchdynamo_disable_msg = _REASON  # type: ignore[attr-defined]
    return wrapper


def _skip_wrapper_frames() -> None:
    """Mark the wrappers' one code object as skipped by the compiler's frame hook (this frame only; the
    function it calls is shielded by `torch.compiler.disable`)."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # another torch: the wrapper is traced once, then skipped
        return
    code = graph_break(lambda: None).__code__
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


_skip_wrapper_frames()
