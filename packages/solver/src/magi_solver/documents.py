"""The documents placement (`DispatchAlg.DOCUMENTS`): keep a mask's units whole, balance predicted time.

A *unit* is a connected group of slices: rows together with the keys they need (a packed document, a video
clip, a document of sliding windows). A rank that holds part of a unit must fetch the keys that part needs,
and every fetched key is a key column of its backward kernel (`kernel_law`); a unit kept on one rank costs
no received keys at all. So the placement:

1. cuts the sequence into equal chunks of `granularity` tokens (128, or 256 past 8,192 chunks) and finds
   the units: slices whose rows or keys overlap form one unit; a chunk shared by the end of one unit and
   the start of the next goes to the side where the two cost less (`documents_units.find_units`);
2. prices any set of chunk runs on one rank by the kernel law: their area, their rows, and the union of the
   keys they need with their own tokens (a causal unit's pieces on one rank share its early keys);
3. fills the ranks in a few ways (`documents_fills`) and judges each by the law's exact per-rank times, past
   one node on the numbering that puts ranks exchanging the most keys in one node (`_best_fill`):

   * *two-ended* (`_two_ended`): the units (and pieces of units) laid end to end, cheapest per chunk first;
     rank 0, 1, ... takes its chunk count as a run from the cheap end and a run from the costly end, split
     so its predicted time is a common target, bisected until the last rank's rest costs the same. The
     layout either keeps long units as two halves of equal cost (the fewest cuts; `_halved`) or cuts a unit
     that cannot sit on one rank into *time-sized* pieces (`_time_pieces`: a piece grows while it and the
     rest of its rank at the fillers' density stay within the target, so a causal unit's later pieces,
     which need all its earlier keys, are shorter);
   * *anchored* (`_anchored`): each costly time-sized piece sits alone on a rank of its own, the pieces of
     one unit on neighbouring ranks, and every rank fills the chunks its piece leaves from both ends of the
     other units laid cheapest first, to the target;
   * past two ranks, the two-ended layouts once more with each rank priced by the worse of its two
     directions against their means (`documents_fills._split_prices`): a rank heavy in tiles and light in
     received keys is the slowest forward while its forward + backward looks balanced.

So a unit that fits a rank's share stays whole where balance allows; a unit costlier than a rank's share is
cut into contiguous pieces on as many ranks as its time needs; a mask that is one unit (a causal document) is
cut like zigzag (each rank an early, cheap run and a late, costly run, paired so their times balance; a
full mask into equal runs); each rank boundary cuts at most the two units at the ends of a rank's runs.

4. repairs the best assignment locally (`documents_repair`): while the rank that sets the slowest forward or
   backward can shift a cut point to a neighbour, or swap a whole unit, and the metric `max fwd + max bwd`
   falls without the predicted step rising, it does;
5. keeps the assignment of least predicted step, except that among those within `_STEP_NOISE` of it the
   least kernel metric wins (a link-time gain that small is not worth a kernel imbalance), and a lower
   metric wins within `_BALANCE_STEP` of the least step and `_BALANCE_REMOTE` of that pick's busiest-rank
   K/V; the split-priced fills replace that pick only with a lower metric under the same two bounds.
6. past two ranks (up to `_FEWER_MAX_CHUNKS` chunks), tries layouts that receive fewer keys: a cut at chunk
   p of a causal unit costs the rank holding the later piece p chunks of keys, so the long units' time-sized
   pieces are sized from their ends (the short remainder is the unit's first piece), and the pick's cut
   units are reordered so the ranks holding fewer of their chunks hold the earlier ones (whole, and one
   unit at a time where no rank gets slower: `documents_orient`). One replaces the pick only where its
   predicted step and kernel metric are no higher, its busiest rank's K/V within `_BALANCE_REMOTE` and its
   time imbalance within `_FEWER_IMBALANCE` (`_no_worse`).

Every rank ends with the same chunk count (uneven shards: counts within one, the short last chunk anywhere),
so the result is an ordinary `DispatchPlan`. A pure function of the mask, cp size and law (every rank
computes the same placement); about linear in the chunks times a few bisection passes (the repair prices a
bounded number of ranks). Self-attention only.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .dispatch import PLACEMENTS, DispatchAlg, DispatchPlan, dispatch_lower_bound, padded_seqlen
from .documents_fills import _balanced_anchored, _balanced_two_ended, _halved, _laid_out, _Virtual
from .documents_orient import oriented, oriented_where_no_worse
from .documents_polish import BALANCED, polish_variants
from .documents_repair import _EVALS, ChunkTables, hull_traffic, repair
from .documents_units import _chunk_tables, _Costs, find_units, token_units
from .kernel_law import KernelLaw, law_for_mask
from .node_groups import node_order
from .pricing import (
    INTERNODE_GBPS,
    INTRANODE_GBPS,
    KV_BYTES_PER_TOKEN,
    rank_traffic,
    remote_kv_tokens,
    remote_kv_tokens_by_group,
)
from .pricing import NODE as PRICING_NODE

__all__ = ["documents_granularity", "documents_plans", "find_units", "token_units"]

_GRANULARITY = 128
_MAX_CHUNKS = 8192
"""Past this many 128-token chunks the placement uses 256-token chunks (its tables stay small)."""
_RANK_TOKENS = 8192
"""Past this many tokens per rank, 256-token chunks too (a rank's plan walks its chunks: fewer, faster)."""
_JUDGED = 4
"""Assignments of each fill (the predicted best first) judged by the law's exact per-rank times."""
_GOOD = 0.01
"""A fill within this share of the floor (`_best_fill`) ends the search."""
_STEP_NOISE = 0.02
"""Predicted steps this close (relative) are equal to the final pick: the lower kernel metric wins."""
_BALANCE_STEP = 0.10
_BALANCE_REMOTE = 1.10
"""An assignment of lower kernel metric (`max fwd + max bwd`) is also preferred while its predicted step
is within `_BALANCE_STEP` of the least and its busiest rank receives at most `_BALANCE_REMOTE` times the
K/V of the base pick (`_ranked`): the links' share of a step is priced at full bandwidth with
no overlap (the runtime overlaps the fetch with the kernels), so a little of it buys a kernel balance
that holds on every rank, while the busiest rank's received keys stay within that share."""
_REPAIRED = 1
_FEWER_KEYS = True
"""Past two ranks, layouts that receive fewer keys are tried against the pick (`_best_fill`, `_no_worse`):
the long units' time-sized pieces sized from their ends (`documents_fills._time_pieces_back`: the short
remainder is a unit's first piece, whose keys are few), and the pick with its cut units' short pieces moved
first (`documents_orient.oriented`), each after the local repair."""
_THIN = 0.5
"""The third fewer-keys layout sizes the long units' pieces as if their ranks' other chunks cost this share
of the fillers' density (`documents_fills._laid_out`): longer pieces, fewer received keys."""
_FEWER_EVALS = 1500
"""The repair budget (ranks priced) of each fewer-keys layout: half the pick's (`documents_repair._EVALS`),
which keeps nearly all of their gains on the packed-document families at a fraction of the time."""
_FEWER_MAX_CHUNKS = 1024
"""Past this many chunks the fewer-keys layouts are not tried: their fills and repairs nearly double the
placement's time (262k tokens at cp 32: 0.37-0.48 s -> 0.68-0.69 s of plan time per new mask on one core),
and on the packed-document families they won nothing there (their gains, up to 5.6 % of the predicted step,
were all at 128-1,024 chunks)."""
_FEWER_IMBALANCE = 0.01
"""How much worse a fewer-keys layout's time imbalance may be than the pick's (`_no_worse`)."""
_SPLIT_FILLS = True
_POLISH = True
"""Past two ranks the pick is polished last (`_polished`)."""
_POLISH_LINKS = (0.0, 2.0)
"""The polish's weights of the slowest link time (`documents_polish.polish`): the kernels alone, and the
links priced too (which often lowers the step and the busiest rank's received keys as well)."""
_POLISH_RUNS = (3, 2)
"""Runs of one unit a rank may hold after the polish's swaps: three (a middle piece besides the early and
late ones) first, two (as the fills lay them) where no polish with three qualifies."""
_POLISH_STEPS = 48
_POLISH_TRIALS = 1200
_POLISH_TOKENS = 1 << 19
"""The polish makes at most `_POLISH_STEPS` swaps and prices at most `_POLISH_TRIALS` exactly, fewer past
`_POLISH_TOKENS` tokens by the square of the ratio (each swap costs more there: more runs and blocks per
rank), which keeps a 1M-token plan at cp 64 within a second on one core."""
_PLAIN_FILLS = 4
"""The sum-priced fills (the first in `_best_fill`); past two ranks two split-priced fills follow."""
"""The best assignments the local repair is run on."""


def documents_granularity(total_seqlen: int, cp_size: int) -> int:
    """The chunk size of the documents placement: 128 tokens, 256 past `_MAX_CHUNKS` chunks or past
    `_RANK_TOKENS` tokens per rank, smaller only
    when a rank would hold less than one chunk (a power of two down to 1)."""
    per_rank = total_seqlen / max(cp_size, 1)
    c = (
        _GRANULARITY
        if total_seqlen <= _GRANULARITY * _MAX_CHUNKS and per_rank <= _RANK_TOKENS
        else 2 * _GRANULARITY
    )
    while c > 1 and total_seqlen < c * cp_size:
        c //= 2
    return c


def _exact_price(
    owner: np.ndarray,
    pieces: tuple,
    area: np.ndarray,
    c: int,
    cp: int,
    law: KernelLaw,
    hull: tuple[np.ndarray, np.ndarray] | None = None,
    busiest: list[int] | None = None,
    means: list[float] | None = None,
) -> tuple[float, float, np.ndarray]:
    """`(step, metric, owner)` of an assignment: past one node its ranks first renumbered so that ranks
    exchanging the most keys share a node (`node_groups.node_order`, as the choice does); the step as
    `pricing.PlanPrice.step_ms` prices it (the slowest forward, K/V fetch + kernel, plus the slowest
    backward, kernel + dK/dV reduce, by the law on the ranks' exact key columns and the links as `pricing`
    prices them), the metric `max fwd + max bwd` of kernel time alone. `hull`: each chunk's key interval
    (own tokens included), the cheaper traffic the renumbering is found from (`hull_traffic`). `busiest`:
    a list the busiest rank's received K/V tokens is appended to; `means`: one `mean fwd + mean bwd` is
    appended to (the time imbalance is the metric over it)."""
    chunk, _, kl, kr = pieces
    if cp > PRICING_NODE:
        traffic = (
            hull_traffic(owner, hull[0], hull[1], c, cp)
            if hull is not None
            else rank_traffic(owner, chunk, kl, kr, c, cp)
        )
        order = node_order(traffic, cp, PRICING_NODE)
        if order is not None:
            renum = np.empty(cp, dtype=np.int64)
            renum[np.asarray(order, dtype=np.int64)] = np.arange(cp, dtype=np.int64)
            owner = renum[owner]
    if cp > PRICING_NODE:
        remote, inter = remote_kv_tokens_by_group(owner, chunk, kl, kr, c, cp, (1, PRICING_NODE))
    else:
        remote = remote_kv_tokens(owner, chunk, kl, kr, c, cp)
        inter = 0 * remote
    own = np.bincount(owner, minlength=cp).astype(np.float64) * c
    rank_area = np.bincount(owner, weights=area, minlength=cp)
    keys = own + remote
    nv = (remote - inter) * KV_BYTES_PER_TOKEN / (INTRANODE_GBPS * 1e9)
    ib = inter * KV_BYTES_PER_TOKEN / (INTERNODE_GBPS * 1e9)
    comm = np.maximum(nv, ib) * 1e3
    fwd = law.fwd_ms(rank_area, keys, own)
    bwd = law.bwd_ms(rank_area, keys, own)
    step = float((fwd + comm).max() + (bwd + comm).max())
    if busiest is not None:
        busiest.append(int(remote.max()) if remote.size else 0)
    if means is not None:
        means.append(float(fwd.mean() + bwd.mean()))
    return step, float(fwd.max() + bwd.max()), owner


def _exact_worst(
    owner: np.ndarray, pieces: tuple, area: np.ndarray, c: int, cp: int, law: KernelLaw
) -> float:
    """The predicted step of an assignment (`_exact_price`)."""
    return _exact_price(owner, pieces, area, c, cp, law)[0]


def _base(judged: list[tuple]) -> tuple:
    """The base pick of `_ranked`: the least kernel metric within `_STEP_NOISE` of the least step."""
    best = min(x[0] for x in judged)
    return min((x for x in judged if x[0] <= best * (1.0 + _STEP_NOISE)), key=lambda x: (x[1], x[0], x[2]))


def _ranked(judged: list[tuple]) -> list[tuple]:
    """`(step, metric, order found, owner, busiest rank's received K/V)` best first. The base pick is the
    least kernel metric among the assignments within `_STEP_NOISE` of the least predicted step (a
    link-time gain that small is not worth a kernel imbalance); an assignment of lower metric goes before
    it while its step is within `_BALANCE_STEP` of the least and its busiest rank receives at most
    `_BALANCE_REMOTE` times the base pick's K/V. The rest follow by step."""
    if not judged:
        return judged
    base = _base(judged)
    best = min(x[0] for x in judged)
    cap = base[4] * _BALANCE_REMOTE

    def near(x: tuple) -> bool:
        return x is base or (x[0] <= best * (1.0 + _BALANCE_STEP) and x[4] <= cap)

    first = sorted((x for x in judged if near(x)), key=lambda x: (x[1], x[0], x[2]))
    rest = sorted((x for x in judged if not near(x)), key=lambda x: (x[0], x[2]))
    return first + rest


def _no_worse(pick: tuple, cands: list[tuple], imbalance: Callable[[tuple], float]) -> tuple | None:
    """The least predicted step among `cands` (`_ranked`'s tuples) that are no worse than `pick` by either
    price (step and kernel metric), whose busiest rank receives at most `_BALANCE_REMOTE` times its K/V and
    whose time imbalance (`imbalance`: the metric over `mean fwd + mean bwd`) is at most `_FEWER_IMBALANCE`
    above its; or None. Such a candidate receives fewer keys where it came from `_FEWER_KEYS`' layouts, so
    it replaces the pick without trading balance for link time or the reverse (fewer received keys lower
    the mean: a slowest rank that stays put is a worse imbalance, kept within that bound)."""
    ok = [x for x in cands if x[0] <= pick[0] and x[1] <= pick[1] and x[4] <= pick[4] * _BALANCE_REMOTE]
    if not ok:
        return None
    cap = imbalance(pick) + _FEWER_IMBALANCE
    ok = [x for x in sorted(ok, key=lambda x: (x[0], x[1], x[2])) if imbalance(x) <= cap]
    return ok[0] if ok else None


def _best_fill(
    costs: _Costs,
    units: np.ndarray,
    whole: np.ndarray,
    room: np.ndarray,
    pieces: tuple,
    area: np.ndarray,
    law: KernelLaw,
    keep: int = 1,
) -> list[np.ndarray]:
    """The `keep` best assignments (`_ranked`, by `_exact_price`: the law's exact per-rank times and the
    links) among the fills, each after the local repair (`documents_repair`):
    the fewest-cuts layout (long units halved; crude and exact run prices), time-sized pieces, costly
    pieces anchored one per rank. The fills run in that order and stop once one comes within `_GOOD` of
    the floor no placement beats (each direction's mean over the ranks with no received keys)."""
    cp = room.size
    c = costs.c
    own = float(room.sum()) * c / cp
    mean_area = float(area.sum()) / cp
    floor = float(law.fwd_ms(mean_area, own, own) + law.bwd_ms(mean_area, own, own))
    base = int(room.min())
    tau = float(whole.sum()) / cp
    halves = _halved(costs, units, whole, base)
    fills = (
        lambda: _balanced_two_ended(_Virtual(costs, halves, union=False), room),
        lambda: _balanced_two_ended(_Virtual(costs, halves), room),
        lambda: _balanced_two_ended(_Virtual(costs, _laid_out(costs, units, whole, base, tau)), room),
        lambda: _balanced_anchored(costs, units, whole, room),
    )
    if _SPLIT_FILLS and cp > 2:  # ranks priced by their worse direction (`documents_fills._split_prices`)
        fills = (
            *fills,
            lambda: _balanced_two_ended(_Virtual(costs, halves, split=True), room),
            lambda: _balanced_two_ended(
                _Virtual(costs, _laid_out(costs, units, whole, base, tau), split=True), room
            ),
        )
    n = costs.klo.size
    lo = np.minimum(costs.klo, np.arange(n, dtype=np.int64) * c)
    hi = np.maximum(costs.khi, (np.arange(n, dtype=np.int64) + 1) * c)
    judged: list[tuple[float, float, int, np.ndarray]] = []
    seen: set[bytes] = set()
    plain = 0  # assignments of the sum-priced fills (the split fills' follow)
    for k, fill in enumerate(fills):
        for owner in fill()[:_JUDGED]:
            key = owner.tobytes()
            if key in seen:
                continue
            seen.add(key)
            busiest: list[int] = []
            step, metric, owner = _exact_price(owner, pieces, area, c, cp, law, (lo, hi), busiest)
            judged.append((step, metric, len(judged), owner, busiest[0]))
        if k < _PLAIN_FILLS:
            plain = len(judged)
        if min(x[0] for x in judged) <= floor * (1.0 + _GOOD):
            break
    tables = ChunkTables(area, lo, hi, units, c, cp, law, PRICING_NODE)

    def repaired(cands: list[tuple], fix: list[tuple], evals: int = _EVALS) -> list[tuple]:
        """`cands` and the repairs of `fix` that lower neither price (exact prices; `evals`: the repair's
        budget of ranks priced)."""
        out = list(cands)
        for step, metric, i, owner, _ in fix:
            fixed = repair(owner, tables, evals)
            if np.array_equal(fixed, owner):
                continue
            busiest: list[int] = []
            s2, m2, fixed = _exact_price(fixed, pieces, area, c, cp, law, (lo, hi), busiest)
            if m2 <= metric and s2 <= step:  # the repair never trades one for the other
                out.append((s2, m2, -1 - i, fixed, busiest[0]))
        return out

    def fixes(ranked: list[tuple], pool: list[tuple]) -> list[tuple]:
        """The best first and the base pick (its busiest rank's K/V caps the others')."""
        fix = ranked[: max(keep, _REPAIRED)]
        base = _base(pool)
        return fix + ([base] if all(x[2] != base[2] for x in fix) else [])

    # the sum-priced fills' pick, then the split fills' where they lower the kernel metric within
    # `_BALANCE_STEP` of its step and `_BALANCE_REMOTE` of its busiest rank's K/V (never a higher metric)
    head = _ranked(judged[:plain])
    out = _ranked(repaired(judged[:plain], fixes(head, judged[:plain])))
    if plain < len(judged):
        pick = out[0]
        extra = [x for x in judged[plain:] if x[1] < pick[1]]
        if extra:
            more = _ranked(extra)
            more = [x for x in _ranked(repaired(extra, fixes(more, extra)))]
            better = [x for x in more if x[1] < pick[1] and x[0] <= pick[0] * (1.0 + _BALANCE_STEP)
                      and x[4] <= pick[4] * _BALANCE_REMOTE]  # fmt: skip
            if better:
                best = min(better, key=lambda x: (x[1], x[0], x[2]))
                out = [best] + [x for x in out if x is not best]
    if _FEWER_KEYS and 2 < cp and n <= _FEWER_MAX_CHUNKS and out[0][0] > floor * (1.0 + _GOOD):
        fewer = [
            lambda: _balanced_two_ended(
                _Virtual(costs, _laid_out(costs, units, whole, base, tau, True)), room
            ),
            lambda: _balanced_anchored(costs, units, whole, room, back=True),
            lambda: _balanced_two_ended(
                _Virtual(costs, _laid_out(costs, units, whole, base, tau, True, _THIN)), room
            ),
        ]
        cands = []
        for fill in fewer:
            for owner in fill()[:_JUDGED]:
                if owner.tobytes() in seen:
                    continue
                seen.add(owner.tobytes())
                busiest = []
                step, metric, owner = _exact_price(owner, pieces, area, c, cp, law, (lo, hi), busiest)
                cands.append((step, metric, len(judged) + len(cands), owner, busiest[0]))
        cands = repaired(cands, _ranked(cands)[:_REPAIRED], _FEWER_EVALS)
        for turned in (
            oriented(out[0][3], units, cp, cp, whole > tau),
            oriented_where_no_worse(out[0][3], tables, whole > tau),
        ):
            if np.array_equal(turned, out[0][3]):
                continue
            busiest = []
            step, metric, turned = _exact_price(turned, pieces, area, c, cp, law, (lo, hi), busiest)
            t = (step, metric, len(judged) + len(cands), turned, busiest[0])
            cands += repaired([t], [t], _FEWER_EVALS)

        def imbalance(x: tuple) -> float:
            means: list[float] = []
            _exact_price(x[3], pieces, area, c, cp, law, (lo, hi), None, means)
            return x[1] / means[0] if means[0] > 0 else 1.0

        best = _no_worse(out[0], cands, imbalance)
        if best is not None:
            out = [best, *out]
    if _POLISH and cp > 2:
        out = _polished(out, tables, pieces, area, law, (lo, hi))
    return [x[3] for x in out[:keep]]


def _polished(out: list[tuple], tables: ChunkTables, pieces: tuple, area: np.ndarray, law: KernelLaw,
              hull: tuple[np.ndarray, np.ndarray]) -> list[tuple]:  # fmt: skip
    """`out` (`_ranked`'s tuples, the pick first) with the pick's best polish first where one qualifies: the
    pick polished with the kernels alone and with the links priced too (`_POLISH_RUNS` runs of a unit per
    rank, fewer where none qualifies); a polished assignment qualifies where it balances better (lower
    kernel metric) at a step within `_STEP_NOISE` and a busiest rank's K/V within `_BALANCE_REMOTE` of the
    pick's; of those within `_FEWER_IMBALANCE` of the least time imbalance, the least step is kept. A pick
    already within `documents_polish.BALANCED` of balanced is left as it is."""
    pick = out[0]
    c, cp, n = tables.tokens_per_chunk, tables.cp, area.size
    was: list[float] = []
    _exact_price(pick[3], pieces, area, c, cp, law, hull, None, was)
    if pick[1] <= was[0] * (1.0 + BALANCED):
        return out
    share = min(1.0, _POLISH_TOKENS / max(n * c, 1)) ** 2
    steps, trials = int(_POLISH_STEPS * share) or 1, int(_POLISH_TRIALS * share) or 1
    kept = []
    for runs in _POLISH_RUNS:
        moved = False
        for smooth in polish_variants(pick[3], tables, [(x, runs) for x in _POLISH_LINKS], steps, trials):
            if np.array_equal(smooth, pick[3]):
                continue
            moved = True
            busiest: list[int] = []
            means: list[float] = []
            step, metric, smooth = _exact_price(smooth, pieces, area, c, cp, law, hull, busiest, means)
            if (
                metric < pick[1]
                and step <= pick[0] * (1.0 + _STEP_NOISE)
                and busiest[0] <= pick[4] * _BALANCE_REMOTE
            ):
                kept.append((metric / means[0], (step, metric, -1 - len(kept), smooth, busiest[0])))
        if kept or not moved:  # fewer runs allowed cannot move what more runs did not
            break
    if not kept:
        return out
    least = min(x[0] for x in kept)
    return [min((x[1] for x in kept if x[0] <= least + _FEWER_IMBALANCE), key=lambda x: (x[0], x[1])), *out]


def documents_plans(
    slices: list[tuple[int, int, int, int, int]],
    total_seqlen: int,
    cp_size: int,
    law: KernelLaw,
    *,
    uneven_shard: bool = False,
    chunk_size: int | None = None,
    keep: int = 1,
) -> list[DispatchPlan]:
    """The `keep` best documents placements (by the predicted step, best first) of validated self-attention `slices` over `total_seqlen` tokens (see the
    module docstring).

    Args:
        slices: `(qs, qe, ks, ke, code)` over the unpadded sequence (self-attention: keys index it too).
        total_seqlen: tokens before padding; padded to a multiple of `chunk_size * cp_size` unless
            `uneven_shard`.
        cp_size: ranks.
        law: the kernel law the pieces are priced with.
        uneven_shard: no padding; chunk counts within one of each other.
        chunk_size: the granularity (None: `documents_granularity`).

        keep: how many of the best assignments found to return (the caller may price them further, e.g.
            after renumbering ranks by node).

    Returns:
        Up to `keep` `DispatchPlan`s with `alg=DispatchAlg.DOCUMENTS`, the best predicted first.
    """
    c = chunk_size or documents_granularity(total_seqlen, cp_size)
    total = total_seqlen if uneven_shard else padded_seqlen(total_seqlen, cp_size, c)
    n = -(-total // c)
    if cp_size > n:
        raise ValueError(f"`cp_size` = {cp_size} is larger than the chunk count {n} at chunk size {c}")
    base, extra = divmod(n, cp_size)
    cap_chunks = np.full(cp_size, base, dtype=np.int64)
    cap_chunks[:extra] += 1
    area, klo, khi, pieces = _chunk_tables(slices, n, c)
    costs = _Costs(area, klo, khi, c, law)
    units = find_units(slices, costs, n)
    nu = units.size - 1
    whole = costs.tiling_costs(units) if nu else np.zeros(0)
    areas = area.tolist()
    lower = dispatch_lower_bound(areas, cp_size)
    plans = []
    for owner in _best_fill(costs, units, whole, cap_chunks, pieces, area, law, keep):
        parts = [np.flatnonzero(owner == r) for r in range(cp_size)]
        plans.append(
            DispatchPlan(
                total_seqlen=total,
                cp_size=cp_size,
                chunk_size=c,
                num_chunks=n,
                partitions=tuple(tuple(int(x) for x in p) for p in parts),
                chunk_areas=tuple(areas),
                rank_areas=tuple(int(area[p].sum()) for p in parts),
                alg=DispatchAlg.DOCUMENTS,
                lower_bound=lower,
                uneven_shard=uneven_shard,
            )
        )
    return plans


def _dispatch_documents(slices: list, total: int, cp: int, chunk_size: int, uneven: bool) -> DispatchPlan:
    """`solve_dispatch(..., alg="documents")`: priced by the law `auto` would pick for the whole mask."""
    law = law_for_mask(slices, total)
    return documents_plans(slices, total, cp, law, uneven_shard=uneven, chunk_size=chunk_size)[0]


PLACEMENTS[DispatchAlg.DOCUMENTS] = _dispatch_documents
