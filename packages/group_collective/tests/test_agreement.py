"""The status agreement of the functional `group_cast` / `group_reduce` (on by default, no debug flag): one
rank's bad input, tables or dtypes that disagree across ranks, and ranks in different calls make every
rank raise at once (within 2 s), naming the call and the rank(s); nothing is silent and nothing aborts."""

from __future__ import annotations

import pytest

from magi_group_collective.testing import run_ranks

FAST = 2.0  # seconds: every case must raise on every rank well before any timeout


def _timed(exc_type, match, fn, *args, **kwargs) -> str:
    import time

    t0 = time.monotonic()
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kwargs)
    assert time.monotonic() - t0 < FAST, f"took {time.monotonic() - t0:.1f} s: {info.value}"
    return str(info.value)


def _cases(rank: int, W: int, mod, torch, agreement) -> int:
    """Every rank sends 3 rows to rank 0 (rank 0 receives one piece from every rank)."""
    dst = [[0]]
    src = list(range(W)) if rank == 0 else []
    outs = [3] * W if rank == 0 else []
    x = torch.full((3, 2), float(rank))
    out = torch.zeros(sum(outs), 2)
    n = 0
    # 1. a local error on rank 1 only (wrong token count): rank 1 raises its own, the others name it
    bad = torch.zeros(4, 2) if rank == 1 else x
    if rank == 1:
        _timed(ValueError, r"sum\(input_split_sizes\)", mod.group_cast, bad, out, [3], outs, dst, src)
    else:
        msg = _timed(agreement.AgreementError, r"rank\(s\) \[1\] rejected", mod.group_cast, bad, out, [3], outs,
                     dst, src)  # fmt: skip
        assert "group_cast" in msg and "sum(input_split_sizes)" in msg, msg
    n += 1
    # 2. tables that disagree: rank 0 expects 4 (then 2) rows from rank 1, which sends 3
    for wrong in (4, 2):
        outs_bad = [3, wrong] + [3] * (W - 2) if rank == 0 else []
        out_bad = torch.zeros(sum(outs_bad), 2)
        _timed(ValueError, r"\(sender 1, receiver 0\)", mod.group_cast, x, out_bad, [3], outs_bad, dst, src)
        # the transpose (GroupReduce): rank 0 sends `wrong` rows back to rank 1, which expects 3
        _timed(ValueError, r"\(sender 0, receiver 1\)", mod.group_reduce, out_bad, x.clone(), outs_bad, [3], src,
               dst)  # fmt: skip
        n += 2
    # 3. trailing dims 2 vs 3, dtypes fp32 vs fp64: named with the ranks on each side (gloo would abort)
    t = 2 + (rank == W - 1)
    msg = _timed(agreement.AgreementError, "trailing shape", mod.group_cast, torch.zeros(3, t),
                 torch.zeros(sum(outs), t), [3], outs, dst, src)  # fmt: skip
    assert f"ranks [{W - 1}]" in msg, msg
    dt = torch.float64 if rank == W - 1 else torch.float32
    _timed(agreement.AgreementError, "dtype", mod.group_cast, x.to(dt), out.to(dt), [3], outs, dst, src)
    n += 2
    # 4. ranks in different calls
    if rank == 0:
        _timed(agreement.AgreementError, "different calls", mod.group_reduce, out.clone(), x.clone(), outs, [3],
               src, dst)  # fmt: skip
    else:
        _timed(agreement.AgreementError, "different calls", mod.group_cast, x, out, [3], outs, dst, src)
    n += 1
    # 5. in step again: a good call delivers every rank's rows, forward and backward
    xg = x.clone().requires_grad_()
    mod.group_cast(xg, out, [3], outs, dst, src)
    if rank == 0:
        assert torch.equal(out, torch.arange(W, dtype=out.dtype).repeat_interleave(3)[:, None].expand(-1, 2))
    out.sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(x)), xg.grad
    n += 1
    return n


def _entry(rank: int, W: int) -> int:
    import torch

    import magi_group_collective as mod
    from magi_group_collective import agreement

    return _cases(rank, W, mod, torch, agreement)


@pytest.mark.parametrize("world", [2, 3])
def test_functional_collectives_agree_before_any_data_moves(world: int) -> None:
    assert run_ranks(world, __file__, "_entry", timeout=120) == [9] * world


def _own_gloo_entry(rank: int, W: int) -> int:
    """The path of a group that takes no CPU tensors (NCCL): a gloo backend of our own beside the group."""
    import torch
    import torch.distributed as dist

    import magi_group_collective as mod
    from magi_group_collective import agreement

    agreement._FORCE_OWN_GLOO = True
    group = dist.new_group(list(range(W)))
    host = agreement.host_group_of(group)
    assert host.backend is not None and host.group is group
    dst, src = [[0]], list(range(W)) if rank == 0 else []
    outs = [3] * W if rank == 0 else []
    x, out = torch.full((3, 2), float(rank)), torch.zeros(3 * W if rank == 0 else 0, 2)
    bad = torch.zeros(4, 2) if rank == 1 else x
    _timed(ValueError, "sum\\(input_split_sizes\\)" if rank == 1 else r"rank\(s\) \[1\]", mod.group_cast, bad, out,
           [3], outs, dst, src, group=group)  # fmt: skip
    mod.group_cast(x, out, [3], outs, dst, src, group=group)
    if rank == 0:
        assert out[:, 0].tolist() == [float(r) for r in range(W) for _ in range(3)]
    return 1


def test_host_group_beside_a_group_without_cpu_backend() -> None:
    assert run_ranks(2, __file__, "_own_gloo_entry", timeout=120) == [1, 1]


def test_pair_checksum_detects_a_mismatch() -> None:
    from magi_group_collective.agreement import pair_checksum

    sent = pair_checksum({(0, 1): (3,), (1, 0): (3,)})
    assert sent == pair_checksum({(1, 0): (3,), (0, 1): (3,)})  # order-free
    assert sent != pair_checksum({(0, 1): (4,), (1, 0): (3,)})
    assert sent != pair_checksum({(0, 1): (1, 2), (1, 0): (3,)})  # same count, other pieces
