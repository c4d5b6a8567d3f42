"""Shared pieces of the magi_ffa tests: the correctness check of one call against dense references."""

from __future__ import annotations

import torch

from magi_ffa import testing as T


def dense_refs(q, k, v, qr, kr, tm, *, softcap=0.0, do=None, dlse=None, scale=None):
    """fp64 truth and same-dtype naive reference of (out, lse[, dq, dk, dv])."""
    mask = T.make_attn_mask(qr, kr, tm, q.shape[0], k.shape[0])
    res = []
    for dt in (torch.float64, q.dtype):
        xs = [t.detach().to(dt).requires_grad_(do is not None) for t in (q, k, v)]
        o, l = T.ref_attn(*xs, mask, softmax_scale=scale, softcap=softcap)
        r = {"out": o.detach(), "lse": l.detach()}
        if do is not None:
            loss = (o * do.to(dt)).sum()
            if dlse is not None:
                loss = loss + (torch.where(torch.isneginf(l), 0, l) * dlse.to(dt)).sum()
            r["dq"], r["dk"], r["dv"] = torch.autograd.grad(loss, xs)
        res.append(r)
    return res[0], res[1]


def check_all(got: dict, ref64: dict, ref_lp: dict, dtype: torch.dtype) -> None:
    for name, x in got.items():
        T.assert_close_to_ref(name, x, ref64[name], ref_lp[name], dtype)


def poison(*ts):
    for t in ts:
        t.fill_(float("nan"))


def force_tiles(monkeypatch, tiles: str, *, split: bool = False) -> None:
    """``"BM,BN"`` tiles for every Triton kernel (forward ``BM x BN``, backward K/V programs ``BN x BM`` and q
    programs ``BM x BN``), 4 warps, 1 stage: small tiles make every slice have both boundary and full tiles.
    ``split``: the backward as two launches (K/V programs, then q programs)."""
    bm, bn = tiles.split(",")[:2]
    monkeypatch.setenv("MAGI_FFA_TILES_FWD", f"{bm},{bn},4,1")
    monkeypatch.setenv("MAGI_FFA_TILES_BWD", f"{bn},{bm},{bm},{bn},4,1,1,{int(split)}")
