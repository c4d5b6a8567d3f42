"""Past one node the chosen dispatch numbers its ranks so that ranks exchanging the most keys share a node:
the same chunks per rank, the same balance and remote K/V, fewer keys crossing nodes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from magi_solver import make_varlen_causal_mask, make_varlen_full_mask
from magi_solver.choice import (
    _key_intervals,
    choose_dispatch,
    clear_dispatch_cache,
    group_by_node,
    rank_traffic,
    remote_kv_tokens,
)
from magi_solver.cli import lognormal_doc_lens
from magi_solver.dispatch import dispatch_slices
from magi_solver.mask import normalize_mask

NODE = 8


def _docs(total: int, seed: int, causal: bool = True) -> list:
    cu = [0, *np.cumsum(lognormal_doc_lens(total, 120, seed)).tolist()]
    q, k, t = make_varlen_causal_mask(cu) if causal else make_varlen_full_mask(cu)
    return normalize_mask(q, k, t, total, total)


def _crossing(plan, slices) -> np.ndarray:
    chunk, _, kl, kr = _key_intervals(slices, plan.chunk_size)
    owner = np.asarray(plan.chunk_owner)
    return remote_kv_tokens(owner, chunk, kl, kr, plan.chunk_size, plan.cp_size, NODE)


def _traffic(plan, slices) -> np.ndarray:
    chunk, _, kl, kr = _key_intervals(slices, plan.chunk_size)
    return rank_traffic(np.asarray(plan.chunk_owner), chunk, kl, kr, plan.chunk_size, plan.cp_size)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cp", [4, 16, 24])
def test_traffic_rows_sum_to_each_ranks_remote_keys(seed: int, cp: int) -> None:
    total, chunk_size = cp * 1024, 128
    slices = _docs(total, seed, causal=seed % 2 == 0)
    plan = dispatch_slices(slices, total, cp, chunk_size, "min_heap")
    traffic = _traffic(plan, slices)
    chunk, _, kl, kr = _key_intervals(slices, chunk_size)
    remote = remote_kv_tokens(np.asarray(plan.chunk_owner), chunk, kl, kr, chunk_size, cp)
    assert np.array_equal(traffic.sum(axis=1), remote)
    assert np.all(np.diag(traffic) == 0) and np.all(traffic >= 0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cp", [16, 24, 32])
def test_renumbering_keeps_every_ranks_work_and_never_crosses_more(seed: int, cp: int) -> None:
    total = cp * 2048
    slices = _docs(total, seed, causal=seed % 3 != 0)
    plan = dispatch_slices(slices, total, cp, 256, "min_heap")
    grouped = group_by_node(plan, _traffic(plan, slices), NODE)
    # a renumbering: the same chunk sets, areas and remote keys, only on other ranks
    assert sorted(grouped.partitions) == sorted(plan.partitions)
    assert sorted(grouped.rank_areas) == sorted(plan.rank_areas)
    assert grouped.imbalance == plan.imbalance and grouped.lower_bound == plan.lower_bound
    before, after = _crossing(plan, slices), _crossing(grouped, slices)
    assert (after.max(), after.sum()) <= (before.max(), before.sum())
    assert group_by_node(plan, _traffic(plan, slices), NODE) == grouped  # the same on every rank


def test_a_scrambled_numbering_is_gathered_into_nodes() -> None:
    """Two documents per node's worth of ranks, dealt out round-robin: grouping brings each document's ranks
    back together, and no key crosses a node."""
    cp, per_rank = 16, 4
    chunk_size = 256
    total = cp * per_rank * chunk_size
    doc = total // 2  # two documents, each spanning 8 ranks' chunks
    slices = normalize_mask([[0, doc], [doc, total]], [[0, doc], [doc, total]], [0, 0], total, total)
    n = total // chunk_size
    # rank r holds chunks of document r % 2 only: the documents' ranks alternate
    docs = [list(range(0, n // 2)), list(range(n // 2, n))]
    parts = [tuple(docs[r % 2][(r // 2) * per_rank : (r // 2 + 1) * per_rank]) for r in range(cp)]
    plan = dispatch_slices(slices, total, cp, chunk_size, "min_heap")
    areas = tuple(sum(plan.chunk_areas[c] for c in p) for p in parts)
    scrambled = dataclasses.replace(plan, partitions=tuple(parts), rank_areas=areas)
    assert _crossing(scrambled, slices).max() > 0
    grouped = group_by_node(scrambled, _traffic(scrambled, slices), NODE)
    assert _crossing(grouped, slices).max() == 0


def test_one_node_keeps_its_numbering() -> None:
    total = 8 * 2048
    slices = _docs(total, 0)
    plan = dispatch_slices(slices, total, 8, 256, "min_heap")
    assert group_by_node(plan, _traffic(plan, slices), NODE) is plan


def test_the_chosen_dispatch_crosses_nodes_less(monkeypatch) -> None:
    """A heavy-tailed pack at cp 16, 8k tokens per GPU (the planner's own builder): the choice with node
    grouping sends the busiest rank fewer keys across nodes than the same choice without it."""
    from magi_solver import choice

    total, cp = 16 * 8192, 16
    cu = [0, *np.cumsum(lognormal_doc_lens(total, 300, 0)).tolist()]
    slices = normalize_mask(*make_varlen_causal_mask(cu), total, total)
    clear_dispatch_cache()
    # the chunk dispatch (scattered chunks: its renumbering has the most to do)
    _, grouped = choose_dispatch(slices, total, cp, alg="affinity")
    monkeypatch.setattr(choice, "group_by_node", lambda plan, traffic, node_size=NODE: plan)
    clear_dispatch_cache()
    _, plain = choose_dispatch(slices, total, cp, alg="affinity")
    clear_dispatch_cache()
    assert _crossing(grouped, slices).max() < _crossing(plain, slices).max()
    assert grouped.imbalance <= plain.imbalance + 0.01
