"""The deterministic backward's dQ write order (``magi_ffa_cudnn._dq_order``), checked on the CPU.

The order is a pure function of a plan's key-to-query block lists. Checked here: every query block's writers
are numbered 0..k-1 (a sum in a fixed order), group 1 is cuDNN's own order (descending key blocks), and a
simulation of the kernel's schedule (CTAs launched in cuDNN's order into a bounded number of SMs, each adding
its query blocks' dQ in its visiting order when the block's semaphore reaches its rank) runs every mask to
the end with no more resident CTAs than the bound, and a band in a fraction of cuDNN's order's time.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from magi_ffa_cudnn._dq_order import RESIDENT_CTAS, dq_write_ranks, head_swizzle

from magi_ffa.testing import make_attn_mask, random_overlapping_slices

TILE = 128


def _block_lists(mask: torch.Tensor, tile: int = TILE):
    """A plan's compact key-to-query lists of a dense [S_q, S_k] bool mask: row n = key block n's partial,
    then full, query blocks (ascending), as cuDNN's plan stores them (one mask head)."""
    sq, sk = mask.shape
    mb, nb = -(-sq // tile), -(-sk // tile)
    pad = torch.zeros(mb * tile, nb * tile, dtype=torch.bool)
    pad[:sq, :sk] = mask
    valid = torch.zeros_like(pad)
    valid[:sq, :sk] = True
    blocks = pad.reshape(mb, tile, nb, tile)
    visible = blocks.any(3).any(1)  # [mb, nb]
    full = (blocks | ~valid.reshape(mb, tile, nb, tile)).all(3).all(1) & visible
    partial = visible & ~full
    lists = []
    for kind in (partial, full):
        count = kind.sum(0).to(torch.int32)[None]  # [1, nb]
        offset = torch.zeros(nb + 1, dtype=torch.int32)
        offset[1:] = torch.cumsum(count[0], 0)
        index = torch.cat([kind[:, n].nonzero().flatten() for n in range(nb)]).to(torch.int32)
        lists += [count, offset, index]
    return lists, visible


def _rows(lists):
    """Each key block's (query block, list, slot) in visiting order."""
    pc, po, pi, fc, fo, fi = lists
    rows = []
    for n in range(pc.shape[1]):
        rows.append(
            [(int(pi[s]), 0, s) for s in range(int(po[n]), int(po[n]) + int(pc[0, n]))]
            + [(int(fi[s]), 1, s) for s in range(int(fo[n]), int(fo[n]) + int(fc[0, n]))]
        )
    return rows


class Deadlock(RuntimeError):
    pass


def simulate(lists, ranks, *, heads: int, swizzle: int, resident: int) -> int:
    """Ticks until every CTA is done: cuDNN's launch order (sections of ``swizzle`` heads, key blocks
    descending, heads minor), at most ``resident`` CTAs at once, one tick to compute a query block and its dQ
    added when the block's semaphore equals the pair's rank (``ranks`` None: never waits, the lower bound).
    Raises Deadlock when nothing can move."""
    rows = _rows(lists)
    n_blocks = len(rows)
    launch = []
    for section in range(0, heads, swizzle):
        width = min(swizzle, heads - section)
        for b in range(n_blocks):
            launch += [(h, n_blocks - 1 - b) for h in range(section, section + width)]
    sem = [dict() for _ in range(heads)]
    running: list[list] = []  # [head, key block, next write, ticks of compute left]
    nxt, ticks = 0, 0
    while nxt < len(launch) or running:
        while len(running) < resident and nxt < len(launch):
            h, n = launch[nxt]
            nxt += 1
            if rows[n]:
                running.append([h, n, 0, 1])
        moved = False
        for cta in running:
            h, n, k, left = cta
            if left:
                cta[3], moved = 0, True
                continue
            m, which, slot = rows[n][k]
            if ranks is None or sem[h].get(m, 0) == int(ranks[which][slot]):
                sem[h][m] = sem[h].get(m, 0) + 1
                cta[2], cta[3], moved = k + 1, 1, True
        running = [c for c in running if c[2] < len(rows[c[1]])]
        if not moved and running:
            raise Deadlock(f"stalled at tick {ticks} with {len(running)} CTAs resident")
        ticks += 1
    return ticks


def _cudnn_ranks(lists, visible):
    """cuDNN 1.32.0's own order: a pair's rank is the number of key blocks above it that see its query block."""
    out = []
    for count, offset, index in (lists[:3], lists[3:]):
        r = torch.zeros_like(index)
        for n in range(count.shape[1]):
            for s in range(int(offset[n]), int(offset[n]) + int(count[0, n])):
                r[s] = int(visible[int(index[s]), n + 1 :].sum())
        out.append(r)
    return out


def _masks(seed: int = 0, total: int = 2048):
    rng = random.Random(seed)
    yield "window", _window(total, 700)
    for i in range(6):
        qr, kr, tm = random_overlapping_slices(rng, total, total, rng.randint(2, 24))
        yield f"random{i}", make_attn_mask(qr, kr, tm, total, total)
    cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(9))})
    docs = [list(d) for d in itertools.pairwise(cuts)]
    yield "docs_causal", make_attn_mask(docs, docs, [1] * len(docs), total, total)
    yield "full", torch.ones(total, total, dtype=torch.bool)


def _window(total: int, w: int) -> torch.Tensor:
    i = torch.arange(total)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)


@pytest.mark.parametrize("name,mask", list(_masks()), ids=lambda x: x if isinstance(x, str) else "")
def test_ranks_number_each_query_blocks_writers_from_zero(name, mask):
    lists, visible = _block_lists(mask)
    for group in (1, 3, 16):
        ranks = dq_write_ranks(*lists, group=group)
        by_block: dict[int, list[int]] = {}
        for rows_of_n in _rows(lists):
            for m, which, slot in rows_of_n:
                by_block.setdefault(m, []).append(int(ranks[which][slot]))
        for m, got in by_block.items():
            assert sorted(got) == list(range(int(visible[m].sum()))), (name, group, m)


@pytest.mark.parametrize("name,mask", list(_masks(1)), ids=lambda x: x if isinstance(x, str) else "")
def test_group_one_is_cudnns_own_order(name, mask):
    lists, visible = _block_lists(mask)
    ours = dq_write_ranks(*lists, group=1)
    theirs = _cudnn_ranks(lists, visible)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("seed", range(3))
def test_no_deadlock_within_the_resident_bound(seed):
    heads, swizzle = 4, 2
    group = RESIDENT_CTAS // swizzle
    for _name, mask in _masks(seed, total=4096):
        lists, _ = _block_lists(mask)
        ranks = dq_write_ranks(*lists, group=group)
        simulate(lists, ranks, heads=heads, swizzle=swizzle, resident=RESIDENT_CTAS)  # raises on a deadlock


def test_the_simulation_finds_a_deadlock_past_the_bound():
    """A group wider than the resident CTAs can stall: the simulation can fail, and the bound matters."""
    lists, _ = _block_lists(_window(4096, 700))
    ranks = dq_write_ranks(*lists, group=32)
    with pytest.raises(Deadlock):
        simulate(lists, ranks, heads=1, swizzle=1, resident=4)


def test_a_band_no_longer_runs_its_ctas_one_after_another():
    """The causal sliding window (cuDNN's order: 33x the default backward at 32k on the H200)."""
    lists, visible = _block_lists(_window(8192, 1024))
    heads, swizzle = 8, head_swizzle(8192, 128, 128, 2)
    theirs = simulate(lists, _cudnn_ranks(lists, visible), heads=heads, swizzle=swizzle, resident=132)
    ours = simulate(
        lists,
        dq_write_ranks(*lists, group=RESIDENT_CTAS // swizzle),
        heads=heads,
        swizzle=swizzle,
        resident=132,
    )
    free = simulate(lists, None, heads=heads, swizzle=swizzle, resident=132)
    assert ours * 3 < theirs, (ours, theirs)
    assert ours < 1.5 * free, (ours, free)


def test_head_swizzle_follows_cudnns_l2_rule():
    assert head_swizzle(32768, 128, 128, 2) == 1  # 32 MiB per head
    assert head_swizzle(8192, 128, 128, 2) == 4  # 8 MiB per head: 5 fit, a power of two
    assert head_swizzle(2048, 128, 128, 2) == 16
    assert head_swizzle(1 << 20, 128, 128, 2) == 1


def test_ranks_read_nothing_back_to_the_host():
    """The rewrite runs when a new mask's first deterministic backward starts: no op that would wait for the
    GPU (a scalar read, a data-dependent shape) may be in it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    lists, _ = _block_lists(_window(2048, 700))
    with Record() as rec:
        dq_write_ranks(*lists, group=8)
    assert not rec.ops & {"_local_scalar_dense", "item", "nonzero", "unique", "masked_select"}, rec.ops
