"""The chunk dispatch's choice is pinned: seeded masks (packed causal documents, windows of documents,
block-causal clips) at cp 2, 4 and 16, explicit `min_heap` / `affinity` with a chosen chunk size (padded and
uneven shards), and the default's chunk-dispatch candidate, must give the chunk size, the assignment, the
balance, the remote K/V, the predicted times and the reason recorded in `data/choice_pins.json` (computed
before the dispatch choice was made cheaper per key: the speedups must not change a placement)."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from pathlib import Path

import pytest

import magi_solver.choice as ch
from magi_solver import long_tailed_cu_seqlens, make_block_causal_mask, make_sliding_window_mask
from magi_solver.kernel_law import law_for_mask
from magi_solver.mask import normalize_mask

PINS = json.loads((Path(__file__).parent / "data" / "choice_pins.json").read_text())


def _masks() -> dict[str, tuple[list, int]]:
    out = {}
    for total, seed in ((4096, 1), (16384, 2), (65536, 3)):
        docs = [[a, b] for a, b in itertools.pairwise(long_tailed_cu_seqlens(total, seed=seed))]
        out[f"causal_docs_{total}_s{seed}"] = (
            normalize_mask(docs, docs, [1] * len(docs), total, total),
            total,
        )
    m = make_sliding_window_mask(long_tailed_cu_seqlens(8192, seed=4), (512, 0))
    out["window_docs_8192_s4"] = (normalize_mask(m.q_ranges, m.k_ranges, m.types, 8192, 8192), 8192)
    m = make_block_causal_mask([0, 3000, 7000, 12000], 500)
    out["block_causal_12000"] = (normalize_mask(m.q_ranges, m.k_ranges, m.types, 12000, 12000), 12000)
    return out


MASKS = _masks()


def _digest(parts) -> str:
    return hashlib.blake2b(json.dumps([list(p) for p in parts]).encode(), digest_size=8).hexdigest()


@pytest.mark.parametrize(
    "pin", PINS, ids=lambda p: f"{p['mask']}-cp{p['cp']}-{p['request']}-u{int(p['uneven'])}"
)
def test_choice_matches_pin(pin: dict) -> None:
    slices, total = MASKS[pin["mask"]]
    ch.clear_dispatch_cache()
    if pin["request"] == "chunked_default":
        cand, why = ch._choose_chunked(
            slices, total, pin["cp"], None, False, False, law_for_mask(slices, total)
        )
        choice, plan = ch._finish(cand, why)
    else:
        choice, plan = ch.choose_dispatch(
            slices, total, pin["cp"], alg=pin["request"], uneven_shard=pin["uneven"]
        )
    got = {
        "chunk_size": plan.chunk_size,
        "alg": plan.alg.value,
        "total_seqlen": plan.total_seqlen,
        "partitions": _digest(plan.partitions),
        "remote_kv_tokens_max": choice.remote_kv_tokens_max,
        "reason": choice.reason,
    }
    assert got == {k: pin[k] for k in got}
    assert plan.imbalance == pytest.approx(pin["imbalance"], rel=1e-12)
    assert choice.predicted_fwd_ms == pytest.approx(pin["predicted_fwd_ms"], rel=1e-9)
    assert choice.predicted_bwd_ms == pytest.approx(pin["predicted_bwd_ms"], rel=1e-9)


@pytest.mark.parametrize(
    ("mask", "cp", "alg", "uneven"),
    [
        ("causal_docs_16384_s2", 2, None, False),
        ("causal_docs_16384_s2", 16, None, False),
        ("window_docs_8192_s4", 4, "min_heap", True),
        ("block_causal_12000", 4, None, False),  # padded: the choice priced 12000 rows, the plan 12288
    ],
)
def test_plan_on_the_chosen_dispatch_equals_a_given_copy(mask: str, cp: int, alg, uneven: bool) -> None:
    """A plan built on the dispatch the choice solved for the same mask (the runtime's root key reuses its
    chunk areas and predicted times) equals the plan built on an equal copy of that dispatch, which is
    measured and priced again."""
    from magi_solver import PlanOptions, dispatch_choice, plan_attention

    slices, total = MASKS[mask]
    q = [s[:2] for s in slices]
    k = [s[2:4] for s in slices]
    t = [s[4] for s in slices]
    ch.clear_dispatch_cache()
    _, dispatch = dispatch_choice(q, k, t, total, cp, dispatch_alg=alg, uneven_shard=uneven)
    opts = PlanOptions(dispatch_alg=alg, uneven_shard=uneven)
    n = dispatch.total_seqlen
    # reused where the plan's length is the one the choice priced (no padding)
    assert (ch.chosen_times(dispatch, ch.mask_digest(slices), n, False) is not None) == (n == total)
    reused = plan_attention(q, k, t, n, cp, chunk_size=dispatch.chunk_size, options=opts, dispatch=dispatch)
    copy = dataclasses.replace(dispatch)
    assert copy is not dispatch and ch.chosen_times(copy, ch.mask_digest(slices), n, False) is None
    again = plan_attention(q, k, t, n, cp, chunk_size=dispatch.chunk_size, options=opts, dispatch=copy)
    assert repr(reused) == repr(again)
    assert reused.choice.predicted_fwd_ms is not None
