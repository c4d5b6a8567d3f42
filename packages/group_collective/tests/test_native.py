"""The native implementation on one machine: its index tables (pure), its kernels with every rank simulated
in one process, and its errors where it cannot run.

Simulated ranks: the ranks' symmetric buffers are slices of one tensor, 256-byte aligned, so
``deltas[p] = (slice_p - slice_r) / 256`` addresses rank ``p``'s buffer from rank ``r`` exactly as the
mapped peer buffers do on GPUs. Every rank stages, then every rank pulls (the barrier's order), and the
results must equal the plain-indexing references of ``magi_group_collective.testing`` (cast bit-exact) and
the all-to-all-v path's Triton reduction bit for bit. On CPU the kernels run under ``TRITON_INTERPRET=1``
(a child process when this one was not started with it); on a CUDA machine they run compiled, on one GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from magi_group_collective import NativeUnavailableError
from magi_group_collective._config import ReduceOp
from magi_group_collective._native_plan import (
    UNIT_BYTES,
    SlotLayout,
    cast_layout,
    cast_staged_pieces,
    reduce_layout,
    reduce_staged_pieces,
)
from magi_group_collective._tables import CastTables
from magi_group_collective.testing import random_cast_tables, reference_cast, reference_reduce, run_ranks

_IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------ pure tables


def _tables(rows):
    return [CastTables.build(*r, len(rows)) for r in rows]


def test_cast_layout_by_hand() -> None:
    # rank 0: pieces [2, 1, 3] -> piece 0 to {1}, piece 1 to {0, 1}, piece 2 to {0}
    # rank 1: pieces [2]       -> piece 0 to {0}
    rows = [
        ([2, 1, 3], [1, 3, 2], [[1], [0, 1], [0]], [0, 0, 1]),
        ([2], [2, 1], [[0]], [0, 0]),
    ]
    t = _tables(rows)
    assert cast_staged_pieces(t[0], 0) == [0, 1] and cast_staged_pieces(t[1], 1) == [0]
    l0, l1 = cast_layout(t, 0), cast_layout(t, 1)
    # rank 0 stages input rows 0, 1 (piece 0) and 2 (piece 1): piece 2 only goes to itself
    assert l0.stage_rows.tolist() == [0, 1, 2]
    # rank 0's output: piece 1 of itself (input row 2), piece 2 of itself (rows 3..5), rank 1's piece 0
    assert l0.src_rank.tolist() == [0, 0, 0, 0, 1, 1]
    assert l0.src_row.tolist() == [2, 3, 4, 5, 0, 1]
    # rank 1's output: rank 0's piece 0 (staged rows 0, 1), then piece 1 (staged row 2)
    assert l1.src_rank.tolist() == [0, 0, 0] and l1.src_row.tolist() == [0, 1, 2]
    assert l0.max_stage_rows == l1.max_stage_rows == 3 and l0.remote and l1.remote
    assert l1.stage_rows.tolist() == [0, 1]


def test_reduce_layout_orders_sources_and_counts_staging() -> None:
    from magi_group_collective._tables import cross_check

    cast = _tables(
        [
            ([2, 1], [2, 1, 1], [[0, 1, 2], [2]], [0, 1, 2]),
            ([1], [2], [[0]], [0]),
            ([1], [2, 1], [[0]], [0, 0]),
        ]
    )
    assert not cross_check(cast)
    red = [c.transpose() for c in cast]
    assert reduce_staged_pieces(red[0], 0) == [1, 2]  # its piece 0 goes back to rank 0 itself
    lay = reduce_layout(red, 0)
    # output piece 0 (2 rows) gets contributions from ranks 0, 1, 2 in increasing rank; piece 1 from rank 2
    assert lay.touched.tolist() == [0, 1, 2]
    assert lay.ptr.tolist() == [0, 3, 6, 7]
    assert lay.c_src.tolist() == [0, 1, 2, 0, 1, 2, 2]
    # rank 0 reads its own rows from its input, ranks 1 and 2 from their staging areas (rank 2 stages
    # both of its pieces: rows 0-1 and 2)
    assert lay.c_row.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert torch.allclose(lay.avg_weight, torch.tensor([1 / 3, 1 / 3, 1.0]))
    assert lay.stage_rows.tolist() == [2, 3] and lay.max_stage_rows == 3 and lay.remote


def test_only_self_sends_need_no_barrier() -> None:
    t = _tables([([3], [3], [[0]], [0]), ([2, 1], [2, 1], [[1], [1]], [1, 1])])
    for r in range(2):
        lay = cast_layout(t, r)
        assert not lay.remote and lay.max_stage_rows == 0 and lay.stage_rows.numel() == 0
        assert lay.src_rank.tolist() == [r] * 3 and lay.src_row.tolist() == [0, 1, 2]
        assert not reduce_layout([x.transpose() for x in t], r).remote


def test_slot_layout() -> None:
    s = SlotLayout.of(max_stage_rows=3, row_bytes=10, lse_row_bytes=12)
    assert s.data_bytes == UNIT_BYTES and s.lse_offset == UNIT_BYTES and s.total == 2 * UNIT_BYTES
    assert SlotLayout.of(0, 100).total == 0
    assert SlotLayout.of(1000, 4096).total == 1000 * 4096


# ------------------------------------------------------------------------------- simulated ranks


def _spaces(W: int, capacity: int, device):
    from magi_group_collective._symmetric import SymSpace

    big = torch.zeros(W * capacity + UNIT_BYTES, dtype=torch.uint8, device=device)
    shift = (-big.data_ptr()) % UNIT_BYTES
    local = [big[shift + p * capacity : shift + (p + 1) * capacity] for p in range(W)]
    out = []
    for r in range(W):
        deltas = [(local[p].data_ptr() - local[r].data_ptr()) // UNIT_BYTES for p in range(W)]
        out.append(SymSpace(local[r], torch.tensor(deltas, dtype=torch.int64, device=device), r))
    return out


def _a2av_reduce(tables, ys, yls, base, base_lse, r, op):
    """Rank r's GroupReduce through the all-to-all-v path's Triton kernels: the receive buffer an
    all_to_all_single would deliver (source-major, each source's pieces in its order), then its reduction."""
    from magi_group_collective._a2av import _A2AVReduce
    from magi_group_collective._comm import Comm
    from magi_group_collective._tables import offsets
    from magi_group_collective._triton_kernels import lse_reduce_rows_csr, reduce_rows_csr

    red_tables = [CastTables.build(*t.args(), len(tables)).transpose() for t in tables]
    runner = _A2AVReduce(red_tables[r], Comm(group=None, world_size=len(tables), rank=r), torch.device(DEV))
    parts, lparts = [], []
    for s, t in enumerate(red_tables):
        off = offsets(t.input_split_sizes)
        for i in t.sends()[r]:
            parts.append(ys[s][off[i] : off[i] + t.input_split_sizes[i]])
            if yls is not None:
                lparts.append(yls[s][off[i] : off[i] + t.input_split_sizes[i]])
    recv = torch.cat(parts) if parts else ys[r][:0]
    out, out_lse = base.clone(), None if base_lse is None else base_lse.clone()
    if op == "lse":
        recv_lse = torch.cat(lparts) if lparts else yls[r][:0]
        if recv.shape[0]:
            lse_reduce_rows_csr(out, out_lse, recv.contiguous(), recv_lse.contiguous(), runner.red)
    elif recv.shape[0]:
        w = runner.avg_weight if op == "avg" else None
        reduce_rows_csr(out.view(out.shape[0], -1), recv.reshape(recv.shape[0], -1), runner.red, w)
    return out, out_lse


def check_simulated(worlds=(1, 2, 3, 5), seeds=range(3)) -> None:
    from magi_group_collective._native import NativeCast, NativeReduce

    dev = torch.device(DEV)
    for W in worlds:
        for seed in seeds:
            tabs = random_cast_tables(W, seed)
            ct = [CastTables.build(*t.args(), W) for t in tabs]
            rt = [c.transpose() for c in ct]
            casts = [NativeCast(cast_layout(ct, r), r, dev) for r in range(W)]
            reds = [NativeReduce(reduce_layout(rt, r), r, dev) for r in range(W)]
            spaces = _spaces(W, 1 << 16, dev)
            gen = torch.Generator().manual_seed(seed)
            # GroupCast: bit-exact for several dtypes / row sizes, both slots
            for dtype, trailing in ((torch.float32, (3, 4)), (torch.bfloat16, (5,)), (torch.int64, ()), (torch.uint8, (3,))):  # fmt: skip
                if dtype.is_floating_point:
                    xs = [
                        torch.randn(sum(t.input_split_sizes), *trailing, generator=gen).to(dtype)
                        for t in tabs
                    ]
                else:
                    xs = [torch.randint(0, 100, (sum(t.input_split_sizes), *trailing), generator=gen).to(dtype) for t in tabs]  # fmt: skip
                for slot in (0, spaces[0].slot_offset(1)):
                    for r in range(W):
                        casts[r].stage(xs[r].to(dev), spaces[r], slot)
                    for r in range(W):
                        out = torch.full(
                            (sum(tabs[r].output_split_sizes), *trailing), 77, dtype=dtype, device=dev
                        )
                        casts[r].pull(xs[r].to(dev), out, spaces[r], slot)
                        want = reference_cast(tabs, xs, r)
                        assert torch.equal(out.cpu(), want), (W, seed, r, dtype, slot)
            # GroupReduce sum / avg / lse: equal to the references, and bitwise equal to the a2av kernels
            ys = [torch.randn(sum(t.output_split_sizes), 3, 4, generator=gen) for t in tabs]
            yls = [torch.randn(sum(t.output_split_sizes), 3, generator=gen) * 2 for t in tabs]
            for y in yls:
                y[torch.rand(y.shape, generator=gen) < 0.2] = float("-inf")
            for op in ("sum", "avg", "lse"):
                lse = op == "lse"
                for r in range(W):
                    reds[r].stage(ys[r].to(dev), yls[r].to(dev) if lse else None, spaces[r], 0)
                for r in range(W):
                    base = torch.randn(sum(tabs[r].input_split_sizes), 3, 4, generator=gen)
                    base_lse = torch.randn(base.shape[:2], generator=gen)
                    base_lse[torch.rand(base_lse.shape, generator=gen) < 0.2] = float("-inf")
                    out, out_lse = base.clone().to(dev), base_lse.clone().to(dev)
                    reds[r].pull(ys[r].to(dev), out, ReduceOp(op), yls[r].to(dev) if lse else None,
                                 out_lse if lse else None, spaces[r], 0)  # fmt: skip
                    want, want_lse = reference_reduce(
                        tabs, ys, base, r, op, yls if lse else None, base_lse if lse else None
                    )
                    if base.numel():
                        assert (out.cpu().double() - want).abs().max() < 1e-5, (W, seed, r, op)
                    if lse and base_lse.numel():
                        fin = want_lse != float("-inf")
                        assert torch.equal(out_lse.cpu() == float("-inf"), ~fin), (W, seed, r)
                        assert (
                            (out_lse.cpu().double()[fin] - want_lse[fin]).abs().max() < 1e-5
                            if fin.any()
                            else True
                        )
                    a_out, a_lse = _a2av_reduce(tabs, [y.to(dev) for y in ys], [y.to(dev) for y in yls] if lse else None,
                                                base.to(dev), base_lse.to(dev) if lse else None, r, op)  # fmt: skip
                    assert torch.equal(out, a_out), f"native != a2av bits: W={W} seed={seed} rank={r} {op}"
                    if lse:
                        assert torch.equal(out_lse, a_lse), f"native lse != a2av bits: W={W} rank={r}"


def check_integer_sum_and_repeatability() -> None:
    from magi_group_collective._native import NativeReduce

    dev = torch.device(DEV)
    W = 3
    tabs = random_cast_tables(W, 11)
    rt = [CastTables.build(*t.args(), W).transpose() for t in tabs]
    reds = [NativeReduce(reduce_layout(rt, r), r, dev) for r in range(W)]
    spaces = _spaces(W, 1 << 14, dev)
    ys = [torch.randint(-1000, 1000, (sum(t.output_split_sizes), 2), dtype=torch.int32) for t in tabs]
    for r in range(W):
        reds[r].stage(ys[r].to(dev), None, spaces[r], 0)
    for r in range(W):
        base = torch.randint(-5, 5, (sum(tabs[r].input_split_sizes), 2), dtype=torch.int32)
        got = base.clone().to(dev)
        reds[r].pull(ys[r].to(dev), got, ReduceOp.SUM, None, None, spaces[r], 0)
        want, _ = reference_reduce(tabs, [y.double() for y in ys], base.double(), r, "sum")
        assert torch.equal(got.cpu(), want.to(torch.int32)), r
    # two runs of the same reduction give the same bits (fixed order, no atomics)
    ys = [torch.randn(sum(t.output_split_sizes), 7) * 1e3 for t in tabs]
    for r in range(W):
        reds[r].stage(ys[r].to(dev), None, spaces[r], 0)
    for r in range(W):
        base = torch.randn(sum(tabs[r].input_split_sizes), 7)
        a, b = base.clone().to(dev), base.clone().to(dev)
        reds[r].pull(ys[r].to(dev), a, ReduceOp.SUM, None, None, spaces[r], 0)
        reds[r].pull(ys[r].to(dev), b, ReduceOp.SUM, None, None, spaces[r], 0)
        assert torch.equal(a, b)


CHECKS = {"simulated": check_simulated, "integer_and_repeat": check_integer_sum_and_repeatability}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_native_kernels_simulated_ranks(name: str) -> None:
    if _IN_PROCESS:
        CHECKS[name]()
        return
    # Triton reads TRITON_INTERPRET when a kernel is defined: run in a child that sets it first.
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('k', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.CHECKS[sys.argv[2]]()"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, __file__, name], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------ errors


def _error_worker(rank: int, world_size: int) -> list[str]:
    """Native on gloo / CPU: NativeUnavailableError on every rank before any communication."""
    import torch.distributed as dist

    import magi_group_collective as mgc

    def no_collective(*a, **k):
        raise AssertionError("a collective started before the native check")

    messages = []
    real = dist.all_gather_object
    dist.all_gather_object = no_collective
    try:
        for impl in ("native", mgc.GroupCollectiveImpl.NATIVE):
            try:
                mgc.GroupCastPlan([1], [1], [[rank]], [rank], impl=impl)
            except mgc.NativeUnavailableError as exc:
                messages.append(str(exc))
        try:
            mgc.GroupReducePlan([1], [1], [rank], [[rank]], impl="native")
        except mgc.NativeUnavailableError as exc:
            messages.append(str(exc))
        os.environ["MAGI_GROUP_COLLECTIVE_IMPL"] = "native"
        try:
            x = torch.ones(1)
            mgc.group_cast(x, torch.empty(1), [1], [1], [[rank]], [rank])
        except mgc.NativeUnavailableError as exc:
            messages.append(str(exc))
        finally:
            del os.environ["MAGI_GROUP_COLLECTIVE_IMPL"]
    finally:
        dist.all_gather_object = real
    return messages


def test_native_raises_on_cpu_on_every_rank_before_communicating() -> None:
    per_rank = run_ranks(2, __file__, "_error_worker")
    assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 4
    for msg in per_rank[0]:
        assert "not a CUDA device" in msg and "impl='a2av'" in msg and "cuda-bindings" in msg, msg
    assert "selected by impl='native'" in per_rank[0][0] and "selected by impl='native'" in per_rank[0][1]
    assert "selected by MAGI_GROUP_COLLECTIVE_IMPL" in per_rank[0][3]
    assert isinstance(NativeUnavailableError("x"), RuntimeError)


class _FakeComm:
    def __init__(self, world_size=2, mesh_shape=None):
        self.group, self.world_size, self.rank, self.mesh_shape = object(), world_size, 0, mesh_shape


def test_native_checks_that_need_cuda(monkeypatch) -> None:
    """The checks after "is this CUDA": backend, several nodes, cuda-bindings missing (driven by patches)."""
    import torch.distributed as dist

    from magi_group_collective import _native

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NativeUnavailableError, match="CUDA is not available"):
        _native.check_native_usable(_FakeComm(), cuda, "impl='native'")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    with pytest.raises(NativeUnavailableError, match="backend is 'gloo', not NCCL"):
        _native.check_native_usable(_FakeComm(), cuda, "impl='native'")
    monkeypatch.setattr(dist, "get_backend", lambda group: "cuda:nccl,cpu:gloo")
    with pytest.raises(NativeUnavailableError, match="2 nodes; native is intra-node only"):
        _native.check_native_usable(_FakeComm(4, (2, 2)), cuda, "impl='native'")
    monkeypatch.setitem(sys.modules, "cuda", None)  # cuda-python not installed
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(
        NativeUnavailableError, match=r"install row \"native\" \(python scripts/install\.py native"
    ):
        _native.check_native_usable(_FakeComm(4, (1, 4)), cuda, "impl='native'")
    # one rank: no peers, so neither NCCL nor cuda-bindings is needed
    _native.check_native_usable(_FakeComm(1), cuda, "impl='native'")


def test_package_imports_without_cuda_python() -> None:
    code = (
        "import sys; sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None\n"
        "import magi_group_collective as m\n"
        "assert m.GroupCollectiveImpl('native') is m.GroupCollectiveImpl.NATIVE\n"
        "from magi_group_collective import _native, _native_plan, _symmetric  # no cuda import at module level\n"
        "try:\n"
        "    _symmetric.import_cudart()\n"
        "except m.NativeUnavailableError as e:\n"
        "    assert 'python scripts/install.py native' in str(e)\n"
        "else:\n"
        "    raise SystemExit('import_cudart must fail without cuda-bindings')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


def test_native_on_one_cpu_rank_refuses_too() -> None:
    """World size 1 needs no peers, but CPU tensors are still refused, with the same message."""
    per_rank = run_ranks(1, __file__, "_error_worker")
    assert len(per_rank[0]) == 4 and all("not a CUDA device" in m for m in per_rank[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_symmetric_buffer_on_one_gpu(tmp_path) -> None:
    """The cuda-bindings calls on one GPU (a one-rank NCCL group): allocate, export, wrap as a tensor, grow,
    barrier, free. The peer mapping itself needs two GPUs (tests/gpu_group_collective_worker.py)."""
    pytest.importorskip("cuda.bindings")
    import torch.distributed as dist

    from magi_group_collective._comm import Comm
    from magi_group_collective._symmetric import NativeBuffer

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        buf = NativeBuffer(Comm(group=dist.group.WORLD, world_size=1, rank=0), device, 4 << 20)
        local = buf.space.local
        assert buf.capacity == 4 << 20 and local.device == device and local.data_ptr() % UNIT_BYTES == 0
        assert int(local.sum()) == 0  # zeroed at allocation
        local.fill_(3)
        assert int(local.sum(dtype=torch.int64)) == 3 * (4 << 20)
        assert buf.space.deltas.tolist() == [0] and buf.next_slot() == 0 and buf.next_slot() == 2 << 20
        buf.reserve(3 << 20)  # two slots of 3 MiB: grows (doubling, whole 2 MiB pages) to 8 MiB
        assert buf.capacity == 8 << 20 and buf.next_slot() == 0
        with torch.cuda.stream(buf.stream):
            buf.barrier()
        torch.cuda.synchronize()
        buf.close()
        assert buf.capacity == 0
    finally:
        dist.destroy_process_group()


def test_native_buffer_sizes_must_agree_on_every_rank() -> None:
    """Ranks that would map different buffer sizes (MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB set differently)
    raise at set-up, alike on every rank: later growth decisions would not be collective otherwise."""
    import types

    from magi_group_collective._symmetric import NativeBuffer

    class TwoRanks:  # the buffer's collective set-up with rank 1's record asking for twice the size
        comm = types.SimpleNamespace(rank=0, world_size=2)
        _dev = 0

        def _gather(self, record):
            return [record, {**record, "nbytes": 2 * record["nbytes"]}]

        def _free_own(self, rt):
            pass

    with pytest.raises(NativeUnavailableError, match="NATIVE_BUFFER_MB must be equal on every rank"):
        NativeBuffer._map(TwoRanks(), 64 << 20)
