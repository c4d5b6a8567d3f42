"""The rank-problem probes' transformations are exact (CPU, fp64, magi_ffa's torch path): folding a GQA
group's heads into the sequence, and the merged call's keys laid out in global aligned order."""

from __future__ import annotations

import torch

import magi_ffa
from benchmarks import common
from benchmarks.rank_problem_probes import TILE, aligned_layout, capture_plan, fold, fold_tables, unfold


def test_folded_heads_give_the_same_gradients() -> None:
    torch.manual_seed(0)
    s, sk, hq, hk, d = 40, 50, 8, 2, 16
    q = torch.randn(s, hq, d, dtype=torch.float64)
    k, v = torch.randn(sk, hk, d, dtype=torch.float64), torch.randn(sk, hk, d, dtype=torch.float64)
    do = torch.randn_like(q)
    tables = (torch.tensor([[0, 20], [10, 40]], dtype=torch.int32), torch.tensor([[0, 30], [5, 50]], dtype=torch.int32),
              torch.tensor([1, 2], dtype=torch.int32))  # fmt: skip
    out, lse = magi_ffa.ffa_fwd(q, k, v, *tables)[:2]
    want = magi_ffa.ffa_bwd(do, q, k, v, out, lse, *tables)[:3]
    g = hq // hk
    assert torch.equal(unfold(fold(q, hk), g), q)
    got = magi_ffa.ffa_bwd(fold(do, hk), fold(q, hk), k, v, fold(out, hk), fold(lse[..., None], hk)[..., 0],
                           *fold_tables(*tables, s, g))[:3]  # fmt: skip
    for a, b in zip(want, (unfold(got[0], g), got[1], got[2]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_aligned_key_layout_gives_the_same_output() -> None:
    torch.manual_seed(0)
    _, plan, captured = capture_plan("varlen_causal", 4, 512)
    shard = plan.dispatch.shard_seqlen
    for rp in plan.ranks:
        n = shard + rp.num_remote_tokens
        q = torch.randn(shard, 2, 8, dtype=torch.float64)
        k, v = torch.randn(n, 1, 8, dtype=torch.float64), torch.randn(n, 1, 8, dtype=torch.float64)
        ((sl, kk, vv),) = common.rank_kernel_calls(rp, 0, k[:shard], v[:shard], k, v)
        slices, index = aligned_layout(*captured[rp.rank])
        starts = [s[2] for s in slices]
        assert all(index[a] >= 0 for a in starts)  # every slice starts on a real key
        idx = torch.as_tensor(index).clamp_min(0)
        at = (torch.tensor([s[0:2] for s in slices], dtype=torch.int32).reshape(-1, 2),
              torch.tensor([s[2:4] for s in slices], dtype=torch.int32).reshape(-1, 2),
              torch.tensor([s[4] for s in slices], dtype=torch.int32))  # fmt: skip
        used = torch.zeros(len(index), dtype=torch.bool)
        for s in slices:
            used[s[2] : s[3]] = True
        assert not used[torch.as_tensor(index) < 0].any()  # no slice sees a pad
        o1, l1 = magi_ffa.ffa_fwd(q, kk, vv, sl.q_ranges, sl.k_ranges, sl.types)[:2]
        o2, l2 = magi_ffa.ffa_fwd(q, kk[idx], vv[idx], *at)[:2]
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(l1, l2)
        assert len(index) - n < TILE * (len(slices) + 1)


def test_ncu_summary_reads_a_raw_export(tmp_path) -> None:
    import csv

    from benchmarks.rank_problem_probes import ncu_summary

    header = ["ID", "Kernel Name", "gpu__time_duration.sum", "sm__cycles_active.avg", "sm__cycles_elapsed.avg",
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
              "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"]  # fmt: skip
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerow(["", "", "ns", "cycle", "cycle", "", ""])
        w.writerow(["0", "bwd_kernel", "1,500", "800", "1000", "0.5", "2.25"])
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))[1:]
    (k,) = ncu_summary(rows)
    assert k["time"] == 1500.0 and k["sm_busy"] == 0.8
    assert list(k["stalls"]) == ["long_scoreboard", "barrier"]


def test_partly_folded_heads_give_the_same_gradients() -> None:
    torch.manual_seed(1)
    s, sk, hq, hk, d, f = 24, 30, 8, 2, 8, 2
    q = torch.randn(s, hq, d, dtype=torch.float64)
    k, v = torch.randn(sk, hk, d, dtype=torch.float64), torch.randn(sk, hk, d, dtype=torch.float64)
    do = torch.randn_like(q)
    tables = (torch.tensor([[0, 24]], dtype=torch.int32), torch.tensor([[0, 30]], dtype=torch.int32),
              torch.tensor([1], dtype=torch.int32))  # fmt: skip
    out, lse = magi_ffa.ffa_fwd(q, k, v, *tables)[:2]
    want = magi_ffa.ffa_bwd(do, q, k, v, out, lse, *tables)[:3]
    assert fold(q, hk, f).shape == (f * s, hq // f, d)
    assert torch.equal(unfold(fold(q, hk, f), f), q)
    got = magi_ffa.ffa_bwd(fold(do, hk, f), fold(q, hk, f), k, v, fold(out, hk, f), fold(lse[..., None], hk, f)[..., 0],
                           *fold_tables(*tables, s, f))[:3]  # fmt: skip
    for a, b in zip(want, (unfold(got[0], f), got[1], got[2]), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
