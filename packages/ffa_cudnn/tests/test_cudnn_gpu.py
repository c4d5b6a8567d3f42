"""cuDNN flex_attention forward / backward against the dense fp64 reference (an sm90 / sm100 GPU with
nvidia-cudnn-frontend). Skipped on CPU CI.

The rule of every FFA test: the error to float64 at most twice that of the same-dtype (bf16) torch reference
(``magi_ffa.testing.assert_close_to_ref``).
"""

from __future__ import annotations

import random
import zlib

import magi_ffa_cudnn
import pytest
import torch

from magi_ffa.testing import (
    assert_close_to_ref,
    make_attn_mask,
    random_overlapping_slices,
    ref_attn,
    ref_max_logits,
    split_keys_into_stages,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not magi_ffa_cudnn.cudnn_available(), reason="needs nvidia-cudnn-frontend"),
    # the CuTe DSL warns about long static loops while compiling cuDNN's d256 backward and then re-raises
    # the warning as a compile error when warnings are errors (this repository's pytest.ini)
    pytest.mark.filterwarnings("ignore:This static loop"),
]

DT = torch.bfloat16


def _docs(total: int, seed: int) -> list[tuple[int, int]]:
    rng, out, s = random.Random(seed), [], 0
    while s < total:
        e = min(total, s + rng.randrange(total // 8, total // 2))
        out.append((s, e))
        s = e
    return out


def _mask_case(name: str, total: int, seed: int):
    if name == "full":
        return [[0, total]], [[0, total]], [0]
    if name == "varlen_causal":
        d = _docs(total, seed)
        return [list(x) for x in d], [list(x) for x in d], [1] * len(d)
    if name == "sliding_window":  # causal window of 200 keys per row: a causal head + a bi-causal band
        return [[0, 200], [200, total]], [[0, 200], [1, total]], [1, 3]
    if name == "random_overlap":  # all four types, overlaps, rows that see nothing
        return random_overlapping_slices(random.Random(seed), total, total, 9)
    raise AssertionError(name)


def _refs(leaves, mask, do, sink=None):
    refs = {}
    for key, dtype in (("64", torch.float64), ("lp", DT)):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        extra = []
        s = None
        if sink is not None:
            s = sink.detach().to(torch.float64 if key == "64" else torch.float32).requires_grad_()
            extra = [s]
        o, l = ref_attn(*xs, mask, sink=s)
        refs[key] = (o, l, *torch.autograd.grad(o, [*xs, *extra], do.to(dtype)))
    return refs


def _check(tag, got, refs) -> None:
    for i, (nm, x) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), got)):
        assert_close_to_ref(f"{tag}/{nm}", x, refs["64"][i], refs["lp"][i], DT)


CASES = [
    pytest.param("full", 1000, 8, 8, 128, id="full-mha-d128"),
    pytest.param("varlen_causal", 1500, 16, 2, 128, id="varlen_causal-gqa8-d128"),
    pytest.param("sliding_window", 1200, 16, 2, 128, id="swa-gqa8-d128"),
    pytest.param("random_overlap", 777, 8, 8, 128, id="random-mha-d128"),
    pytest.param("random_overlap", 901, 16, 2, 128, id="random-gqa8-d128"),
    pytest.param("random_overlap", 640, 8, 4, 64, id="random-gqa2-d64"),
    pytest.param("random_overlap", 700, 8, 2, 256, id="random-gqa4-d256"),
    pytest.param("varlen_causal", 1100, 4, 4, 256, id="varlen_causal-mha-d256"),
]


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize(("name", "total", "hq", "hk", "d"), CASES)
def test_matches_reference(name, total, hq, hk, d, det) -> None:
    """Both backwards; the deterministic one adds dQ in the order ``magi_ffa_cudnn._dq_order`` rewrites."""
    seed = zlib.crc32(f"{name}-{total}-{hk}-{d}".encode()) % 1000
    torch.manual_seed(seed)
    dev = torch.device("cuda")
    qr, kr, tm = _mask_case(name, total, seed)
    leaves = [torch.randn(total, h, d, device=dev, dtype=DT, requires_grad=True) for h in (hq, hk, hk)]
    do = torch.randn(total, hq, d, device=dev, dtype=DT)
    out, lse = magi_ffa_cudnn.flex_flash_attn_func(*leaves, qr, kr, tm, deterministic=det)
    grads = torch.autograd.grad(out, leaves, do)
    mask = make_attn_mask(qr, kr, tm, total, total).to(dev)
    _check(name, (out, lse, *grads), _refs(leaves, mask, do))
    empty = ~mask.any(1)
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())


def test_non_contiguous_inputs() -> None:
    """Views of a packed qkv projection and a transposed head-major layout give the contiguous result."""
    torch.manual_seed(1)
    dev, t, hq, hk, d = torch.device("cuda"), 700, 8, 2, 128
    qkv = torch.randn(t, hq + 2 * hk, d, device=dev, dtype=DT)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    qt = torch.randn(hq, t, d, device=dev, dtype=DT).transpose(0, 1)
    qr, kr, tm = _mask_case("random_overlap", t, 3)
    for qq in (q, qt):
        got = magi_ffa_cudnn.flex_flash_attn_func(qq, k, v, qr, kr, tm)
        want = magi_ffa_cudnn.flex_flash_attn_func(
            qq.contiguous(), k.contiguous(), v.contiguous(), qr, kr, tm
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("hk", [8, 2])
def test_stage_launchers_match_one_call(hk: int) -> None:
    """ffa_fwd merging stage by stage into fp32 out / lse, then ffa_bwd per stage from the FINAL out / lse
    accumulating into fp32 dq / dk / dv, equals attention over the union (the runtime's contract)."""
    torch.manual_seed(11 + hk)
    dev, t, hq, d = torch.device("cuda"), 1100, 8, 128
    qr, kr, tm = random_overlapping_slices(random.Random(hk), t, t, 10, types=(0,))
    qr, kr, tm = [*qr, [0, t]], [*kr, [700, 1100]], [*tm, 1]
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=DT) for h in (hq, hk, hk))
    do = torch.randn(t, hq, d, device=dev, dtype=DT)
    cuts = [0, 300, 700, t]
    stages = split_keys_into_stages(qr, kr, tm, cuts)
    out, lse = magi_ffa_cudnn.ffa_fwd(q, k[: cuts[1]], v[: cuts[1]], *stages[0])
    out = out.float()
    for i in range(1, len(stages)):
        ks = slice(cuts[i], cuts[i + 1])
        res = magi_ffa_cudnn.ffa_fwd(q, k[ks], v[ks], *stages[i], out=out, lse=lse)
        assert res[0] is out and res[1] is lse
    out_q = out.to(DT)
    dq = torch.zeros(q.shape, device=dev)
    dk, dv = (torch.zeros(x.shape, device=dev) for x in (k, v))
    for i, st in enumerate(stages):
        ks = slice(cuts[i], cuts[i + 1])
        magi_ffa_cudnn.ffa_bwd(do, q, k[ks], v[ks], out_q, lse, *st, dq=dq, dk=dk[ks], dv=dv[ks])
    mask = make_attn_mask(qr, kr, tm, t, t).to(dev)
    _check("stages", (out, lse, dq, dk, dv), _refs([q, k, v], mask, do))
    g = magi_ffa_cudnn.ffa_bwd(do, q, k, v, out_q, lse, qr, kr, tm)  # no accumulators: q's dtype
    assert all(x.dtype == DT for x in g)


@pytest.mark.parametrize("d", [128, 256])
def test_deterministic_backward_is_bitwise_repeatable(d: int) -> None:
    torch.manual_seed(7)
    dev, t, hq, hk = torch.device("cuda"), 2048, 16, 2
    qr, kr, tm = _mask_case("random_overlap", t, 9)
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=DT) for h in (hq, hk, hk))
    do = torch.randn(t, hq, d, device=dev, dtype=DT)
    out, lse = magi_ffa_cudnn.ffa_fwd(q, k, v, qr, kr, tm)
    runs = [magi_ffa_cudnn.ffa_bwd(do, q, k, v, out, lse, qr, kr, tm, deterministic=True) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("hk", [8, 2])
def test_sink_and_max_logits_match_reference(hk: int) -> None:
    torch.manual_seed(5 + hk)
    dev, t, hq, d = torch.device("cuda"), 900, 8, 128
    qr, kr, tm = _mask_case("random_overlap", t, 4)
    leaves = [torch.randn(t, h, d, device=dev, dtype=DT, requires_grad=True) for h in (hq, hk, hk)]
    sink = (torch.randn(2, hq, device=dev) * 2).requires_grad_()
    do = torch.randn(t, hq, d, device=dev, dtype=DT)
    out, lse, max_logits = magi_ffa_cudnn.flex_flash_attn_func(
        *leaves, qr, kr, tm, sink=sink, return_max_logits=True
    )
    grads = torch.autograd.grad(out, [*leaves, sink], do)
    mask = make_attn_mask(qr, kr, tm, t, t).to(dev)
    refs = _refs(leaves, mask, do, sink=sink)
    _check("sink", (out, lse, *grads[:3]), refs)
    torch.testing.assert_close(grads[3].double(), refs["64"][5].double(), rtol=2e-2, atol=2e-2)
    want = ref_max_logits(*(x.detach().double() for x in leaves[:2]), mask)
    torch.testing.assert_close(max_logits.double(), want, rtol=1e-2, atol=2e-2)
    # the launchers: dsink from ffa_bwd, max logits from ffa_fwd
    o2, l2, m2 = magi_ffa_cudnn.ffa_fwd(
        *(x.detach() for x in leaves), qr, kr, tm, sink=sink.detach(), return_max_logits=True
    )
    assert torch.equal(o2, out.detach()) and torch.equal(m2, max_logits)
    *_, dsink = magi_ffa_cudnn.ffa_bwd(
        do, *(x.detach() for x in leaves), o2, l2, qr, kr, tm, sink=sink.detach()
    )
    # from the launcher's bf16 out (the autograd path differentiates the torch merge instead): against fp64
    # with the rule of the autograd value above
    torch.testing.assert_close(dsink.double(), refs["64"][5].double(), rtol=2e-2, atol=2e-2)


def test_plan_cache_by_value_and_geometry() -> None:
    magi_ffa_cudnn.clear_mask_plan_cache()
    dev = torch.device("cuda")
    q = torch.randn(300, 8, 128, device=dev, dtype=DT)
    k = torch.randn(300, 2, 128, device=dev, dtype=DT)
    a = magi_ffa_cudnn.get_mask_plan(
        q, k, torch.tensor([[0, 300]], dtype=torch.int32, device=dev), [[0, 300]], [1]
    )
    b = magi_ffa_cudnn.get_mask_plan(
        q, k, [[0, 300]], torch.tensor([[0, 300]], device=dev), torch.tensor([1])
    )
    c = magi_ffa_cudnn.get_mask_plan(q, k, [[0, 300]], [[0, 300]], [0])
    d = magi_ffa_cudnn.get_mask_plan(q.half(), k.half(), [[0, 300]], [[0, 300]], [1])
    assert a is b and a is not c and a is not d


@pytest.mark.parametrize(("hk", "d"), [(2, 128), (8, 64), (2, 256)])
def test_cached_launches_equal_first_calls(hk: int, d: int) -> None:
    """The second call of a plan replays its recorded launches: on new inputs it must give exactly what a
    first call (cuDNN's own dispatch) gives on them, deterministic backward, GQA and MHA, d 64 / 128 / 256."""
    torch.manual_seed(11 + d)
    dev, t, hq = torch.device("cuda"), 1300, 8
    qr, kr, tm = _mask_case("random_overlap", t, 21)

    def inputs():
        xs = [torch.randn(t, h, d, device=dev, dtype=DT) for h in (hq, hk, hk)]
        return xs, torch.randn(t, hq, d, device=dev, dtype=DT), torch.randn(t, hq, device=dev) * 0.1

    def run(xs, do, dlse):
        out, lse = magi_ffa_cudnn.ffa_fwd(*xs, qr, kr, tm)
        return (
            out,
            lse,
            *magi_ffa_cudnn.ffa_bwd(do, *xs, out, lse, qr, kr, tm, deterministic=True, dlse=dlse),
        )

    magi_ffa_cudnn.clear_mask_plan_cache()
    run(*inputs())  # first calls: recorded
    xs, do, dlse = inputs()
    replayed = run(xs, do, dlse)
    magi_ffa_cudnn.clear_mask_plan_cache()
    first = run(xs, do, dlse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), replayed, first):
        assert torch.equal(a, b), name
    plan = magi_ffa_cudnn.get_mask_plan(xs[0], xs[1], qr, kr, tm)
    launchers = [key for key in plan.launches if isinstance(key, tuple)]
    assert len(launchers) == 2  # one forward, one backward launch for this layout
    # the deterministic backward's dQ order was rewritten once, before the plan's first ordered backward
    assert plan.launches["dq_order"] is (torch.cuda.get_device_capability(dev)[0] == 9)


def test_launch_recorded_with_aliased_inputs_is_not_replayed() -> None:
    """A first backward with one tensor as both k and v cannot tell the two apart in the kernels'
    arguments: a later call with distinct k and v must still use each (cuDNN's own dispatch)."""
    torch.manual_seed(13)
    dev, t, hq, hk, d = torch.device("cuda"), 900, 8, 2, 128
    qr, kr, tm = _mask_case("random_overlap", t, 5)
    q, k, v = (torch.randn(t, h, d, device=dev, dtype=DT) for h in (hq, hk, hk))
    do = torch.randn(t, hq, d, device=dev, dtype=DT)
    magi_ffa_cudnn.clear_mask_plan_cache()
    out, lse = magi_ffa_cudnn.ffa_fwd(q, k, k, qr, kr, tm)
    magi_ffa_cudnn.ffa_bwd(do, q, k, k, out, lse, qr, kr, tm, deterministic=True)  # recorded, aliased
    out, lse = magi_ffa_cudnn.ffa_fwd(q, k, v, qr, kr, tm)
    got = magi_ffa_cudnn.ffa_bwd(do, q, k, v, out, lse, qr, kr, tm, deterministic=True)
    magi_ffa_cudnn.clear_mask_plan_cache()
    want = magi_ffa_cudnn.ffa_bwd(do, q, k, v, out, lse, qr, kr, tm, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name
