"""FA4 forward/backward against the dense fp64 reference (H200 / any sm90+ GPU with flash-attn-4).

Skipped on CPU CI. Rule of the FFA tests (study 3.4): error within 2x the same-dtype torch reference's error.
Every case uses fresh random inputs and poisons FA4's output buffer with NaN (MAGI_FFA_FA4_POISON=1).
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

import magi_ffa_fa4
from magi_ffa.testing import split_keys_into_stages
from magi_ffa_fa4.testing import assert_close_to_ref, dense_mask, random_overlapping_slices, ref_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not magi_ffa_fa4.fa4_available(), reason="needs flash-attn-4"),
    # the CuTe DSL warns that FA4's varlen forward passes an empty AuxData it cannot type (harmless: compiled
    # as a constant); this repository's pytest.ini turns warnings into errors
    pytest.mark.filterwarnings("ignore:Argument aux_data"),
]

RTOL = {"out": 0.05, "lse": 1e-3, "dq": 0.3, "dk": 0.15, "dv": 0.05}  # bf16 values of the FFA tests


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
    if name == "causal":
        return [[0, total]], [[0, total]], [1]
    if name == "varlen_causal":
        d = _docs(total, seed)
        return [list(x) for x in d], [list(x) for x in d], [1] * len(d)
    if name == "sliding_window":  # causal window of w keys per row: a causal head + a bi-causal band
        w = 200
        return [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
    if name == "varlen_block_causal":
        qr, kr = [], []
        for s, e in _docs(total, seed):
            for b in range(s, e, 128):
                qr.append([b, min(b + 128, e)])
                kr.append([s, min(b + 128, e)])
        return qr, kr, [0] * len(qr)
    if name == "random_overlap":  # all four types, overlaps, rows that see nothing
        return random_overlapping_slices(random.Random(seed), total, total, 9)
    raise AssertionError(name)


def _run(name: str, total: int, hq: int, hk: int, d: int, seed: int, monkeypatch) -> None:
    monkeypatch.setenv("MAGI_FFA_FA4_POISON", "1")
    torch.manual_seed(seed)
    dev, dt = torch.device("cuda"), torch.bfloat16
    qr, kr, tm = _mask_case(name, total, seed)
    q = torch.randn(total, hq, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(total, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(total, hk, d, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn(total, hq, d, device=dev, dtype=dt)
    qr_t = torch.tensor(qr, dtype=torch.int32, device=dev).reshape(-1, 2)
    kr_t = torch.tensor(kr, dtype=torch.int32, device=dev).reshape(-1, 2)
    tm_t = torch.tensor(tm, dtype=torch.int32, device=dev)
    out, lse = magi_ffa_fa4.flex_flash_attn_func(q, k, v, qr_t, kr_t, tm_t)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    mask = dense_mask(qr, kr, tm, total, total)
    refs = {}
    for key, dtype in (("64", torch.float64), ("lp", dt)):
        o, l = ref_attention(q, k, v, mask, dtype=dtype)
        g = torch.autograd.grad(o, (q, k, v), do.to(dtype))
        refs[key] = (o, l, *g)
    for i, (nm, x) in enumerate((("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))):
        assert_close_to_ref(f"{name}/{nm}", x, refs["64"][i], refs["lp"][i], rtol=RTOL[nm])
    empty = ~mask.any(1).to(dev)
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())


CASES = [
    pytest.param("full", 1000, 8, 8, 128, id="full-mha-d128"),
    pytest.param("causal", 1000, 16, 2, 128, id="causal-gqa8-d128"),
    pytest.param("varlen_causal", 1500, 8, 8, 128, id="varlen_causal-mha-d128"),
    pytest.param("sliding_window", 1200, 16, 2, 128, id="swa-gqa8-d128"),
    pytest.param("varlen_block_causal", 1500, 16, 2, 128, id="varlen_block_causal-gqa8-d128"),
    pytest.param("random_overlap", 777, 8, 8, 128, id="random_overlap-mha-d128"),
    pytest.param("random_overlap", 901, 16, 2, 128, id="random_overlap-gqa8-d128"),
    pytest.param("sliding_window", 1200, 8, 2, 64, id="swa-gqa4-d64"),
    pytest.param("varlen_causal", 1300, 8, 4, 64, id="varlen_causal-gqa2-d64"),
    pytest.param("random_overlap", 640, 8, 4, 64, id="random_overlap-gqa2-d64"),
]


@pytest.mark.parametrize(("name", "total", "hq", "hk", "d"), CASES)
def test_fa4_matches_reference(name, total, hq, hk, d, monkeypatch) -> None:
    _run(
        name,
        total,
        hq,
        hk,
        d,
        seed=zlib.crc32(f"{name}-{total}-{hk}".encode()) % 1000,
        monkeypatch=monkeypatch,
    )


def test_accumulate_into_out_lse(monkeypatch) -> None:
    # two disjoint halves of a causal mask merged through out/lse equal the whole mask
    monkeypatch.setenv("MAGI_FFA_FA4_POISON", "1")
    torch.manual_seed(3)
    dev, dt, t = torch.device("cuda"), torch.bfloat16, 600
    q = torch.randn(t, 8, 128, device=dev, dtype=dt)
    k = torch.randn(t, 8, 128, device=dev, dtype=dt)
    v = torch.randn(t, 8, 128, device=dev, dtype=dt)
    out = torch.zeros(t, 8, 128, device=dev, dtype=torch.float32)
    lse = torch.full((t, 8), float("-inf"), device=dev)
    magi_ffa_fa4.flex_flash_attn_func(q, k, v, [[0, t]], [[0, 300]], [0], out=out, lse=lse)
    magi_ffa_fa4.flex_flash_attn_func(q, k, v, [[300, t]], [[300, t]], [1], out=out, lse=lse)
    # rows < 300 see keys [0, 300) only; rows >= 300 see [0, 300) + causal part of [300, t)
    mask = dense_mask([[0, t], [300, t]], [[0, 300], [300, t]], [0, 1], t, t)
    o64, l64 = ref_attention(q, k, v, mask)
    olp, llp = ref_attention(q, k, v, mask, dtype=dt)
    assert_close_to_ref("acc/out", out, o64, olp, rtol=RTOL["out"])
    assert_close_to_ref("acc/lse", lse, l64, llp, rtol=RTOL["lse"])


@pytest.mark.parametrize("hk", [8, 2])
def test_stage_launchers_match_one_call(hk: int, monkeypatch) -> None:
    """ffa_fwd merging stage by stage into fp32 out/lse, then ffa_bwd per stage with the FINAL out/lse
    accumulating into fp32 dq/dk/dv, equals attention over the union (the multi-stage runtime's contract)."""
    monkeypatch.setenv("MAGI_FFA_FA4_POISON", "1")
    torch.manual_seed(11 + hk)
    dev, dt, t, hq, d = torch.device("cuda"), torch.bfloat16, 1100, 8, 128
    rng = random.Random(hk)
    qr, kr, tm = random_overlapping_slices(rng, t, t, 10, types=(0,))
    qr += [[0, t]]
    kr += [[700, 1100]]
    tm += [1]
    q = torch.randn(t, hq, d, device=dev, dtype=dt)
    k = torch.randn(t, hk, d, device=dev, dtype=dt)
    v = torch.randn(t, hk, d, device=dev, dtype=dt)
    do = torch.randn(t, hq, d, device=dev, dtype=dt)
    cuts = [0, 300, 700, t]
    stages = split_keys_into_stages(qr, kr, tm, cuts)
    out, lse = magi_ffa_fa4.ffa_fwd(q, k[: cuts[1]], v[: cuts[1]], *stages[0])
    out = out.float()
    for i in range(1, len(stages)):
        ks = slice(cuts[i], cuts[i + 1])
        res = magi_ffa_fa4.ffa_fwd(q, k[ks], v[ks], *stages[i], out=out, lse=lse)
        assert res[0] is out and res[1] is lse
    out_q = out.to(dt)
    dq = torch.zeros(q.shape, device=dev)
    dk, dv = (torch.zeros(x.shape, device=dev) for x in (k, v))
    for i, st in enumerate(stages):
        ks = slice(cuts[i], cuts[i + 1])
        magi_ffa_fa4.ffa_bwd(do, q, k[ks], v[ks], out_q, lse, *st, dq=dq, dk=dk[ks], dv=dv[ks])
    mask = dense_mask(qr, kr, tm, t, t)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    refs = {}
    for key, dtype in (("64", torch.float64), ("lp", dt)):
        o, l = ref_attention(*leaves, mask, dtype=dtype)
        refs[key] = (o, l, *torch.autograd.grad(o, leaves, do.to(dtype)))
    for i, (nm, x) in enumerate((("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))):
        assert_close_to_ref(f"stages/{nm}", x, refs["64"][i], refs["lp"][i], rtol=RTOL[nm])
    # without accumulators: fresh tensors in the input dtype
    g = magi_ffa_fa4.ffa_bwd(do, q, k, v, out_q, lse, qr, kr, tm)
    assert all(x.dtype == dt for x in g)


@pytest.mark.parametrize("hk", [8, 2])
def test_sink_and_max_logits_match_reference(hk: int, monkeypatch) -> None:
    """Sinks (out, lse, dq, dk, dv, dsink) and max logits on FA4 kernels against dense fp64 with the same
    rule as every FFA test: error within twice that of a bf16 torch reference."""
    from magi_ffa.testing import ref_attn, ref_max_logits

    monkeypatch.setenv("MAGI_FFA_FA4_POISON", "1")
    torch.manual_seed(5 + hk)
    dev, dt, t, hq, d = torch.device("cuda"), torch.bfloat16, 900, 8, 128
    qr, kr, tm = _mask_case("random_overlap", t, 4)
    leaves = [torch.randn(t, h, d, device=dev, dtype=dt, requires_grad=True) for h in (hq, hk, hk)]
    sink = (torch.randn(2, hq, device=dev) * 2).requires_grad_()
    do = torch.randn(t, hq, d, device=dev, dtype=dt)
    out, lse, max_logits = magi_ffa_fa4.flex_flash_attn_func(
        *leaves, qr, kr, tm, sink=sink, return_max_logits=True
    )
    grads = torch.autograd.grad(out, [*leaves, sink], do)
    mask = dense_mask(qr, kr, tm, t, t).to(dev)
    refs = {}
    for key, dtype in (("64", torch.float64), ("lp", dt)):
        xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
        s = sink.detach().double().requires_grad_() if key == "64" else sink.detach().requires_grad_()
        o, l = ref_attn(*xs, mask, sink=s)
        refs[key] = (o, l, *torch.autograd.grad(o, [*xs, s], do.to(dtype)))
    names = ("out", "lse", "dq", "dk", "dv")
    for i, (nm, x) in enumerate(zip(names, (out, lse, *grads[:3]))):
        assert_close_to_ref(f"sink/{nm}", x, refs["64"][i], refs["lp"][i], rtol=RTOL[nm])
    torch.testing.assert_close(grads[3].double(), refs["64"][5].double(), rtol=2e-2, atol=2e-2)
    want = ref_max_logits(*(x.detach().double() for x in leaves[:2]), mask)
    torch.testing.assert_close(max_logits.double(), want, rtol=1e-2, atol=2e-2)
