"""What a dispatch costs by the kernel law: every rank's key columns, remote K/V and predicted kernel time.

One price for every placement (the chunk dispatch's candidates, the documents placement, the CLI): a rank's
forward and backward kernel times from `kernel_law.KernelLaw` on its mask area, its key columns (its own
tokens plus the keys it receives) and its query rows, plus the time its received K/V (and, in the
backward, the dK / dV sent back) spend on the links: over NVLink inside a node, at `INTERNODE_GBPS` per
GPU for the part from other nodes (the slower link sets the time). The merged schedule (overlap degree 0)
fetches before its kernel and reduces after it, so a rank's forward is `fetch + kernel` and its backward
`kernel + reduce`; the step is the slowest forward plus the slowest backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .dispatch import DispatchPlan, _key_intervals
from .kernel_law import KernelLaw

__all__ = [
    "INTERNODE_GBPS",
    "INTRANODE_GBPS",
    "NODE",
    "PlanPrice",
    "price_plan",
    "rank_traffic",
    "remote_kv_tokens",
    "remote_kv_tokens_by_group",
]

NODE = 8
"""GPUs per node: past this many ranks, remote K/V from another node goes over the slower link."""
INTERNODE_GBPS = 50.0
"""Per-GPU bandwidth between nodes (GB/s) the price assumes."""
INTRANODE_GBPS = 304.0
"""Per-GPU NVLink bandwidth of the K/V collectives (GB/s; the H200 cost profile's measured rate)."""
KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2
"""K and V of one token at the law's shape (8 KV heads, d 128, bf16); dK / dV in the merged reduce alike."""


def remote_kv_tokens(
    owner: np.ndarray,
    chunk: np.ndarray,
    kl: np.ndarray,
    kr: np.ndarray,
    chunk_size: int,
    cp_size: int,
    group_size: int = 1,
) -> np.ndarray:
    """int64 `[cp]`: K/V tokens each rank fetches: the union of the key ranges its chunks' rows need
    (`chunk`, `kl`, `kr` from the (slice, chunk) pieces), less the tokens of its own chunks (`owner`: the
    rank of each chunk). Self-attention (keys are the query sequence). Exact, vectorised.

    With `group_size` g > 1: less the tokens of every chunk held in the rank's group of g ranks (ranks
    `g * (r // g)` onwards: a node), i.e. what the rank fetches from outside its node."""
    return remote_kv_tokens_by_group(owner, chunk, kl, kr, chunk_size, cp_size, (group_size,))[0]


def remote_kv_tokens_by_group(
    owner: np.ndarray,
    chunk: np.ndarray,
    kl: np.ndarray,
    kr: np.ndarray,
    chunk_size: int,
    cp_size: int,
    group_sizes: tuple[int, ...],
) -> list[np.ndarray]:
    """`remote_kv_tokens` for each group size of `group_sizes` (e.g. `(1, NODE)`: all received keys and
    those from other nodes), the key unions computed once."""
    if chunk.size == 0:
        return [np.zeros(cp_size, dtype=np.int64) for _ in group_sizes]
    span = int(owner.size) * chunk_size + 1  # ranks' coordinates never overlap after this shift
    starts, lens, covered = _union_runs(owner, chunk, kl, kr, span)
    union = np.zeros(cp_size, dtype=np.int64)
    np.add.at(union, starts // span, lens)  # union per rank
    outs = []
    for g in group_sizes:
        out = union.copy()
        # minus the tokens of the rank's group inside its union
        members = (owner // g * g)[:, None] + np.arange(g)[None, :]  # [n, g]
        ok = members < cp_size
        holder = members[ok]
        c = np.broadcast_to(np.arange(owner.size, dtype=np.int64)[:, None], members.shape)[ok]
        a = c * chunk_size + holder * span
        np.subtract.at(out, holder, covered(a + chunk_size) - covered(a))
        outs.append(out)
    return outs


def _union_runs(owner: np.ndarray, chunk: np.ndarray, kl: np.ndarray, kr: np.ndarray, span: int):
    """Per rank, the union of the key ranges its chunks' rows need, as sorted disjoint runs in one shifted
    coordinate (rank r's keys at `r * span` onwards): `(starts, lens, covered)`, where `covered(x)` counts
    the union's tokens below each shifted position in `x` (any shape)."""
    rank = owner[chunk]
    s = kl + rank * span
    e = kr + rank * span
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run_end = np.maximum.accumulate(e)
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > run_end[:-1]  # a gap before this interval: a new merged run starts
    starts = s[new]
    lens = np.maximum.reduceat(e, np.flatnonzero(new)) - starts
    cum = np.concatenate([[0], np.cumsum(lens)])

    def covered(x: np.ndarray) -> np.ndarray:
        i = np.searchsorted(starts, x, side="right") - 1
        safe = np.maximum(i, 0)
        inside = np.clip(x - starts[safe], 0, lens[safe])
        return np.where(i >= 0, cum[safe] + inside, 0)

    return starts, lens, covered


def rank_traffic(
    owner: np.ndarray, chunk: np.ndarray, kl: np.ndarray, kr: np.ndarray, chunk_size: int, cp_size: int
) -> np.ndarray:
    """int64 `[cp, cp]`: entry `[r, s]` is the K/V tokens rank r fetches from rank s (the tokens of s's chunks
    inside the union of the key ranges r's rows need); the diagonal is 0. Row sums are `remote_kv_tokens`."""
    out = np.zeros((cp_size, cp_size), dtype=np.int64)
    if chunk.size == 0:
        return out
    n = int(owner.size)
    span = n * chunk_size + 1
    _, _, covered = _union_runs(owner, chunk, kl, kr, span)
    a = (
        np.arange(n, dtype=np.int64)[None, :] * chunk_size
        + np.arange(cp_size, dtype=np.int64)[:, None] * span
    )
    per_chunk = covered(a + chunk_size) - covered(a)  # [cp, n]: tokens of chunk c in rank r's union
    onehot = np.zeros((n, cp_size), dtype=np.int64)
    onehot[np.arange(n), owner] = 1
    out = per_chunk @ onehot
    np.fill_diagonal(out, 0)
    return out


@dataclass(frozen=True, slots=True)
class PlanPrice:
    """Per-rank predicted times of one dispatch (float64 arrays of `cp` entries, milliseconds).

    Attributes:
        fwd_ms, bwd_ms: kernel time of each rank's forward / backward (the law alone).
        comm_ms: each rank's K/V fetch (the dK / dV reduce costs the same again in the backward).
        key_columns: each rank's own plus received keys over 128.
        remote: K/V tokens each rank receives (int64).
    """

    fwd_ms: np.ndarray
    bwd_ms: np.ndarray
    comm_ms: np.ndarray
    key_columns: np.ndarray
    remote: np.ndarray

    @property
    def step_ms(self) -> float:
        """The slowest forward (fetch + kernel) plus the slowest backward (kernel + reduce)."""
        return float((self.fwd_ms + self.comm_ms).max() + (self.bwd_ms + self.comm_ms).max())

    @property
    def time_imbalance(self) -> float:
        """(max fwd + max bwd) / (mean fwd + mean bwd) of the kernel times; 1.0 is perfect."""
        mean = float(self.fwd_ms.mean() + self.bwd_ms.mean())
        return float(self.fwd_ms.max() + self.bwd_ms.max()) / mean if mean > 0 else 1.0


def price_plan(
    plan: DispatchPlan,
    slices: list[tuple[int, int, int, int, int]],
    law: KernelLaw,
    *,
    cross: bool = False,
    pieces: tuple[np.ndarray, ...] | None = None,
) -> PlanPrice:
    """Every rank's predicted times of `plan` for the (validated) `slices` by `law`.

    `cross`: keys are another sequence (their layout is not known here): no remote K/V is counted and each
    rank's key columns are its own tokens'. `pieces`: `_key_intervals(slices, plan.chunk_size)` if the
    caller has it."""
    cp = plan.cp_size
    own = np.asarray(plan.shard_seqlens, dtype=np.float64)
    area = np.asarray(plan.rank_areas, dtype=np.float64)
    if cross:
        remote = np.zeros(cp, dtype=np.int64)
        inter = remote
    else:
        chunk, _, kl, kr = pieces if pieces is not None else _key_intervals(slices, plan.chunk_size)
        owner = np.asarray(plan.chunk_owner, dtype=np.int64)
        if cp > NODE:
            remote, inter = remote_kv_tokens_by_group(owner, chunk, kl, kr, plan.chunk_size, cp, (1, NODE))
        else:
            remote = remote_kv_tokens(owner, chunk, kl, kr, plan.chunk_size, cp)
            inter = 0 * remote
    keys = own + remote
    nv = (remote - inter) * KV_BYTES_PER_TOKEN / (INTRANODE_GBPS * 1e9)
    ib = inter * KV_BYTES_PER_TOKEN / (INTERNODE_GBPS * 1e9)
    comm = np.maximum(nv, ib) * 1e3
    return PlanPrice(law.fwd_ms(area, keys, own), law.bwd_ms(area, keys, own), comm, keys / 128, remote)
