"""Launch metadata built on the host and moved to the device in one copy equals the metadata built directly.

``_launch_meta.metadata_device`` sends small masks meant for a CUDA device to the host builder, whose finished
tensors travel in one staged copy (``_launch_meta._staged_to``). Here the host path is forced
(``build_mask_meta(..., on_host=True)``) and compared field by field, tensor by tensor, with the direct build;
a dispatch mode checks that the host path runs every metadata op on CPU tensors and touches the target device
only with one copy and views of it (the ``meta`` device stands in for CUDA on a machine without one).
"""

from __future__ import annotations

import itertools
import random
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from magi_ffa.testing import random_overlapping_slices
from magi_ffa_fa4 import _launch_meta as L
from magi_ffa_fa4.testing import assert_same_meta, slice_tensors

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


# ----------------------------------------------------------------------------------------------- the choice
def test_metadata_device_choice() -> None:
    limit = L.HOST_BUILD_MAX_PAIRS
    assert L.metadata_device(2048, 16384, CUDA) == CPU
    assert L.metadata_device(1, 1, CUDA) == CPU
    assert L.metadata_device(0, 0, torch.device("cuda:1")) == CPU
    assert L.metadata_device(limit, 1, CUDA) == CPU  # the limit itself is small
    assert L.metadata_device(limit + 1, 1, CUDA) == CUDA
    assert L.metadata_device(1 << 20, 1 << 20, torch.device("cuda:1")) == torch.device("cuda:1")
    assert L.metadata_device(1 << 20, 1 << 20, CPU) == CPU
    assert L.metadata_device(16, 16, CPU) == CPU
    assert L.metadata_device(16, 16, torch.device("meta")) == torch.device("meta")


# ------------------------------------------------------------------------------------------------- masks
def _docs(rng: random.Random, total: int, n: int) -> list[list[int]]:
    cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(n - 1))})
    return [list(d) for d in itertools.pairwise(cuts)]


def _windowed_docs(rng: random.Random, total: int):
    from magi_mask import decompose_region, tighten_region

    rows = []
    for s, e in _docs(rng, total, rng.randint(1, 5)):
        left, right = rng.randrange(0, total), rng.choice([0, rng.randrange(0, total)])
        rows += decompose_region(tighten_region(s, e, s, e, -left, right))
    return [[a, b] for a, b, *_ in rows], [[c, d] for _, _, c, d, _ in rows], [t for *_, t in rows]


def _masks():
    """About twenty masks ``(name, q_ranges, k_ranges, types, total_q, total_k)``."""
    out = []
    for seed, (tq, tk) in enumerate([(1, 1), (37, 300), (300, 37), (1000, 700), (2048, 4096), (3001, 129)]):
        rng = random.Random(seed)
        qr, kr, tm = random_overlapping_slices(rng, tq, tk, rng.randint(1, 30))
        out.append((f"random-{tq}x{tk}", qr, kr, tm, tq, tk))
    for seed, total in enumerate([129, 1000, 4099]):
        rng = random.Random(10 + seed)
        docs = _docs(rng, total, rng.randint(2, 9))
        out.append((f"docs-causal-{total}", docs, docs, [1] * len(docs), total, total))
        out.append((f"docs-full-{total}", docs, docs, [0] * len(docs), total, total))
        qr, kr, tm = _windowed_docs(rng, total)
        out.append((f"window-docs-{total}", qr, kr, tm, total, total))
    for total, w in [(1000, 64), (3333, 700)]:  # a sliding window: its causal head and its band
        out.append((f"window-{total}", [[0, w], [w, total]], [[0, w], [1, total]], [1, 3], total, total))
    # rows that see nothing: slices cover parts of q only, a causal slice wider in q than in k
    out.append(
        ("gaps", [[10, 50], [200, 300], [300, 390]], [[0, 64], [5, 900], [0, 10]], [0, 2, 1], 400, 900)
    )
    n = 7  # row bands over narrow key bands: several intervals per row
    stripes = [[s * 2000 // n, s * 2000 // n + 40 + 13 * s] for s in range(n)]
    out.append(("stripes", [[100 * s, 2000 - 50 * s] for s in range(n)], stripes, [0] * 6 + [3], 2000, 2000))
    out.append(("no-slices", [], [], [], 300, 200))
    return out


MASKS = _masks()


def _tensor_leaves(obj) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    L._map_tensors(obj, out.append, {})
    return out


# ------------------------------------------------------------------------------------- host path = direct
@pytest.mark.parametrize("sm100", [False, True], ids=["sm90-tiles", "sm100-tiles"])
@pytest.mark.parametrize("varlen_env", ["1", "0"])
@pytest.mark.parametrize("case", MASKS, ids=[c[0] for c in MASKS])
def test_host_build_matches_direct_build(case, varlen_env: str, sm100: bool, monkeypatch) -> None:
    _, qr, kr, tm, tq, tk = case
    monkeypatch.setenv("MAGI_FFA_FA4_VARLEN", varlen_env)
    if sm100:  # a forward block other than the backward's: two block-list sets
        monkeypatch.setattr(L, "tile_sizes", lambda device: ((256, 128), (128, 128)))
    args = (*slice_tensors(qr, kr, tm), tq, tk, CPU)
    direct = L.build_mask_meta(*args, on_host=False)
    host = L.build_mask_meta(*args, on_host=True)
    assert_same_meta(host, direct, layout=True)
    assert_same_meta(
        L.build_mask_meta(*args), direct, layout=True
    )  # the default for a CPU target: the direct build
    leaves = _tensor_leaves(host)
    # one copy: every tensor is a view of one buffer
    assert len({t.untyped_storage().data_ptr() for t in leaves}) <= 1
    # sharing survives the move
    assert (host.meta_bwd is host.meta_fwd) == (direct.meta_bwd is direct.meta_fwd)
    if direct.varlen is not None:
        for g_host, g_direct in zip(host.varlen.groups, direct.varlen.groups):
            assert (g_host.seqused_q is g_host.lengths_q) == (g_direct.seqused_q is g_direct.lengths_q)
            assert (g_host.seqused_k is g_host.lengths_k) == (g_direct.seqused_k is g_direct.lengths_k)
    else:
        # FA4's index tables, built before the copy and moved with the metadata
        tables = (L._bst_tables(direct.meta_fwd.q2k), L._bst_tables(direct.meta_bwd.k2q))
        assert_same_meta(L._staged_to(tables, CPU), tables, layout=True, path="tables")


# --------------------------------------------------------------------------------- no device-side op on host
_VIEWS = {
    "aten::slice",
    "aten::view",
    "aten::detach",
    "aten::alias",
    "aten::_reshape_alias",
    "aten::as_strided",
}


class _OpLog(TorchDispatchMode):
    """Every aten op run, with the devices of its tensor arguments and results."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves, _ = tree_flatten((args, kwargs, out))
        devices = {str(x.device) for x in leaves if isinstance(x, torch.Tensor)}
        self.ops.append((func._schema.name, devices))
        return out


@pytest.mark.parametrize("varlen_env", ["1", "0"])
@pytest.mark.parametrize("name", ["random-2048x4096", "docs-causal-4099", "gaps", "stripes", "window-3333"])
def test_host_build_touches_the_target_once(name: str, varlen_env: str, monkeypatch) -> None:
    """With the host path forced toward another device (``meta``, standing in for CUDA), every metadata op
    runs on CPU tensors; the target sees one copy and views of it. Building any part of the metadata on the
    target (a ``nonzero``, ``bincount``, ``repeat_interleave``, ``.item()`` there) fails this test."""
    monkeypatch.setenv("MAGI_FFA_FA4_VARLEN", varlen_env)
    _, qr, kr, tm, tq, tk = next(c for c in MASKS if c[0] == name)
    target = torch.device("meta")
    log = _OpLog()
    with log:
        meta = L.build_mask_meta(*slice_tensors(qr, kr, tm), tq, tk, target, on_host=True)
    assert all(t.device == target for t in _tensor_leaves(meta))
    on_target = [op for op, devices in log.ops if "meta" in devices]
    copies = [op for op in on_target if op not in _VIEWS]
    assert copies == ["aten::_to_copy"], copies
    assert all(devices <= {"cpu", "meta"} for _, devices in log.ops)
    # the builders ran, on the host (the log holds their ops, not only the copy)
    assert len([op for op, devices in log.ops if devices == {"cpu"}]) > 20


def _fake_fa4(monkeypatch) -> None:
    """Stand-ins for the FA4 / CuTe modules :func:`L.build_launch_meta` imports (not installed here)."""
    fa4_mask = types.ModuleType("magi_ffa_fa4._fa4_mask")
    fa4_mask.install_r2p_patch = lambda: None
    fa4_mask.interval_mask_mod = lambda width: ("mask_mod", width)
    fa4_mask.interval_mask_mod_r2p = lambda width: ("mask_mod_r2p", width)
    sparsity = types.ModuleType("flash_attn.cute.block_sparsity")
    sparsity.BlockSparseTensorsTorch = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "magi_ffa_fa4._fa4_mask", fa4_mask)
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.block_sparsity", sparsity)


@pytest.mark.parametrize("name", ["random-2048x4096", "gaps", "stripes"])
def test_launch_meta_touches_the_target_once(name: str, monkeypatch) -> None:
    """:func:`L.build_launch_meta` for a target the choice sends to the host: FA4's index tables too are
    built on the host and travel in the one copy, and they equal the tables of the direct build."""
    _fake_fa4(monkeypatch)
    monkeypatch.setenv("MAGI_FFA_FA4_VARLEN", "0")
    monkeypatch.setattr(L, "metadata_device", lambda total_q, total_k, device: CPU)
    _, qr, kr, tm, tq, tk = next(c for c in MASKS if c[0] == name)
    log = _OpLog()
    with log:
        meta = L.build_launch_meta(*slice_tensors(qr, kr, tm), tq, tk, torch.device("meta"))
    on_target = [op for op, devices in log.ops if "meta" in devices]
    assert [op for op in on_target if op not in _VIEWS] == ["aten::_to_copy"]
    assert all(devices <= {"cpu", "meta"} for _, devices in log.ops)
    direct = L.build_launch_meta(*slice_tensors(qr, kr, tm), tq, tk, CPU)
    for got, want in ((meta.fwd_bst, direct.fwd_bst), (meta.bwd_bst, direct.bwd_bst)):
        assert got.block_size == want.block_size
        for key in ("mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx"):
            a, b = getattr(got, key), getattr(want, key)
            assert a.device.type == "meta" and (a.dtype, a.shape, a.stride()) == (
                b.dtype,
                b.shape,
                b.stride(),
            )
    assert meta.mask_mod == direct.mask_mod and meta.width == direct.width


# ------------------------------------------------------------------------------------------- on a CUDA GPU
@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("varlen_env", ["1", "0"])
def test_host_build_on_cuda_matches_device_build_without_sync(varlen_env: str, monkeypatch) -> None:
    """On CUDA: the host build (torch intervals) equals the device build (Triton intervals), and with host
    tables it synchronizes with the device nowhere (the copy is from pinned memory)."""
    monkeypatch.setenv("MAGI_FFA_FA4_VARLEN", varlen_env)
    for _, qr, kr, tm, tq, tk in MASKS:
        args = (*slice_tensors(qr, kr, tm), tq, tk, CUDA)
        direct = L.build_mask_meta(*args, on_host=False)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            host = L.build_mask_meta(*args, on_host=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_same_meta(host, direct, layout=True)
