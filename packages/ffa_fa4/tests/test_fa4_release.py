"""The flash-attn-4 release this package runs on, and the private FA4 calls it makes, hold for every supported one.

CPU: the kernel API runs against a recording fake FA4 on both launch paths (block-sparse and varlen); the
keywords it passes must be parameters that ``_flash_attn_fwd`` / ``_flash_attn_bwd`` have, with the same
meaning, in 4.0.0b36 and in 4.0.0b40 (read from their ``flash_attn/cute/interface.py``). GPU (flash-attn-4
installed): the same keywords against the installed functions' signatures, and the release read from the
installed distribution is the one Python imports.
"""

from __future__ import annotations

import inspect
import json
import os
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import magi_ffa_fa4
from magi_ffa_fa4 import _fa4_version, interface
from magi_ffa_fa4 import _launch_meta as L

# Parameters of both releases with the same meaning. Left out on purpose: 4.0.0b36's num_threads and
# q/k/v_descale (gone in 4.0.0b40), 4.0.0b40's scales and config (new), and the backward's tile, stage and
# MMA-layout arguments (m_block_size ... AtomLayoutMdQ, num_threads, pack_gqa), which 4.0.0b40 ignores.
FWD_SHARED = frozenset(
    "q k v qv cu_seqlens_q cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k min_seqlen_k page_table "
    "softmax_scale causal softcap window_size_left window_size_right learnable_sink tile_mn mma_pv_is_rs "
    "intra_wg_overlap num_splits pack_gqa _arch score_mod mask_mod block_sparse_tensors return_lse out lse "
    "aux_tensors aux_scalars gather_kv_indices scheduler_metadata seqlen_k_per_split disable_scheduler_metadata "
    "gather_bwd_recompute_p".split()
)
BWD_SHARED = frozenset(
    "q k v out dout lse softmax_scale causal softcap window_size_left window_size_right V_in_regs cu_seqlens_q "
    "cu_seqlens_k seqused_q seqused_k max_seqlen_q max_seqlen_k deterministic dq dk dv score_mod score_mod_bwd "
    "mask_mod aux_tensors aux_scalars block_sparse_tensors dlse learnable_sink".split()
)
POSITIONAL = {"fwd": ("q", "k", "v"), "bwd": ("q", "k", "v", "out", "dout", "lse")}
"""The leading parameters, in this order in both releases (the launchers pass these positionally)."""


def _masks(total: int = 1024) -> list[tuple[list, list, list]]:
    docs = [[0, total // 2], [total // 2, total]]
    p = total // 8  # documents that also see a shared prefix: two groups over the same query rows
    pdocs = [[p, (p + total) // 2], [(p + total) // 2, total]]
    return [
        ([[0, 40], [20, 48]], [[0, 56], [8, 30]], [0, 1]),  # tiny overlapping slices: block-sparse
        (docs, docs, [1, 1]),  # packed causal documents: one varlen group
        (pdocs * 2, pdocs + [[0, p]] * 2, [1, 1, 0, 0]),
    ]


def _record_calls(monkeypatch, device: torch.device) -> list[tuple[str, int, frozenset]]:
    """Run every mask of :func:`_masks` forward and backward through the kernel API on ``device`` with FA4
    replaced by a fake that records (direction, positional count, keyword names) and returns zeros of FA4's
    layouts."""
    calls: list[tuple[str, int, frozenset]] = []

    def fwd(*args, **kw):
        calls.append(("fwd", len(args), frozenset(kw)))
        q = args[0]
        out = torch.zeros_like(q) if kw.get("out") is None else kw["out"]
        lse = kw.get("lse")
        if lse is None:
            lse = torch.zeros(*q.shape[:-3], q.shape[-2], q.shape[-3], device=q.device)
        return out, lse, None, None, None

    def bwd(*args, **kw):
        calls.append(("bwd", len(args), frozenset(kw)))
        return tuple(
            torch.zeros_like(t) if kw.get(n) is None else kw[n] for t, n in zip(args[:3], "dq dk dv".split())
        )

    def build(qr, kr, tm, total_q, total_k, device):  # the metadata without FA4's objects (no cutlass here)
        meta = L.build_mask_meta(qr, kr, tm, total_q, total_k, device)
        return meta if meta.varlen is not None else L.dataclasses.replace(meta, mask_mod=object())

    monkeypatch.setattr(interface, "_fa4", lambda: SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd))
    monkeypatch.setattr(L, "build_launch_meta", build)
    monkeypatch.setattr(
        interface.BACKEND, "capability", interface.relaxed_capability(architectures="any", device="any")
    )
    magi_ffa_fa4.clear_launch_cache()
    try:
        for qr, kr, tm in _masks():
            total = max(max(e for _, e in qr), max(e for _, e in kr))
            q, k, v = (
                torch.randn(total, h, 16, dtype=torch.float16, device=device, requires_grad=True)
                for h in (2, 1, 1)
            )
            tensors = [torch.tensor(x, dtype=torch.int32, device=device) for x in (qr, kr, tm)]
            out, _ = magi_ffa_fa4.flex_flash_attn_func(q, k, v, *tensors)
            out.float().sum().backward()
    finally:
        magi_ffa_fa4.clear_launch_cache()
    return calls


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_launchers_pass_only_keywords_both_releases_share(monkeypatch) -> None:
    calls = _record_calls(monkeypatch, torch.device("cpu"))
    shared = {"fwd": FWD_SHARED, "bwd": BWD_SHARED}
    for direction, n_args, keywords in calls:
        assert n_args <= len(POSITIONAL[direction]), (direction, n_args)
        assert keywords <= shared[direction] - set(POSITIONAL[direction][:n_args]), (
            keywords - shared[direction]
        )
    # both launch paths and both directions ran
    seen = {(d, "block_sparse_tensors" in kw, "cu_seqlens_q" in kw) for d, _, kw in calls}
    assert seen == {("fwd", True, False), ("fwd", False, True), ("bwd", True, False), ("bwd", False, True)}, (
        seen
    )


@pytest.mark.gpu
@pytest.mark.skipif(not magi_ffa_fa4.fa4_available(), reason="needs flash-attn-4")
@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (the CPU run)"
)
def test_installed_release_takes_the_keywords(monkeypatch) -> None:
    """Needs TRITON_INTERPRET=1 for the recording run on CPU tensors: run as
    ``TRITON_INTERPRET=1 python -m pytest -m gpu packages/ffa_fa4/tests/test_fa4_release.py``."""
    fa = interface._fa4()
    calls = _record_calls(monkeypatch)
    for direction, n_args, keywords in calls:
        params = list(inspect.signature(getattr(fa, f"_flash_attn_{direction}")).parameters)
        assert tuple(params[:n_args]) == POSITIONAL[direction][:n_args]
        assert keywords <= set(params), keywords - set(params)


@pytest.mark.gpu
@pytest.mark.skipif(not magi_ffa_fa4.fa4_available(), reason="needs flash-attn-4")
def test_installed_release_is_supported_and_imported() -> None:
    version = _fa4_version.installed()
    assert version in _fa4_version.SUPPORTED, version
    import flash_attn.cute

    dist = metadata.distribution(_fa4_version.DISTRIBUTION)
    init = Path(dist.locate_file("flash_attn/cute/__init__.py")).resolve()
    assert init == Path(flash_attn.cute.__file__).resolve(), (version, flash_attn.cute.__file__)


def test_release_comparison_table(tmp_path: Path) -> None:
    """``benchmarks.fa4_versions``: medians over each release's rounds, b40/b36 as a speed ratio."""
    from benchmarks import fa4_versions

    def run(tag: str, fwd: float, bwd: float) -> None:
        rows = [dict(kernel="ffa_fa4", mask="causal", S=8192, hq=64, hk=8, d=128, fwd_ms=fwd, bwd_ms=bwd)]
        rows.append(dict(kernel="fa4", mask="causal", S=8192, hq=64, hk=8, d=128, error="refused"))
        (tmp_path / f"{tag}.json").write_text(json.dumps(dict(env=dict(versions=tag), rows=rows)))

    for i, (fwd, bwd) in enumerate([(1.0, 2.0), (1.2, 2.2), (9.0, 9.0)]):
        run(f"b36_r{i}", fwd, bwd)
    for i, (fwd, bwd) in enumerate([(0.8, 2.4), (1.0, 2.5), (1.1, 0.1)]):
        run(f"b40_r{i}", fwd, bwd)
    (tmp_path / "b40_r1x.json").write_text("not a run")  # only <release>_r<round>.json files are read
    table = fa4_versions.compare(tmp_path)
    (row,) = table["rows"]
    assert row["rounds"] == [3, 3] and row["fwd_ms"] == [1.2, 1.0] and row["bwd_ms"] == [2.2, 2.4]
    assert row["fwd_ratio"] == 1.2 and row["bwd_ratio"] == round(2.2 / 2.4, 3)
    assert "| ffa_fa4 | causal | 8192 | 64:8 | 128 | 3 / 3 | 1.200 | 1.000 | 1.200 |" in fa4_versions.render(
        table
    )
    with pytest.raises(SystemExit, match="b41"):
        fa4_versions.compare(tmp_path, new="b41")
