"""GroupCast / GroupReduce on gloo: one launch of the ranks per world size runs a battery of checks.

Payloads encode their origin (``src_rank * 10_000 + token``) so receivers check routing by value;
references are an all-gather followed by plain indexing (``magi_group_collective.testing``).
"""

from __future__ import annotations

import pytest

from magi_group_collective.testing import run_ranks

CASES_PER_WORLD = 6
NARROW_PAIRS = (("bfloat16", "float32"), ("float16", "float64"), ("float32", "float64"))
"""(input, output) dtypes of the narrower-input GroupReduce checks (names: the ranks import torch late)."""


def _payload(rank: int, n: int, trailing: tuple[int, ...], dtype):
    import math

    import torch

    base = rank * 10_000 + torch.arange(n, dtype=torch.float64)  # origin-encoded: src_rank * 10_000 + token
    if not trailing:
        return base.to(dtype)
    extra = torch.arange(math.prod(trailing), dtype=torch.float64).view(1, *trailing) / 64
    return (base.view(-1, *([1] * len(trailing))) + extra).to(dtype)


def _all(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _cast_checks(rank, W, tabs, t, mod, torch):
    """Bit-exact cast: plan sync/async, functional (cached + fresh), several dtypes and shapes."""
    n_in, n_out = sum(t.input_split_sizes), sum(t.output_split_sizes)
    for trailing, dtype in (
        ((), torch.float64),
        ((3,), torch.bfloat16),
        ((2, 4), torch.int32),
        ((0,), torch.float32),
    ):
        x = _payload(rank, n_in, trailing, dtype)
        if dtype == torch.bfloat16:  # random bit patterns: any value must arrive bit-exact
            x = torch.randint(-(2**15), 2**15, (n_in, *trailing), dtype=torch.int16).view(torch.bfloat16)
        ref = mod.testing.reference_cast(tabs, _all(x), rank)
        plan = mod.GroupCastPlan(*t.args())
        known = mod.GroupCastPlan.from_every_rank([r.args() for r in tabs])  # no gather: tables known
        for path in ("plan-sync", "plan-async", "known", "functional", "functional-async", "fresh"):
            out = torch.full((n_out, *trailing), 7, dtype=dtype)
            if dtype.is_floating_point:
                out.fill_(float("nan"))
            if path == "plan-sync":
                w = plan.cast(x, out)
                assert w.is_completed()
            elif path == "plan-async":
                w = plan.cast(x, out, async_op=True)
                w.wait()
            elif path == "known":
                known.cast(x, out)
            elif path == "functional":
                mod.group_cast(x, out, *t.args())
            elif path == "functional-async":
                mod.group_cast(x, out, *t.args(), async_op=True).wait()
            else:
                mod.clear_collective_plan_cache()
                mod.group_cast(x, out, *t.args(), group=None, async_op=False)
            assert torch.equal(out.view(torch.int16) if dtype == torch.bfloat16 else out, ref.view(torch.int16)
                               if dtype == torch.bfloat16 else ref), f"cast {path} {dtype} {trailing}"  # fmt: skip


def _reduce_checks(rank, W, tabs, t, mod, torch, impl=None, group=None):
    """Reduce sum/avg/lse with transposed tables against the fp64 reference; returns the results."""
    gen = torch.Generator().manual_seed(1234 + rank)
    in_sizes, out_sizes, dst_index, src_indices = t.transpose_args()
    n_in, n_out = sum(in_sizes), sum(out_sizes)
    plan = mod.GroupReducePlan(in_sizes, out_sizes, dst_index, src_indices, group=group, impl=impl)
    results = {}
    for op, dtype, tol in (("sum", torch.float64, 1e-12), ("avg", torch.float32, 1e-5),
                           ("sum", torch.bfloat16, 3e-2), ("lse", torch.float32, 1e-5),
                           ("lse", torch.float64, 1e-12), ("sum", torch.int64, 0.0)):  # fmt: skip
        shape = (2, 3) if op == "lse" else (5,)
        amp = 1000 if dtype == torch.int64 else 1  # integers: spread values so rounding would show
        x = (torch.randn((n_in, *shape), generator=gen, dtype=torch.float64) * amp).to(dtype)
        out0 = (torch.randn((n_out, *shape), generator=gen, dtype=torch.float64) * amp).to(dtype)
        x_lse = out_lse0 = None
        if op == "lse":
            x_lse = torch.randn((n_in, 2), generator=gen, dtype=torch.float32) * 3
            x_lse[torch.rand((n_in, 2), generator=gen) < 0.3] = float("-inf")
            out_lse0 = torch.randn((n_out, 2), generator=gen, dtype=torch.float32) * 3
            out_lse0[torch.rand((n_out, 2), generator=gen) < 0.4] = float("-inf")
            out0[out_lse0 == float("-inf")] = float("nan")  # "nothing yet": must be ignored, never leak
        ref, ref_lse = mod.testing.reference_reduce(
            tabs, _all(x), out0, rank, op, None if x_lse is None else _all(x_lse), out_lse0
        )
        for asyn in (False, True):
            out = out0.clone()
            out_lse = None if out_lse0 is None else out_lse0.clone()
            w = plan.reduce(x, out, reduce_op=op, async_op=asyn, input_lse=x_lse, output_lse=out_lse)
            w.wait()
            scale = 1 + ref.abs().nan_to_num(0)
            if impl is not None and op == "lse":  # the partial lse of the pre-reduction is stored fp32
                tol = max(tol, 1e-6)
            err = ((out.double() - ref).abs() / scale).nan_to_num(0).max().item() if out.numel() else 0.0
            assert err <= tol, f"reduce {op} {dtype} async={asyn}: max rel err {err}"
            assert torch.equal(out.isnan(), ref.isnan()), f"reduce {op}: NaN pattern differs"
            if op == "lse":
                assert torch.allclose(out_lse.double(), ref_lse, atol=1e-5, rtol=1e-5), "lse values"
                assert not out_lse.isnan().any(), "lse must never be NaN"
            results[(op, str(dtype), asyn)] = (out, out_lse)
        # deterministic: the fixed-order torch reduction, twice: the same bits both times, the same bits as
        # CPU index_add_ (which adds in received order too), and the reference's values
        for _ in range(2):
            out = out0.clone()
            out_lse = None if out_lse0 is None else out_lse0.clone()
            plan.reduce(x, out, reduce_op=op, input_lse=x_lse, output_lse=out_lse, deterministic=True)
            want, want_lse = results[(op, str(dtype), False)]
            assert torch.equal(out.nan_to_num(3.5), want.nan_to_num(3.5)), (
                f"deterministic reduce {op} {dtype}"
            )
            if op == "lse":
                assert torch.equal(out_lse, want_lse), f"deterministic reduce {op} {dtype}: lse"
        # functional API gives the same bits as the plan
        out = out0.clone()
        out_lse = None if out_lse0 is None else out_lse0.clone()
        if impl is None:
            mod.group_reduce(x, out, in_sizes, out_sizes, dst_index, src_indices, reduce_op=op,
                             input_lse=x_lse, output_lse=out_lse)  # fmt: skip
            assert torch.equal(out.nan_to_num(3.5), results[(op, str(dtype), False)][0].nan_to_num(3.5))
    return results


def _narrow_input_checks(rank, t, mod, torch, pairs, impl=None, group=None):
    """A narrower floating ``input`` (sum / avg) gives the bits of its widened copy on every path, and the
    a2av / hierarchical implementations send it in its own dtype (fewer bytes). ``pairs``: (input, output)
    dtypes to check."""
    import magi_group_collective._a2av as a2av_mod
    import magi_group_collective._hierarchical as hier_mod

    gen = torch.Generator().manual_seed(4321 + rank)
    in_sizes, out_sizes, dst_index, src_indices = t.transpose_args()
    n_in, n_out = sum(in_sizes), sum(out_sizes)
    plan = mod.GroupReducePlan(in_sizes, out_sizes, dst_index, src_indices, group=group, impl=impl)
    sent: list = []  # dtype of every buffer the runner hands to all_to_all_single
    module = hier_mod if plan.impl == mod.GroupCollectiveImpl.HIERARCHICAL else a2av_mod
    real_a2a = module.a2a

    def recording_a2a(recv, send, *args):
        sent.append((send.dtype, recv.dtype))
        return real_a2a(recv, send, *args)

    for narrow, wide in ((getattr(torch, a), getattr(torch, b)) for a, b in pairs):
        # values that round when narrowed, so a wrong widening or a product taken in the narrow dtype shows
        x = (torch.randn((n_in, 5), generator=gen, dtype=torch.float64) * 3).to(narrow)
        out0 = (torch.randn((n_out, 5), generator=gen, dtype=torch.float64) * 3).to(wide)
        for op in ("sum", "avg"):
            for det in (False, True):
                want = out0.clone()
                plan.reduce(x.to(wide), want, reduce_op=op, deterministic=det)
                module.a2a = recording_a2a
                try:
                    sent.clear()
                    got = out0.clone()
                    plan.reduce(x, got, reduce_op=op, deterministic=det)
                    assert sent and sent[0] == (narrow, narrow), f"{narrow} input sent as {sent}"
                    got_async = out0.clone()
                    plan.reduce(x, got_async, reduce_op=op, async_op=True, deterministic=det).wait()
                finally:
                    module.a2a = real_a2a
                where = f"{plan.impl} {op} {narrow}->{wide} deterministic={det}"
                assert torch.equal(got, want), f"narrow input {where}: not the bits of the widened input"
                assert torch.equal(got_async, want), f"narrow input {where} async"
                if impl is None and group is None:
                    got = out0.clone()
                    mod.group_reduce(x, got, *t.transpose_args(), reduce_op=op, deterministic=det)
                    assert torch.equal(got, want), f"functional narrow input {where}"
    if impl is None:
        # a runner that moves only output's dtype (native's) gets the input widened by the plan first
        plan._runner.narrow_input = False
        module.a2a = recording_a2a
        try:
            sent.clear()
            got = out0.clone()
            plan.reduce(x, got)
        finally:
            module.a2a = real_a2a
            del plan._runner.narrow_input
        want = out0.clone()
        plan.reduce(x.to(wide), want)
        assert sent[0] == (wide, wide) and torch.equal(got, want), f"widened by the plan: sent {sent}"


def _adjoint_and_autograd(rank, W, tabs, t, mod, torch):
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(99 + rank)
    n_in, n_out = sum(t.input_split_sizes), sum(t.output_split_sizes)
    x = torch.randn((n_in, 3), generator=gen, dtype=torch.float64)
    y = torch.randn((n_out, 3), generator=gen, dtype=torch.float64)
    cx = torch.empty_like(y)
    mod.group_cast(x, cx, *t.args())
    ry = torch.zeros_like(x)
    mod.group_reduce(y, ry, *t.transpose_args())
    dots = torch.tensor([(cx * y).sum().item(), (x * ry).sum().item()], dtype=torch.float64)
    dist.all_reduce(dots)
    assert abs(dots[0] - dots[1]) <= 1e-9 * (1 + dots.abs().max()), f"<cast x, y> != <x, reduce y>: {dots}"

    # autograd through cast: d<cast(x), w>/dx = reduce_sum(w)
    xg = x.clone().requires_grad_(True)
    out = torch.empty_like(y)
    mod.group_cast(xg, out, *t.args())
    (out * y).sum().backward()
    assert torch.allclose(xg.grad, ry, atol=1e-12), "cast backward != transposed reduce(sum)"

    # autograd through reduce (sum and avg) onto an output that requires grad too
    for op in ("sum", "avg"):
        yg = y.clone().requires_grad_(True)
        base = torch.randn_like(x).requires_grad_(True)
        acc = base * 1.0
        mod.group_reduce(yg, acc, *t.transpose_args(), reduce_op=op)
        w = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        (acc * w).sum().backward()
        assert torch.equal(base.grad, w), f"reduce {op}: grad of the accumulated output must pass through"
        scale = torch.ones(n_in, dtype=torch.float64)
        if op == "avg":
            off = 0
            for size, dsts in zip(t.input_split_sizes, t.dst_indices):
                scale[off : off + size] = 1.0 / max(1, len(dsts))
                off += size
        ref = mod.testing.reference_cast(tabs, _all(w * scale[:, None]), rank)
        assert torch.allclose(yg.grad, ref, atol=1e-12), f"reduce {op} backward != transposed cast"

    # autograd with a narrower input: forward as the widened input, input's gradient back in its own dtype
    y32 = y.float().requires_grad_(True)
    acc = torch.zeros_like(x).requires_grad_(True) * 1.0
    mod.group_reduce(y32, acc, *t.transpose_args())
    want = torch.zeros_like(x)
    mod.group_reduce(y32.detach().double(), want, *t.transpose_args())
    assert torch.equal(acc.detach(), want), "narrow input under autograd: forward"
    w = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    (acc * w).sum().backward()
    assert y32.grad.dtype == torch.float32, y32.grad.dtype
    ref = mod.testing.reference_cast(tabs, _all(w), rank).float()
    assert torch.equal(y32.grad, ref), "narrow input under autograd: backward != transposed cast"


def _bad_inputs(rank, W, mod, torch):
    """Local errors raise on the calling rank before any communication (no collective involved)."""
    good = ([2, 1], [2, 1], [[rank], [rank]], [rank, rank])  # consistent: construction checks across ranks
    bad_tables = [
        (([2, 1], [1], [[0]], [0]), ValueError, "dst_indices"),
        (([2, 1], [1], [[0], [W]], [0]), ValueError, "out of range"),
        (([2, 1], [1], [[0], [0, 0]], [0]), ValueError, "twice"),
        (([2, -1], [1], [[0], [0]], [0]), ValueError, "input_split_sizes"),
        (([2, 1], [1], [[0], [0]], [-1]), ValueError, "src_index"),
        (([2, 1.0], [1], [[0], [0]], [0]), TypeError, "input_split_sizes"),
    ]
    for args, exc, words in bad_tables:
        with pytest.raises(exc, match=words):
            mod.GroupCastPlan(*args)
    plan = mod.GroupCastPlan(*good)
    x, out = torch.zeros(3, 2), torch.zeros(3, 2)
    for a, b, exc, words in (
        (torch.zeros(4, 2), out, ValueError, "sum\\(input_split_sizes\\)"),
        (x, torch.zeros(2, 2), ValueError, "sum\\(output_split_sizes\\)"),
        (x, torch.zeros(3, 2, dtype=torch.float64), TypeError, "dtype"),
        (x, torch.zeros(3, 3), ValueError, "trailing shape"),
        (x.to("meta"), out, ValueError, "device"),
    ):
        with pytest.raises(exc, match=words):
            plan.cast(a, b)
    with pytest.raises(ValueError, match="sum\\(input_split_sizes\\)"):
        mod.group_cast(torch.zeros(5, 2), out, *good)
    rplan = plan.transpose()
    y, acc = torch.zeros(3, 2, 3), torch.zeros(3, 2, 3)
    lse_y, lse_acc = torch.zeros(3, 2), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="reduce_op"):
        rplan.reduce(y, acc, reduce_op="max")
    with pytest.raises(ValueError, match="output_lse"):
        rplan.reduce(y, acc, reduce_op="lse", input_lse=lse_y)
    with pytest.raises(TypeError, match="float32"):
        rplan.reduce(y, acc, reduce_op="lse", input_lse=lse_y.double(), output_lse=lse_acc)
    with pytest.raises(ValueError, match="shape"):
        rplan.reduce(y, acc, reduce_op="lse", input_lse=lse_y, output_lse=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="only used"):
        rplan.reduce(y, acc, reduce_op="sum", input_lse=lse_y)
    with pytest.raises(TypeError, match="floating"):
        rplan.reduce(y.long(), acc.long(), reduce_op="avg")
    # a narrower floating input is allowed for sum / avg only; any other dtype mismatch still raises
    for a, b, op in (
        (y.double(), acc, "sum"),  # wider input
        (y.int(), acc.long(), "sum"),  # integers
        (y.int(), acc, "sum"),
        (y.half(), acc.bfloat16(), "avg"),  # same width, other format (not exact)
        (y.to(torch.complex64), acc.to(torch.complex128), "sum"),
    ):
        with pytest.raises(TypeError, match=r"`input` dtype .* `output` dtype"):
            rplan.reduce(a, b, reduce_op=op)
    with pytest.raises(TypeError, match=r"`input` dtype .* `output` dtype"):
        rplan.reduce(y.bfloat16(), acc, reduce_op="lse", input_lse=lse_y, output_lse=lse_acc)
    with pytest.raises(TypeError, match=r"`input` dtype .* `output` dtype"):
        mod.group_reduce(y.double(), acc, good[1], good[0], good[3], good[2])  # the transposed tables
    with pytest.raises(NotImplementedError, match="lse"):
        mod.group_reduce(y.clone().requires_grad_(True), acc, [1], [3], [0], [[0]], reduce_op="lse",
                         input_lse=lse_y, output_lse=lse_acc)  # fmt: skip
    with pytest.raises(mod.NativeUnavailableError, match="not a CUDA device"):
        mod.GroupCastPlan(*good, impl="native")
    with pytest.raises(ValueError, match="2-D DeviceMesh"):
        mod.GroupCastPlan(*good, impl="hierarchical")
    with pytest.raises(ValueError, match="impl"):
        mod.GroupCastPlan(*good, impl="nccl")


def _hier_checks(rank, W, mesh_shape, seed, mod, torch):
    """Hierarchical on a 2-D mesh: cast bit-identical to the flat impl, reduce == reference."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("inter", "intra"))
    for case in range(3):
        tabs = mod.testing.random_cast_tables(W, seed * 100 + 50 + case)
        t = tabs[rank]
        n_in, n_out = sum(t.input_split_sizes), sum(t.output_split_sizes)
        x = _payload(rank, n_in, (2,), torch.float64)
        flat = torch.full((n_out, 2), float("nan"), dtype=torch.float64)
        hier = flat.clone()
        mod.GroupCastPlan(*t.args()).cast(x, flat)
        plan = mod.GroupCastPlan(*t.args(), group=mesh)  # a 2-D mesh selects the hierarchical impl
        assert plan.impl == mod.GroupCollectiveImpl.HIERARCHICAL
        plan.cast(x, hier, async_op=True).wait()
        assert torch.equal(flat, hier), f"hierarchical cast {mesh_shape} != flat"
        hier.fill_(float("nan"))
        mod.group_cast(x, hier, *t.args(), group=mesh)
        assert torch.equal(flat, hier), f"functional hierarchical cast {mesh_shape} != flat"
        hier.fill_(float("nan"))
        a2av_on_mesh = mod.GroupCastPlan(*t.args(), group=mesh, impl="a2av")  # flat impl over the mesh
        a2av_on_mesh.cast(x, hier)
        assert a2av_on_mesh.impl == "a2av" and torch.equal(flat, hier), "a2av over a 2-D mesh"
        if case == 0:
            _narrow_input_checks(rank, t, mod, torch, NARROW_PAIRS, impl="hierarchical", group=mesh)
        hier_res = _reduce_checks(rank, W, tabs, t, mod, torch, impl="hierarchical", group=mesh)
        flat_res = _reduce_checks(rank, W, tabs, t, mod, torch)
        for key, (out, _lse) in flat_res.items():  # bf16: both already match the fp64 reference
            if "bfloat16" not in key[1]:
                assert torch.allclose(out.double(), hier_res[key][0].double(), atol=1e-5, equal_nan=True), key
        # the transposed plan of a hierarchical cast plan is hierarchical and exchanges nothing more
        rplan = plan.transpose()
        assert rplan.impl == mod.GroupCollectiveImpl.HIERARCHICAL
        y = torch.randn(n_out, 2, dtype=torch.float64)
        a, b = torch.zeros(n_in, 2, dtype=torch.float64), torch.zeros(n_in, 2, dtype=torch.float64)
        rplan.reduce(y, a)
        mod.GroupReducePlan(*t.transpose_args()).reduce(y, b)
        assert torch.allclose(a, b, atol=1e-12), "transposed hierarchical plan"


def _debug_checks(rank, W, mod, torch):
    """Inconsistent tables: debug mode (and the hierarchical plan) raise on every rank, naming the pair."""
    tabs = mod.testing.random_cast_tables(W, 4242)
    t = tabs[0]
    victim = next((j for j, n in enumerate(t.output_split_sizes) if n > 0), None)
    assert victim is not None or rank >= 0
    sizes = list(t.output_split_sizes)
    if victim is None:  # rank 0 receives nothing: claim one extra piece from rank W-1 instead
        bad = (t.input_split_sizes, [1], t.dst_indices, [W - 1])
        pair = f"(sender {W - 1}, receiver 0)"
    else:
        sizes[victim] += 1
        bad = (t.input_split_sizes, sizes, t.dst_indices, t.src_index)
        pair = f"(sender {t.src_index[victim]}, receiver 0)"
    mine = bad if rank == 0 else tabs[rank].args()
    with pytest.raises(ValueError, match=pair.replace("(", "\\(").replace(")", "\\)")):
        mod.GroupCastPlan(*mine, debug=True)
    # consistent tables pass the debug check, and a debug call checks dtype/shape agreement too
    plan = mod.GroupCastPlan(*tabs[rank].args(), debug=True)
    x = torch.zeros(sum(tabs[rank].input_split_sizes), 2)
    plan.cast(x, torch.empty(sum(tabs[rank].output_split_sizes), 2))
    if W % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, W // 2))
        with pytest.raises(ValueError, match="inconsistent"):
            mod.GroupCastPlan(*mine, group=mesh)


def _doc_example(rank, mod, torch):
    """The three-rank picture of docs/packages/group_collective.md, verbatim."""
    tables = {
        0: ([2, 1, 2], [], [[1, 2], [], [2]], []),
        1: ([2], [2], [[2]], [0]),
        2: ([], [2, 2, 2], [], [1, 0, 0]),
    }[rank]
    x = {0: torch.tensor([1.0, 2, 3, 4, 5]), 1: torch.tensor([6.0, 7]), 2: torch.empty(0)}[rank]
    out = torch.full((sum(tables[1]),), float("nan"))
    mod.group_cast(x, out, *tables)
    want = {0: [], 1: [1.0, 2], 2: [6.0, 7, 1, 2, 4, 5]}[rank]  # d, a, c on rank 2
    assert out.tolist() == want, (rank, out.tolist())
    back = torch.zeros(x.shape[0])
    mod.group_reduce(out, back, tables[1], tables[0], tables[3], tables[2])
    want_back = {0: [2.0, 4, 0, 4, 5], 1: [6.0, 7], 2: []}[rank]  # a from ranks 1 and 2 summed
    assert back.tolist() == want_back, (rank, back.tolist())


def battery(rank: int, W: int, seed: int) -> int:
    import torch

    import magi_group_collective as mod
    import magi_group_collective.testing

    checks = 0
    for case in range(CASES_PER_WORLD):
        tabs = mod.testing.random_cast_tables(W, seed * 100 + case)
        t = tabs[rank]
        _cast_checks(rank, W, tabs, t, mod, torch)
        _reduce_checks(rank, W, tabs, t, mod, torch)
        _adjoint_and_autograd(rank, W, tabs, t, mod, torch)
        if case == 0:
            _narrow_input_checks(rank, t, mod, torch, NARROW_PAIRS)
        checks += 1
    _bad_inputs(rank, W, mod, torch)
    _debug_checks(rank, W, mod, torch)
    if W == 3:
        _doc_example(rank, mod, torch)
    if W == 4:
        _hier_checks(rank, W, (2, 2), seed, mod, torch)
    if W == 8:
        _hier_checks(rank, W, (2, 4), seed, mod, torch)
        _hier_checks(rank, W, (4, 2), seed, mod, torch)
    # after local errors on every rank, the group still works (nobody entered a collective)
    tabs = mod.testing.random_cast_tables(W, seed)
    _cast_checks(rank, W, tabs, tabs[rank], mod, torch)
    return checks


def triton_battery(rank: int, W: int, seed: int) -> int:
    """The same checks with the Triton kernels (the CUDA path) forced on, under the interpreter."""
    import os
    import sys

    os.environ["TRITON_INTERPRET"] = "1"  # this child only, before the kernels module is imported
    os.environ["MAGI_GROUP_COLLECTIVE_KERNELS"] = "triton"
    import torch

    import magi_group_collective as mod
    import magi_group_collective.testing

    for case in range(2):
        tabs = mod.testing.random_cast_tables(W, seed * 100 + case)
        _cast_checks(rank, W, tabs, tabs[rank], mod, torch)
        _reduce_checks(rank, W, tabs, tabs[rank], mod, torch)
    _narrow_input_checks(rank, tabs[rank], mod, torch, NARROW_PAIRS[::2])  # the hierarchical checks: all
    _hier_checks(rank, W, (2, W // 2), seed, mod, torch)
    kernels = sys.modules.get("magi_group_collective._triton_kernels")
    assert kernels is not None, "the Triton kernels never ran"
    assert "Interpreted" in type(kernels._copy_rows_kernel).__name__, type(kernels._copy_rows_kernel)
    return 2


def test_battery_triton_kernels() -> None:
    assert run_ranks(4, __file__, "triton_battery", 7) == [2] * 4


@pytest.mark.parametrize("world_size", [2, 3, 4, 8], ids=lambda w: f"world{w}")
def test_battery(world_size: int) -> None:
    counts = run_ranks(world_size, __file__, "battery", world_size)
    assert counts == [CASES_PER_WORLD] * world_size


def _mismatch_worker(rank, W, mod, torch):
    """Tables that disagree across ranks raise at plan construction by default (no debug flag), naming the
    (sender, receiver) pair; a per-call trailing-shape mismatch is caught in debug mode."""
    # every rank sends 3 rows to rank 0; rank 0 expects 4 from rank 1
    outs = ([3] * W if rank else [3, 4] + [3] * (W - 2)) if rank == 0 else []
    tables = ([3], outs, [[0]], list(range(W)) if rank == 0 else [])
    with pytest.raises(ValueError, match=r"\(sender 1, receiver 0\)"):
        mod.GroupCastPlan(*tables)
    # the transposed (GroupReduce) tables: rank 0 sends 4 rows back to rank 1, which expects 3
    with pytest.raises(ValueError, match=r"\(sender 0, receiver 1\)"):
        mod.GroupReducePlan(outs, [3], list(range(W)) if rank == 0 else [], [[0]])
    # every rank's tables known on each rank (GroupCastPlan.from_every_rank): checked locally, same pair
    every = [([3], ([3] * W if r else [3, 4] + [3] * (W - 2)) if r == 0 else [], [[0]],
              list(range(W)) if r == 0 else []) for r in range(W)]  # fmt: skip
    with pytest.raises(ValueError, match=r"\(sender 1, receiver 0\)"):
        mod.GroupCastPlan.from_every_rank(every)
    with pytest.raises(ValueError, match="all"):
        mod.GroupCastPlan.from_every_rank(every[:1])
    good = ([3], [3] * W if rank == 0 else [], [[0]], list(range(W)) if rank == 0 else [])
    plan = mod.GroupCastPlan(*good, debug=True)
    trailing = 2 + (rank == 1)
    x = torch.zeros(3, trailing)
    out = torch.zeros(sum(good[1]), trailing)
    with pytest.raises(ValueError, match="different"):
        plan.cast(x, out)
    # a narrower input is fine, but every rank must pass the same output dtype as well as input dtype
    rtables = (good[1], good[0], good[3], good[2])
    y = torch.zeros(sum(good[1]), 2, dtype=torch.bfloat16)
    acc = torch.zeros(3, 2, dtype=torch.float64 if rank == 1 else torch.float32)
    with pytest.raises(ValueError, match="output dtype"):
        mod.group_reduce(y, acc, *rtables)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_tables_that_disagree_raise_at_plan_construction(world):
    assert all(run_ranks(world, __file__, "_mismatch_entry"))


def _mismatch_entry(rank: int, W: int):
    import torch

    import magi_group_collective as mod

    return _mismatch_worker(rank, W, mod, torch)
