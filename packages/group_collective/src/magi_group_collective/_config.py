"""Choices (StrEnum) and the environment variables of the package (the implementation's read when a plan is
built, the debug flag once per process)."""

from __future__ import annotations

from enum import StrEnum
from functools import lru_cache

from . import env


class GroupCollectiveImpl(StrEnum):
    """Implementation of GroupCast / GroupReduce.

    - ``A2AV``: pre-gather, one ``all_to_all_single``, post-scatter/reduce; any torch.distributed backend.
    - ``HIERARCHICAL``: over a 2-D DeviceMesh ``(inter, intra)``: a piece crosses the inter-node link once
      per destination node and fans out inside the node; the reduce pre-reduces inside the source node.
    - ``NATIVE``: inside one node, over symmetric buffers mapped into every rank (CUDA IPC through
      cuda-bindings): each rank stages its pieces once, and Triton kernels read them straight from the
      owners' buffers into the output (cast) or reduce them in a fixed order (reduce). CUDA tensors, an
      NCCL group on one node and the ``native`` extra; elsewhere plan construction raises
      :class:`NativeUnavailableError` on every rank.
    """

    A2AV = "a2av"
    HIERARCHICAL = "hierarchical"
    NATIVE = "native"


class ReduceOp(StrEnum):
    """Reduction of GroupReduce.

    - ``SUM``: ``output[j] += Σ_{s ∈ src_indices[j]} piece_s``.
    - ``AVG``: ``output[j] += (1 / |src_indices[j]|) Σ_s piece_s`` (mean over the contributing sources of
      the piece, accumulated onto what ``output`` holds; a piece with no source is left as is).
    - ``LSE``: log-sum-exp merge of partial attention outputs, with ``(output, output_lse)`` as one term.
    """

    SUM = "sum"
    AVG = "avg"
    LSE = "lse"


def parse_impl(value: object) -> GroupCollectiveImpl:
    """``GroupCollectiveImpl`` from an enum member or its string value (case-insensitive)."""
    try:
        return GroupCollectiveImpl(str(value).strip().lower())
    except ValueError:
        choices = [m.value for m in GroupCollectiveImpl]
        raise ValueError(f"`impl` must be one of {choices}, got {value!r}") from None


def parse_reduce_op(value: object) -> ReduceOp:
    """``ReduceOp`` from an enum member or ``"sum"`` / ``"avg"`` / ``"lse"``."""
    try:
        return ReduceOp(str(value).strip().lower())
    except ValueError:
        raise ValueError(f"`reduce_op` must be one of {[m.value for m in ReduceOp]}, got {value!r}") from None


def env_impl() -> GroupCollectiveImpl | None:
    """``MAGI_GROUP_COLLECTIVE_IMPL`` (``a2av`` | ``hierarchical`` | ``native``), or None when unset; read
    when a plan (or the attention runtime's key) is built, never cached: one time for every setting that
    chooses the implementation (``_select.decide_impl``)."""
    value = env.impl()  # ValueError naming the variable for anything else
    return None if value is None else parse_impl(value)


@lru_cache(maxsize=1)
def env_debug() -> bool:
    """``MAGI_GROUP_COLLECTIVE_DEBUG=1`` turns the collective cross-check of tables on (default off)."""
    return env.debug()
