"""Test helpers shared by every package: dense masks, random masks, and a by-the-definition simulation of
GroupCast / GroupReduce on numpy arrays. Written independently of the planner so they can check it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from magi_mask import dense_mask as _dense_mask

from .comm import GroupCastArgs, GroupReduceArgs
from .mask import AttnMaskType, SliceList, decompose_region, tighten_region
from .plan import DistAttnPlan

__all__ = [
    "ascii_mask",
    "check_plan",
    "dense_mask",
    "plan_coverage",
    "random_mask",
    "simulate_group_cast",
    "simulate_group_reduce",
]


def dense_mask(q_ranges: Any, k_ranges: Any, attn_mask_type: Any, total_q: int, total_k: int) -> np.ndarray:
    """int64 `[total_q, total_k]`: how many slices cover each pair, straight from the type definitions
    (`magi_mask.dense_mask` with `count=True`)."""
    return _dense_mask(q_ranges, k_ranges, attn_mask_type, total_q, total_k, count=True)


def ascii_mask(
    q_ranges: Any, k_ranges: Any, attn_mask_type: Any, total_q: int, total_k: int | None = None
) -> str:
    """The mask as text, one row per query: `#` visible, `.` masked, `2`-`9` a pair covered that many times."""
    total_k = total_q if total_k is None else total_k
    d = dense_mask(q_ranges, k_ranges, attn_mask_type, total_q, total_k)
    return "\n".join("".join("." if v == 0 else "#" if v == 1 else str(min(v, 9)) for v in row) for row in d)


def random_mask(
    rng: np.random.Generator, total_seqlen: int, *, max_cells: int = 6, raw_slices: int = 3
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """A random valid mask (no pair covered twice) with overlapping q and k ranges and all four types.

    Cells of a random grid get a random diagonal band (decomposed into typed slices); then a few random
    raw typed slices are added where they do not touch earlier ones.
    """
    n = total_seqlen
    qs_cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n, size=rng.integers(0, 4))]))
    ks_cuts = np.unique(np.concatenate([[0, n], rng.integers(0, n, size=rng.integers(0, 4))]))
    cells = [
        (int(a), int(b), int(c), int(d))
        for a, b in itertools.pairwise(qs_cuts)
        for c, d in itertools.pairwise(ks_cuts)
    ]
    rng.shuffle(cells)
    typed: list[tuple[int, int, int, int, int]] = []
    for a, b, c, d in cells[: int(rng.integers(1, max_cells + 1))]:
        lo = int(rng.integers(c - b - 2, d - a + 2))
        hi = int(rng.integers(lo, d - a + 3))
        r = tighten_region(a, b, c, d, lo, hi)
        if r is not None:
            typed.extend(decompose_region(r))
    covered = (
        dense_mask([t[:2] for t in typed], [t[2:4] for t in typed], [t[4] for t in typed], n, n)
        if typed
        else (np.zeros((n, n), dtype=np.int64))
    )
    for _ in range(raw_slices):
        qs = int(rng.integers(0, n))
        qe = int(rng.integers(qs + 1, n + 1))
        ks = int(rng.integers(0, n))
        ke = int(rng.integers(ks + 1, n + 1))
        t = int(rng.integers(0, 4))
        m = dense_mask([[qs, qe]], [[ks, ke]], t, n, n)
        if m.sum() and not (m & covered).any():
            typed.append((qs, qe, ks, ke, t))
            covered += m
    if not typed:  # keep at least one slice
        typed.append((0, n, 0, n, int(AttnMaskType.CAUSAL)))
    return [[t[0], t[1]] for t in typed], [[t[2], t[3]] for t in typed], [t[4] for t in typed]


def simulate_group_cast(args: Sequence[GroupCastArgs], inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run GroupCast by its definition: rank r's input piece i goes to every rank in `dst_indices[i]`;
    each receiver fills its output pieces in `src_index` order, taking each source's pieces in the order the
    source lists them. Raises AssertionError when the ranks' arguments disagree."""
    cp = len(args)
    sent: list[list[list[np.ndarray]]] = [[[] for _ in range(cp)] for _ in range(cp)]  # [dst][src] queue
    for src, a in enumerate(args):
        assert sum(a.input_split_sizes) == len(inputs[src]), f"rank {src}: input split sizes != input length"
        off = 0
        for n, dsts in zip(a.input_split_sizes, a.dst_indices):
            for d in dsts:
                assert d != src, f"rank {src} casts to itself"
                sent[d][src].append(inputs[src][off : off + n])
            off += n
    outs = []
    for dst, a in enumerate(args):
        taken = [0] * cp
        pieces = []
        for n, src in zip(a.output_split_sizes, a.src_index):
            q = sent[dst][src]
            assert taken[src] < len(q), f"rank {dst} expects more pieces from {src} than it sends"
            piece = q[taken[src]]
            assert len(piece) == n, f"rank {dst}: piece from {src} has {len(piece)} tokens, expected {n}"
            taken[src] += 1
            pieces.append(piece)
        for src in range(cp):
            assert taken[src] == len(sent[dst][src]), f"rank {src} sends {dst} pieces it does not expect"
        outs.append(np.concatenate(pieces) if pieces else inputs[dst][:0])
    return outs


def simulate_group_reduce(
    args: Sequence[GroupReduceArgs], inputs: Sequence[np.ndarray], outputs: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """Run GroupReduce (sum) by its definition: input piece i of rank r is added into the owner
    `dst_index[i]`; the owner's output piece j sums one piece from each rank of `src_indices[j]`, taking each
    source's pieces in that source's order. Returns the accumulated copies of `outputs`."""
    cp = len(args)
    sent: list[list[list[np.ndarray]]] = [[[] for _ in range(cp)] for _ in range(cp)]
    for src, a in enumerate(args):
        assert sum(a.input_split_sizes) == len(inputs[src])
        off = 0
        for n, d in zip(a.input_split_sizes, a.dst_index):
            sent[d][src].append(inputs[src][off : off + n])
            off += n
    res = []
    for dst, a in enumerate(args):
        out = outputs[dst].copy()
        taken = [0] * cp
        off = 0
        for n, srcs in zip(a.output_split_sizes, a.src_indices):
            for s in srcs:
                piece = sent[dst][s][taken[s]]
                assert len(piece) == n
                taken[s] += 1
                out[off : off + n] += piece
            off += n
        assert all(taken[s] == len(sent[dst][s]) for s in range(cp)), "unconsumed reduce pieces"
        res.append(out)
    return res


def _slices_to_global(
    sl: SliceList, q_map: np.ndarray, k_map: np.ndarray, total: int, out: np.ndarray
) -> None:
    for (a, b), (c, d), t in sl.typed_pairs():
        m = dense_mask([[0, b - a]], [[0, d - c]], t, b - a, d - c)
        qi, ki = np.nonzero(m)
        np.add.at(out, (q_map[qi + a], k_map[ki + c]), 1)


def plan_coverage(plan: DistAttnPlan, *, merged: bool = False) -> np.ndarray:
    """int64 `[total_q, total_k]`: how often each global (q, k) pair is computed by the plan (host + stages,
    or the merged slices), translating local q and k (the rank's own keys, then recv buffers) back through the
    plan's own range lists. Self-attention: total_k = total_q and a rank's own keys are its queries."""
    total = plan.dispatch.total_seqlen
    kv = plan.kv_layout
    out = np.zeros((total, total if kv is None else kv.total_seqlen), dtype=np.int64)
    for rp in plan.ranks:
        q_map = np.asarray(rp.host_token_ranges.token_ids(), dtype=np.int64)
        k_own = q_map if kv is None else np.asarray(kv.host_token_ranges(rp.rank).token_ids(), dtype=np.int64)
        bufs = [np.asarray(s.remote_k_ranges.token_ids(), dtype=np.int64) for s in rp.stages]
        if merged:
            _slices_to_global(rp.merged_slices, q_map, np.concatenate([k_own, *bufs]), total, out)
        else:
            _slices_to_global(rp.host_slices, q_map, k_own, total, out)
            for s, buf in zip(rp.stages, bufs):
                _slices_to_global(s.remote_slices, q_map, buf, total, out)
    return out


def check_plan(plan: DistAttnPlan, dense: np.ndarray) -> None:
    """Assert every invariant the runtime relies on, by value, against the dense mask `[total, total]`:
    exact coverage (host + stages and merged), zero-redundancy remote keys, buffer layouts, GroupCast routing
    (payload = global token id) and GroupReduce sums (the exact transpose)."""
    total = plan.dispatch.total_seqlen
    cp = plan.cp_size
    assert (dense <= 1).all()
    # exact coverage, split form and merged form
    assert (plan_coverage(plan) == dense).all(), "host + stage slices do not cover the mask exactly once"
    assert (plan_coverage(plan, merged=True) == dense).all(), (
        "merged slices do not cover the mask exactly once"
    )
    assert plan.rank_areas == plan.dispatch.rank_areas
    for rp in plan.ranks:
        assert len(rp.stages) == plan.num_stages
        rows = np.asarray(rp.host_token_ranges.token_ids())
        assert rows.tolist() == plan.dispatch.position_ids(rp.rank).tolist()
        assert rp.host_area == rp.host_slices.area()
        needed = set(np.flatnonzero(dense[rows].any(axis=0)).tolist()) - set(rows.tolist())
        fetched: list[int] = []
        for st_ in rp.stages:
            buf = st_.remote_k_ranges.token_ids()
            assert len(buf) == st_.num_remote_tokens == sum(st_.cast.output_split_sizes)
            assert st_.area == st_.remote_slices.area()
            fetched += buf
            for (a, b), (c, d), _ in st_.remote_slices.typed_pairs():
                assert 0 <= a < b <= len(rows) and 0 <= c < d <= len(buf)
        assert len(fetched) == len(set(fetched)), "a key is fetched twice"
        assert set(fetched) == needed, "remote keys differ from exactly the needed, non-local keys"
        for (a, b), (c, d), _ in rp.host_slices.typed_pairs():
            assert 0 <= a < b <= len(rows) and 0 <= c < d <= len(rows)
    # GroupCast: payload = global token id, so routing is checked by value
    local = [plan.dispatch.position_ids(r) for r in range(cp)]
    for si in range(plan.num_stages):
        casts = [rp.stages[si].cast for rp in plan.ranks]
        for r, a in enumerate(casts):
            assert sum(a.input_split_sizes) == len(local[r]) == plan.dispatch.shard_seqlens[r]
            assert all(list(d) == sorted(set(d)) and r not in d for d in a.dst_indices)
        outs = simulate_group_cast(casts, local)
        for rp, out in zip(plan.ranks, outs):
            assert out.tolist() == rp.stages[si].remote_k_ranges.token_ids()
            red = rp.stages[si].reduce
            assert red.transpose() == rp.stages[si].cast
            assert (red.input_split_sizes, red.output_split_sizes) == (
                casts[rp.rank].output_split_sizes,
                casts[rp.rank].input_split_sizes,
            )
        # GroupReduce: each rank sends a partial "dK" = (rank + 1) * 1000 + global id for every fetched token;
        # each owner must receive the sum over the ranks that fetched each of its tokens
        parts = [(r + 1) * 1000 + o.astype(np.int64) for r, o in enumerate(outs)]
        got = simulate_group_reduce(
            [rp.stages[si].reduce for rp in plan.ranks],
            parts,
            [np.zeros(len(local[r]), dtype=np.int64) for r in range(cp)],
        )
        expect = np.zeros(total, dtype=np.int64)
        for r, o in enumerate(outs):
            np.add.at(expect, o, (r + 1) * 1000 + o)
        for r in range(cp):
            assert got[r].tolist() == expect[local[r]].tolist()
