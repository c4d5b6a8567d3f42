"""The interface of a group-collective implementation (``CollectiveImpl``: builds a cast and a reduce runner
for fixed tables) and the stage helpers every implementation shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.distributed as dist

from ._comm import Comm
from ._config import ReduceOp
from ._tables import CastTables, ReduceTables
from ._work import Work


class CastRunner(ABC):
    """Runs one rank's GroupCast for fixed tables; all metadata precomputed."""

    @abstractmethod
    def run(self, input: torch.Tensor, output: torch.Tensor, async_op: bool) -> Work:
        """Send ``input`` pieces, write ``output`` pieces (validated by the caller)."""


class ReduceRunner(ABC):
    """Runs one rank's GroupReduce for fixed tables; all metadata precomputed."""

    #: True when :meth:`run` takes (sum / avg) an ``input`` of a narrower floating dtype than ``output``, sends
    #: it in its own dtype and widens it exactly in the reduction (the same bits as widening it first, fewer
    #: bytes); False: the plan widens ``input`` to ``output``'s dtype before calling :meth:`run`.
    narrow_input: ClassVar[bool] = False

    @abstractmethod
    def run(
        self,
        input: torch.Tensor,
        output: torch.Tensor,
        reduce_op: ReduceOp,
        input_lse: torch.Tensor | None,
        output_lse: torch.Tensor | None,
        async_op: bool,
        deterministic: bool = False,
    ) -> Work:
        """Send ``input`` pieces, reduce into ``output`` (validated by the caller; ``input``'s dtype is
        ``output``'s, or narrower only when :attr:`narrow_input`); ``deterministic``: every reduction adds in a
        fixed order (the same bits on every run)."""


class CollectiveImpl(ABC):
    """An implementation of both collectives, one per :class:`GroupCollectiveImpl` value (a2av, native,
    hierarchical). A new one subclasses this, in its own module, and ``_select.implementation`` returns it; plans
    pick it by :class:`GroupCollectiveImpl`. (Not a *kernel backend*: that word is the attention kernel's.)"""

    #: True when the routing of a rank depends on the tables of other ranks (the plan then gathers all
    #: tables once, collectively, at construction).
    needs_all_tables: ClassVar[bool] = False

    def check_usable(self, comm: Comm, device: torch.device, selected_by: str) -> None:  # noqa: B027
        """Raise (naming ``selected_by``, the setting that chose this implementation) when it cannot run on
        ``comm`` / ``device``; called at plan construction before any communication. Default: no check."""

    @abstractmethod
    def build_cast(
        self, tables: CastTables, comm: Comm, device: torch.device, all_tables: Sequence[CastTables] | None
    ) -> CastRunner:
        """Precompute everything for ``tables`` on ``device``."""

    @abstractmethod
    def build_reduce(
        self,
        tables: ReduceTables,
        comm: Comm,
        device: torch.device,
        all_tables: Sequence[ReduceTables] | None,
    ) -> ReduceRunner:
        """Precompute everything for ``tables`` on ``device``."""


def a2a(
    recv: torch.Tensor,
    send: torch.Tensor,
    recv_splits: list[int],
    send_splits: list[int],
    group,
    async_op: bool,
):
    """``all_to_all_single`` with split lists (the only form gloo supports for uneven sizes)."""
    return dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=async_op)


def chain(first, then, device: torch.device, async_op: bool) -> Work:
    """Run ``then()`` (which launches the next stage and returns its Work) after ``first`` completes.

    On CUDA, ``first.wait()`` only makes the current stream wait, so the next stage is launched at once;
    elsewhere the wait blocks the host, so it is deferred into ``Work.wait()`` when ``async_op``.
    """
    if device.type == "cuda" or not async_op:
        first.wait()
        nxt = then()
        if not async_op:
            nxt.wait()
        return nxt
    return Work([first], post=lambda: then().wait())


def piece_rows(piece_ids: Sequence[int], starts: Sequence[int], sizes: Sequence[int]) -> tuple[list, list]:
    """Starts and sizes of the listed pieces (for :func:`ranges_index`)."""
    return [starts[i] for i in piece_ids], [sizes[i] for i in piece_ids]
