"""Ranks renumbered by node: ranks that exchange the most keys share a node (fewer keys cross nodes)."""

from __future__ import annotations

import numpy as np

__all__ = ["node_order"]


def node_order(traffic: np.ndarray, cp: int, node_size: int) -> list[int] | None:
    """The rank numbering that groups ranks exchanging the most keys into nodes of `node_size`: position i
    of the result is the old rank that becomes rank i; None where the current numbering stays (cp <=
    `node_size`, or the grouping crosses no less at the busiest rank). `traffic`: `[cp, cp]` K/V tokens
    rank r fetches from rank s (`pricing.rank_traffic`). Deterministic (the same on every rank)."""
    if cp <= node_size:
        return None
    w = (traffic + traffic.T).astype(np.float64)
    free = np.ones(cp, dtype=bool)
    nodes: list[list[int]] = []
    # running sums instead of re-summing sub-matrices: w holds token counts (integers far below 2^53), so
    # every sum is exact in any order and the picks are those of the sums over the sub-matrices
    to_free = w.sum(axis=1)  # each rank's ties to the ranks still free
    while free.any():
        ids = np.flatnonzero(free)
        seed = int(ids[np.argmax(to_free[ids])])  # the rank most tied to the others
        node = [seed]
        free[seed] = False
        to_free -= w[:, seed]
        to_node = w[:, seed].copy()  # each rank's ties to this node
        while len(node) < node_size and free.any():
            ids = np.flatnonzero(free)
            pick = int(ids[np.argmax(to_node[ids])])  # ties: the lowest rank
            node.append(pick)
            free[pick] = False
            to_free -= w[:, pick]
            to_node += w[:, pick]
        nodes.append(node)
    # pairwise swaps between nodes while one keeps more traffic inside nodes (a few passes suffice)
    where = np.empty(cp, dtype=np.int64)
    for k, node in enumerate(nodes):
        where[node] = k
    for _ in range(8):
        inside = np.stack([w[:, node].sum(axis=1) for node in nodes], axis=1)  # [cp, nodes]
        ka, kb = where[:, None], where[None, :]
        gain = (inside[np.arange(cp)[:, None], kb] - inside[np.arange(cp)[:, None], ka]
                + inside[np.arange(cp)[None, :], ka] - inside[np.arange(cp)[None, :], kb] - 2 * w)  # fmt: skip
        gain[ka == kb] = 0.0
        a, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[a, b] <= 0.5:  # traffic counts tokens: at least one more inside, or stop
            break
        na, nb = nodes[where[a]], nodes[where[b]]
        na[na.index(a)], nb[nb.index(b)] = int(b), int(a)
        where[a], where[b] = where[b], where[a]
    order = [r for node in nodes for r in sorted(node)]

    def crossing(numbering: list[int]) -> tuple[int, int]:
        """(busiest rank's, all ranks') keys from other nodes with rank `numbering[i]` at position i."""
        node_of = np.empty(cp, dtype=np.int64)
        node_of[numbering] = np.arange(cp) // node_size
        out = np.where(node_of[:, None] != node_of[None, :], traffic, 0).sum(axis=1)
        return int(out.max()), int(out.sum())

    # the grouping maximises the keys kept inside nodes; the price pays for the busiest rank's crossing
    # keys, so the old numbering stays where it crosses less there
    if order == list(range(cp)) or crossing(order) >= crossing(list(range(cp))):
        return None
    return order
