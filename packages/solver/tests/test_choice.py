"""The dispatch choice: the chunk size and algorithm chosen per mask and cp size through `plan_attention`,
the one planning path (balance bounds, purity, explicit sizes, plan time, the CLI's JSON)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from magi_solver import (
    DispatchChoice,
    OverlapCostModel,
    PlanOptions,
    default_chunk_size,
    dispatch_choice,
    get_profile,
    long_tailed_cu_seqlens,
    make_block_causal_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
    plan_attention,
)
from magi_solver.choice import (
    _key_intervals,
    choose_dispatch,
    clear_dispatch_cache,
    mask_digest,
    remote_kv_tokens,
)
from magi_solver.cli import lognormal_doc_lens
from magi_solver.cli import main as plan_cli
from magi_solver.mask import normalize_mask


def _lognormal(total: int) -> list[int]:
    return [0, *np.cumsum(lognormal_doc_lens(total, 300, 0)).tolist()]


def _video(total: int) -> tuple:
    frame = 1560
    cu = [*range(0, total - frame + 1, 8 * frame), total]
    return tuple(make_block_causal_mask(cu, frame))


FAMILIES = {
    "docs_lognormal_causal": lambda n: tuple(make_varlen_causal_mask(_lognormal(n))),
    "docs_lognormal_full": lambda n: tuple(make_varlen_full_mask(_lognormal(n))),
    "docs_long_causal": lambda n: tuple(make_varlen_causal_mask(long_tailed_cu_seqlens(n))),
    "video_block_causal": _video,
    "causal": lambda n: tuple(make_varlen_causal_mask([0, n])),
}


def _remote_of_fixed_rule(q, k, t, total: int, cp: int) -> int:
    plan = plan_attention(
        q, k, t, total, cp, chunk_size=default_chunk_size(total, cp), options=PlanOptions(overlap_degree=0)
    )
    return max(plan.remote_tokens_per_rank)


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("cp", [8, 16])
def test_chosen_dispatch_balances_each_family(name: str, cp: int) -> None:
    # the area and remote K/V targets hold for the chunk dispatch asked for by name (a chosen chunk size)
    total = 2048 * cp
    q, k, t = FAMILIES[name](total)
    plan = plan_attention(q, k, t, total, cp, options=PlanOptions(dispatch_alg="affinity", overlap_degree=0))
    c = plan.choice
    assert isinstance(c, DispatchChoice)
    assert c.chunk_size == plan.dispatch.chunk_size and c.algorithm == plan.dispatch.alg.value
    assert c.imbalance == pytest.approx(plan.imbalance)
    # the achieved imbalance lies between its bound and the target at 2k tokens per GPU
    assert c.lower_bound_imbalance - 1e-9 <= c.imbalance <= 1.05
    # and never worse than the fixed rule's bound (what that rule could at best reach)
    fixed = plan_attention(q, k, t, total, cp, chunk_size=default_chunk_size(total, cp))
    assert c.imbalance <= max(fixed.dispatch.lower_bound_imbalance, 1.0) + 0.011  # its balance slack
    assert c.remote_kv_tokens_max == max(plan.remote_tokens_per_rank)
    # the target is 1.25x (benchmarks/plan_targets.py reports it)
    assert c.remote_kv_tokens_max <= 1.25 * _remote_of_fixed_rule(q, k, t, total, cp)
    assert c.reason.endswith(".") and str(c.chunk_size) in c.reason


def test_heavy_tailed_pack_beats_the_fixed_rule() -> None:
    # the CLI's own builder at cp 8, 8k tokens per GPU: the fixed chunk (1024) cannot go below 1.12
    total, cp = 8192 * 8, 8
    q, k, t = FAMILIES["docs_lognormal_causal"](total)
    fixed = plan_attention(q, k, t, total, cp, chunk_size=1024)
    assert fixed.dispatch.lower_bound_imbalance > 1.1
    chosen = plan_attention(q, k, t, total, cp, options=PlanOptions(dispatch_alg="affinity"))
    assert chosen.imbalance <= 1.03 and chosen.dispatch.chunk_size < 1024
    assert "1024 cannot balance" in chosen.choice.reason


@pytest.mark.parametrize("per_gpu", [8192, 2048])
def test_heavy_tailed_pack_moves_little_more_than_the_fixed_rule(per_gpu: int) -> None:
    # cp 16: chunk 1024 (8k per GPU) cannot balance the CLI's own builder below 1.147; the smaller sizes
    # that balance it spread its long documents over more ranks. Target 1.25x the fixed rule's remote K/V;
    # the choice keeps a margin (this row moved 1.26x when the balancing swaps scattered those documents)
    total, cp = per_gpu * 16, 16
    q, k, t = FAMILIES["docs_lognormal_causal"](total)
    clear_dispatch_cache()
    plan = plan_attention(q, k, t, total, cp, options=PlanOptions(dispatch_alg="affinity", overlap_degree=0))
    assert plan.choice.imbalance <= (1.03 if per_gpu == 8192 else 1.05)
    assert plan.choice.remote_kv_tokens_max <= 1.2 * _remote_of_fixed_rule(q, k, t, total, cp)


def test_remote_estimate_is_exact() -> None:
    rng = np.random.default_rng(0)
    for cp, total in ((2, 256), (4, 512), (8, 1024)):
        cuts = np.sort(rng.choice(np.arange(1, total), 6, replace=False)).tolist()
        q, k, t = make_varlen_causal_mask([0, *cuts, total])
        slices = normalize_mask(q, k, t, total, total)
        for chunk in (16, 32):
            choice, dispatch = choose_dispatch(slices, total, cp, chunk_size=chunk, alg="affinity")
            plan = plan_attention(q, k, t, total, cp, chunk_size=chunk, dispatch=dispatch)
            assert choice.remote_kv_tokens_max == max(plan.remote_tokens_per_rank)
            # what each rank fetches from outside its group of 2 ranks (a "node"), against the plan's casts
            owner = np.asarray(dispatch.chunk_owner)
            pieces = _key_intervals(slices, chunk)
            got = remote_kv_tokens(owner, pieces[0], pieces[2], pieces[3], chunk, cp, group_size=2)
            want = [
                sum(n for st in rp.stages for n, src in zip(st.cast.output_split_sizes, st.cast.src_index)
                    if src // 2 != r // 2)
                for r, rp in enumerate(plan.ranks)
            ]  # fmt: skip
            assert got.tolist() == want


def test_choice_is_a_pure_function_across_processes() -> None:
    # every rank computes it alone: a fresh interpreter (other hash seed) must find the same dispatch
    total, cp = 2048 * 16, 16
    q, k, t = FAMILIES["docs_lognormal_full"](total)
    clear_dispatch_cache()
    choice, dispatch = dispatch_choice(q, k, t, total, cp)
    clear_dispatch_cache()
    again, dispatch2 = dispatch_choice(q, k, t, total, cp)
    assert again == choice and dispatch2.partitions == dispatch.partitions
    code = (
        "import json, numpy as np\n"
        "from magi_solver import dispatch_choice, make_varlen_full_mask\n"
        "from magi_solver.cli import lognormal_doc_lens\n"
        f"cu = [0, *np.cumsum(lognormal_doc_lens({total}, 300, 0)).tolist()]\n"
        "q, k, t = make_varlen_full_mask(cu)\n"
        f"c, d = dispatch_choice(q, k, t, {total}, {cp})\n"
        "print(json.dumps([c.chunk_size, c.algorithm, [list(p) for p in d.partitions]]))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    got = json.loads(out.stdout)
    assert got == [choice.chunk_size, choice.algorithm, [list(p) for p in dispatch.partitions]]


def test_dispatch_is_solved_once_per_mask() -> None:
    total, cp = 4096, 4
    q, k, t = FAMILIES["docs_long_causal"](total)
    clear_dispatch_cache()
    _, d1 = dispatch_choice(q, k, t, total, cp)
    plan = plan_attention(q, k, t, total, cp, options=PlanOptions(dispatch_alg=None))
    assert plan.dispatch is d1  # the plan reused the cached solve
    again = plan_attention(q, k, t, total, cp, chunk_size=d1.chunk_size, dispatch=d1)
    assert again.dispatch is d1  # the same mask's dispatch is taken as it is


def test_explicit_chunk_size_and_algorithm_win() -> None:
    total, cp = 8192, 8
    q, k, t = FAMILIES["docs_lognormal_causal"](total)
    for chunk in (64, 128, 256):
        plan = plan_attention(q, k, t, total, cp, chunk_size=chunk)
        assert plan.dispatch.chunk_size == chunk and plan.choice.algorithm == "min_heap"
        assert "given" in plan.choice.reason
    plan = plan_attention(q, k, t, total, cp, chunk_size=128, options=PlanOptions(dispatch_alg="zigzag"))
    assert plan.dispatch.alg.value == "zigzag"
    # a chosen chunk with an explicit algorithm keeps the algorithm
    plan = plan_attention(q, k, t, total, cp, options=PlanOptions(dispatch_alg="sequential"))
    assert plan.choice.algorithm == "sequential"


def test_chosen_chunk_never_pads_more_than_the_fixed_rule() -> None:
    for total, cp in ((10_000, 3), (5000, 8), (70_001, 16)):
        q, k, t = make_varlen_causal_mask([0, total // 3, total])
        c, d = dispatch_choice(q, k, t, total, cp)
        fixed = default_chunk_size(total, cp)
        step = fixed * cp
        assert d.total_seqlen <= -(-total // step) * step
        assert d.total_seqlen % (c.chunk_size * cp) == 0


def test_plan_options_checked_when_built() -> None:
    with pytest.raises(ValueError, match="dispatch_alg"):
        PlanOptions(dispatch_alg="fastest")
    with pytest.raises(TypeError, match="uneven_shard"):
        PlanOptions(uneven_shard=1)
    with pytest.raises(ValueError, match="overlap_degree"):
        PlanOptions(overlap_degree=-1)
    with pytest.raises(ValueError, match="min_chunk_size"):
        PlanOptions(min_chunk_size=0)
    with pytest.raises(TypeError, match="options"):
        plan_attention([[0, 8]], [[0, 8]], "full", 8, 1, options={"overlap_degree": 0})
    with pytest.raises(ValueError, match="chunk_size"):
        dispatch_choice([[0, 8]], [[0, 8]], "full", 8, 2, chunk_size=0)


def test_mask_digest_tells_masks_apart() -> None:
    a = normalize_mask([[0, 8]], [[0, 8]], "causal", 8, 8)
    b = normalize_mask([[0, 8]], [[0, 8]], "full", 8, 8)
    assert mask_digest(a) == mask_digest(list(a)) != mask_digest(b)


@pytest.mark.parametrize("name", ["causal", "docs_lognormal_causal", "video_block_causal"])
def test_plan_time_at_1m_tokens_cp64(name: str) -> None:
    # the benchmark reports the 1 s target (benchmarks/plan_targets.py); CI allows 3 s on a shared machine
    total, cp = 1 << 20, 64
    q, k, t = FAMILIES[name](total)
    model = OverlapCostModel(get_profile("h200", "fa4"), 64, 8, 128)
    options = PlanOptions(dispatch_alg=None, overlap_degree=None, dynamic_max_degree=4, cost_model=model)
    clear_dispatch_cache()
    t0 = time.process_time()  # CPU time of this process: other jobs on the machine do not count
    plan = plan_attention(q, k, t, total, cp, options=options)
    assert time.process_time() - t0 <= 3.0
    c = plan.choice
    assert c.predicted_fwd_ms > 0 and c.predicted_bwd_ms > 0
    assert c.algorithm in ("documents", "affinity", "min_heap")


def _cli_json(argv: list[str]) -> list[dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert plan_cli(argv) == 0
    return json.loads(out.getvalue())  # stdout holds only JSON


def test_cli_json_schema_without_chunk_size(tmp_path) -> None:
    total = 2048 * 8
    q, k, t = FAMILIES["docs_lognormal_causal"](total)
    path = tmp_path / "mask.json"
    path.write_text(
        json.dumps(
            {
                "q_ranges": [[r.start, r.end] for r in q],
                "k_ranges": [[r.start, r.end] for r in k],
                "types": [int(x) for x in t],
            }
        )
    )
    recs = _cli_json(["--slices", str(path), "--cp", "4,8", "--json", "--quiet"])
    assert [r["cp"] for r in recs] == [4, 8]
    for rec in recs:
        for key, typ in (
            ("chunk_size", int),
            ("imbalance", float),
            ("lower_bound_imbalance", float),
            ("overlap_degree", int),
            ("remote_kv_tokens_max", int),
        ):
            assert isinstance(rec[key], typ), key
        choice, _ = dispatch_choice(q, k, t, total, rec["cp"])
        assert rec["chunk_size"] == choice.chunk_size  # the runtime's choice
        assert rec["dispatch_alg"] == choice.algorithm
        assert rec["lower_bound_imbalance"] <= rec["imbalance"] + 1e-9
        # every rank's kernel time by the law, the slowest of which the choice predicted
        fwd, bwd = np.asarray(rec["rank_fwd_ms"]), np.asarray(rec["rank_bwd_ms"])
        assert fwd.shape == bwd.shape == (rec["cp"],)
        assert fwd.max() == pytest.approx(choice.predicted_fwd_ms)
        assert bwd.max() == pytest.approx(choice.predicted_bwd_ms)
        want = (fwd.max() + bwd.max()) / (fwd.mean() + bwd.mean())
        assert rec["time_imbalance"] == pytest.approx(want)
        assert rec["key_columns_max"] >= rec["tokens_per_rank"] / 128
        assert rec["recv_buffer_bytes_max"] == rec["remote_kv_tokens_max"] * rec["kv_bytes_per_token"]
    explicit = _cli_json(["--slices", str(path), "--cp", "8", "--chunk-size", "512", "--json", "--quiet"])
    assert explicit[0]["chunk_size"] == 512


def test_cli_help_fits_80_columns() -> None:
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run(
        [sys.executable, "-m", "magi_solver.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    widest = max(out.stdout.splitlines(), key=len)
    assert len(widest) <= 80, widest
