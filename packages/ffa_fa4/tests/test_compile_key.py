"""Compiled-kernel keys of the FA4 backend do not follow a mask's values or counts, and the padding that
bounds them leaves every mask exactly as it was.

``magi_ffa_fa4._launch_meta.compile_key`` mirrors what FA4 (4.0.0b36 and 4.0.0b40) keys its compiled kernels by; a
stream of new masks (random overlapping slices of all four types, packed documents, sliding windows, token counts that
differ within one size) must map to a few keys. The padded metadata is checked against the dense mask: the
interval bounds evaluated in torch (the interval mask function's rule) and the varlen groups' launch
arguments evaluated with FA4's varlen semantics. On a GPU with flash-attn-4, the mirror is checked against the
keys FA4 itself builds for a stream of masks (its compile caches, read as the calls look them up).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from magi_ffa.intervals import row_intervals
from magi_ffa_fa4 import _fa4_version
from magi_ffa_fa4 import _launch_meta as L
from magi_ffa_fa4.testing import dense_mask, random_overlapping_slices
from magi_ffa_fa4.varlen import SEQLEN_FLOOR

CPU = torch.device("cpu")


def _docs(total: int, rng: random.Random, n: int) -> list[tuple[int, int]]:
    cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(n - 1))})
    return list(itertools.pairwise(cuts))


def mask_stream(n: int, seed: int = 0):
    """``n`` different masks ``(q_ranges, k_ranges, types, total)``, totals in ``[1600, 2048]``: random
    overlapping slices of all four types, narrow key stripes (5 to 7 intervals per row), packed causal /
    full documents (long and short ones), sliding windows (a causal head and a band, as ``magi_attention.helpers`` builds them) and document-causal masks
    with a shared prefix."""
    rng = random.Random(seed)
    kinds = ["random", "docs_causal", "stripes", "docs_full", "window", "short_docs", "random", "prefix_docs"]
    out = []
    for i in range(n):
        kind, total = kinds[i % len(kinds)], rng.randint(1600, 2048)
        if kind == "random":
            qr, kr, tm = random_overlapping_slices(rng, total, total, rng.randint(3, 40))
        elif kind in ("docs_causal", "docs_full", "short_docs"):
            docs = _docs(total, rng, rng.randint(2, 6) if kind != "short_docs" else rng.randint(20, 40))
            qr = kr = [list(d) for d in docs]
            tm = [0 if kind == "docs_full" else 1] * len(docs)
        elif kind == "stripes":  # narrow key bands seen by overlapping row bands: 5 to 7 intervals per row
            n = rng.randint(5, 7)
            qr = [[rng.randint(0, 64), total - rng.randint(0, 64)] for _ in range(n)]
            kr = [[s * total // n, s * total // n + rng.randint(16, 96)] for s in range(n)]
            tm = [rng.choice([0, 1, 2, 3]) for _ in range(n)]
        elif kind == "window":
            w = rng.randint(64, total // 2)
            qr, kr, tm = [[0, w], [w, total]], [[0, w], [1, total]], [1, 3]
        else:  # documents that also see a shared prefix: two slices per row band
            p = rng.randint(64, 512)
            docs = _docs(total - p, rng, rng.randint(2, 5))
            qr = [[p + a, p + b] for a, b in docs] * 2
            kr = [[p + a, p + b] for a, b in docs] + [[0, p]] * len(docs)
            tm = [1] * len(docs) + [0] * len(docs)
        out.append((qr, kr, tm, total))
    return out


def _tensors(qr, kr, tm):
    return tuple(torch.tensor(x, dtype=torch.int32) for x in (qr, kr, tm))


CONFIG = dict(dtype=torch.bfloat16, head_dim=128, num_heads_q=8, num_heads_kv=2)


def test_width_bucket_is_a_power_of_two_at_least_the_width() -> None:
    assert [L.width_bucket(w) for w in range(0, 10)] == [1, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert L.width_bucket(1000) == 1024
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="width"):
            L.width_bucket(bad)


@pytest.mark.parametrize("fa4_version", _fa4_version.SUPPORTED)
def test_twenty_new_masks_need_few_compiled_kernels(fa4_version: str) -> None:
    stream = mask_stream(20)
    config = {**CONFIG, "fa4_version": fa4_version}
    keys, raw_widths, paths = set(), set(), set()
    for qr, kr, tm, total in stream:
        meta = L.build_mask_meta(*_tensors(qr, kr, tm), total, total, CPU)
        per_mask = L.compile_key(meta, **config)
        assert hash(per_mask) == hash(L.compile_key(meta, **config))  # hashable and a pure function
        keys.update(per_mask)
        paths.add(meta.varlen is not None)
        if meta.varlen is None:
            raw_widths.add(row_intervals(*_tensors(qr, kr, tm), total, total).width)
    assert paths == {True, False}, "the stream must exercise both launch paths"
    # the stream's masks have several interval counts; their buckets and the varlen window kinds (full,
    # causal, windowed) bound the kernels: forward + backward per distinct (path, bucket / window kind)
    assert len(raw_widths) >= 5
    buckets = {L.width_bucket(w) for w in raw_widths}
    assert len(buckets) < len(raw_widths)
    assert len(keys) <= 2 * (len(buckets) + 3), sorted(map(str, keys))
    assert len(keys) <= 14
    # what the key holds is the configuration: a new dtype / head dim / GQA ratio / determinism is a new key
    qr, kr, tm, total = stream[0]
    meta = L.build_mask_meta(*_tensors(qr, kr, tm), total, total, CPU)
    base = L.compile_key(meta, **config)
    for change in (
        dict(dtype=torch.float16),
        dict(head_dim=64),
        dict(num_heads_kv=8),
        dict(deterministic=True),
        dict(softcap=30.0),
        dict(arch=100),
    ):
        assert L.compile_key(meta, **{**config, **change}) != base, change


def test_token_counts_within_a_size_share_keys() -> None:
    """The same kind of mask at every token count of one size (no sequence of one tile) has one key."""
    rng = random.Random(3)
    varlen, sparse = set(), set()
    for total in rng.sample(range(1200, 2048), 8):
        docs = [list(d) for d in _docs(total, rng, 4)]
        meta = L.build_mask_meta(*_tensors(docs, docs, [1] * len(docs)), total, total, CPU)
        assert meta.varlen is not None
        varlen.add(L.compile_key(meta, **CONFIG))
        # one interval per row, tiny documents: the block-sparse path at width 1
        small = [[a, min(a + 40, total)] for a in range(0, total, 40)]
        meta = L.build_mask_meta(*_tensors(small, small, [1] * len(small)), total, total, CPU)
        assert meta.varlen is None and meta.width == 1
        sparse.add(L.compile_key(meta, **CONFIG))
    assert len(varlen) == 1 and len(sparse) == 1


def _visible_from_bounds(bounds: torch.Tensor, total_q: int, total_k: int) -> torch.Tensor:
    """The interval mask function's rule on the CPU: row q sees key j iff some slot has b[2i] <= j < b[2i+1]."""
    b = bounds.long()
    j = torch.arange(total_k)[None, None, :]
    lo, hi = b[:total_q, 0::2, None], b[:total_q, 1::2, None]
    return ((lo <= j) & (j < hi)).any(dim=1)


def _visible_from_varlen(meta, total_q: int, total_k: int) -> torch.Tensor:
    """FA4's varlen semantics on the arguments the launches pass: entry b starts at ``cu_seqlens[b]`` and is
    ``seqused[b]`` long; its window aligns to the entry's bottom-right corner."""
    got = torch.zeros(total_q, total_k, dtype=torch.bool)
    for g in meta.varlen.groups:
        kw = g.fa4_kwargs()
        cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
        lq, lk = kw["seqused_q"].tolist(), kw["seqused_k"].tolist()
        assert kw["max_seqlen_q"] >= max(SEQLEN_FLOOR, *lq) and kw["max_seqlen_k"] >= max(SEQLEN_FLOOR, *lk)
        left = None if kw["causal"] else kw["window_size_left"]
        right = 0 if kw["causal"] else kw["window_size_right"]
        for q0, n_q, k0, n_k in zip(cu_q, lq, cu_k, lk):
            i = torch.arange(n_q)[:, None]
            j = torch.arange(n_k)[None, :]
            ok = torch.ones(n_q, n_k, dtype=torch.bool)
            if right is not None:
                ok &= j <= i + n_k - n_q + right
            if left is not None:
                ok &= j >= i + n_k - n_q - left
            got[q0 : q0 + n_q, k0 : k0 + n_k] |= ok
    return got


def test_padded_metadata_is_the_same_mask() -> None:
    seen_padding = False
    for qr, kr, tm, total in mask_stream(20, seed=1):
        want = dense_mask(qr, kr, tm, total, total)
        meta = L.build_mask_meta(*_tensors(qr, kr, tm), total, total, CPU)
        if meta.varlen is not None:
            assert torch.equal(_visible_from_varlen(meta, total, total), want)
            continue
        raw = row_intervals(*_tensors(qr, kr, tm), total, total).width
        assert meta.width == L.width_bucket(raw) and meta.bounds.shape[1] == 2 * meta.width
        seen_padding |= meta.width > raw
        assert meta.bounds.shape[0] % L.ROW_PAD == 0 and meta.bounds.shape[0] > total
        assert not meta.bounds[total:].any(), "padded rows must match no key"
        assert torch.equal(_visible_from_bounds(meta.bounds, total, total), want)
        assert int(meta.bounds.max()) <= total
    assert seen_padding, "the stream must include a width that the bucket pads"


def test_interval_bounds_pad_with_empty_slots() -> None:
    qr, kr, tm = [[0, 6], [0, 6], [0, 6]], [[0, 2], [4, 6], [8, 10]], [0, 0, 0]
    iv = row_intervals(*_tensors(qr, kr, tm), 6, 12)
    assert iv.width == 3
    b = L.interval_bounds(iv, CPU)
    assert b.shape == (L.ROW_PAD, 8)
    assert b[0].tolist() == [0, 2, 4, 6, 8, 10, 0, 0]
    assert torch.equal(_visible_from_bounds(b, 6, 12), dense_mask(qr, kr, tm, 6, 12))


@pytest.mark.parametrize("fa4_version", _fa4_version.SUPPORTED)
def test_warmup_masks_compile_what_the_stream_needs(fa4_version: str) -> None:
    """After the warm-up masks (one size), no mask of the stream (other sizes) needs a key they did not have."""
    config = {**CONFIG, "fa4_version": fa4_version}
    warm = set()
    for qr, kr, tm in L.warmup_masks(2048):
        assert dense_mask(qr, kr, tm, 2048, 2048).any()
        warm.update(L.compile_key(L.build_mask_meta(*_tensors(qr, kr, tm), 2048, 2048, CPU), **config))
    for qr, kr, tm, total in mask_stream(20, seed=2):
        meta = L.build_mask_meta(*_tensors(qr, kr, tm), total, total, CPU)
        assert set(L.compile_key(meta, **config)) <= warm, (qr, kr, tm, total)
    with pytest.raises(ValueError, match="total"):
        L.warmup_masks(1000, widths=(1, 64))


def _partition(keys_per_mask: list) -> list[int]:
    """Each mask's position among the distinct values of ``keys_per_mask`` (first-seen order): two masks share
    compiled kernels iff they get the same number."""
    seen: dict = {}
    return [seen.setdefault(k, len(seen)) for k in keys_per_mask]


def test_releases_key_hopper_masks_alike() -> None:
    """On Hopper, 4.0.0b40's config-built keys split a mask stream exactly as 4.0.0b36's do (what a mask changes
    is the same there), while the keys themselves name the release."""
    metas = [L.build_mask_meta(*_tensors(qr, kr, tm), t, t, CPU) for qr, kr, tm, t in mask_stream(16, seed=5)]
    keys = {v: [L.compile_key(m, **CONFIG, fa4_version=v) for m in metas] for v in _fa4_version.SUPPORTED}
    old, new = (keys[v] for v in _fa4_version.SUPPORTED)
    assert _partition(old) == _partition(new) and len(set(old)) > 3
    assert not set(old) & set(new)


def test_blackwell_gqa_backward_of_4_0_0b40_keys_entry_lengths() -> None:
    """4.0.0b40 on Blackwell folds a GQA backward's query heads by the sequence lengths: the mirror keys them
    (the forward keeps one key); on Hopper, without GQA, and for 4.0.0b36, the lengths are not keyed."""
    total = 4096

    def keys(doc: int, **kw) -> tuple:
        docs = [[a, a + doc] for a in range(0, total, doc)]
        meta = L.build_mask_meta(*_tensors(docs, docs, [1] * len(docs)), total, total, CPU)
        assert meta.varlen is not None
        return L.compile_key(meta, **{**CONFIG, **kw})

    b40, b36 = "4.0.0b40", "4.0.0b36"
    short, long = keys(512, arch=100, fa4_version=b40), keys(1024, arch=100, fa4_version=b40)
    assert short != long and [x for x in short if x[0] == "fwd"] == [x for x in long if x[0] == "fwd"]
    for kw in (
        dict(arch=90, fa4_version=b40),
        dict(arch=100, fa4_version=b40, num_heads_kv=8),
        dict(arch=100, fa4_version=b36),
        dict(arch=90, fa4_version=b36),
    ):
        assert keys(512, **kw) == keys(1024, **kw), kw


def test_release_is_checked() -> None:
    assert _fa4_version.resolve("4.0.0b40") == "4.0.0b40"
    assert _fa4_version.resolve() == (_fa4_version.installed() or _fa4_version.PINNED)
    meta = L.build_mask_meta(*_tensors([[0, 600]], [[0, 600]], [1]), 600, 600, CPU)
    for bad in ("4.0.0b35", "4.0.0", 40):
        with pytest.raises(ValueError, match="fa4_version"):
            L.compile_key(meta, **CONFIG, fa4_version=bad)
    assert not _fa4_version.mask_patch_supported(None) and not _fa4_version.mask_patch_supported("4.0.0b41")


class _RecordingCache:
    """A compile cache that records the keys FA4 looks up (``key in cache`` in 4.0.0b36's forward and
    backward and 4.0.0b40's forward, ``cache.get(key)`` in 4.0.0b40's backward) and otherwise is the cache."""

    def __init__(self, inner) -> None:
        self.inner, self.keys = inner, []

    def __contains__(self, key) -> bool:
        self.keys.append(key)
        return key in self.inner

    def get(self, key):
        self.keys.append(key)
        return self.inner.get(key)

    def __getitem__(self, key):
        return self.inner[key]

    def __setitem__(self, key, fn) -> None:
        self.inner[key] = fn

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.filterwarnings("ignore:Argument aux_data")  # FA4's varlen forward (see test_fa4_gpu.py)
def test_mirror_splits_masks_as_the_installed_fa4_does(monkeypatch) -> None:
    """A stream of masks (every kind of :func:`mask_stream`) through the kernel API: two masks get the same
    mirrored forward (backward) keys exactly when FA4 looked up the same keys of its forward (backward) main
    kernel, one for one (the preprocess / postprocess kernels of the backward are not mirrored)."""
    import magi_ffa_fa4

    if not magi_ffa_fa4.fa4_available():
        pytest.skip("needs flash-attn-4")
    fa = magi_ffa_fa4.interface._fa4()
    caches = {d: _RecordingCache(getattr(fa, f"_flash_attn_{d}").compile_cache) for d in ("fwd", "bwd")}
    for d, cache in caches.items():
        monkeypatch.setattr(getattr(fa, f"_flash_attn_{d}"), "compile_cache", cache)
    major, minor = torch.cuda.get_device_capability()
    dev, hq, hk, d = torch.device("cuda"), 16, 2, 128
    config = dict(dtype=torch.bfloat16, head_dim=d, num_heads_q=hq, num_heads_kv=hk, arch=10 * major + minor)
    mirrored = {"fwd": [], "bwd": []}
    seen = {"fwd": [], "bwd": []}
    for qr, kr, tm, total in mask_stream(10, seed=7):
        key = L.compile_key(L.build_mask_meta(*_tensors(qr, kr, tm), total, total, CPU), **config)
        for direction in mirrored:
            mirrored[direction].append(frozenset(k for k in key if k[0] == direction))
            caches[direction].keys.clear()
        q, k, v = (
            torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            for h in (hq, hk, hk)
        )
        out, _ = magi_ffa_fa4.flex_flash_attn_func(q, k, v, *(t.to(dev) for t in _tensors(qr, kr, tm)))
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        for direction in seen:
            seen[direction].append(frozenset(caches[direction].keys))
    for direction in mirrored:
        assert [len(x) for x in mirrored[direction]] == [len(x) for x in seen[direction]], direction
        assert _partition(mirrored[direction]) == _partition(seen[direction]), direction
        assert len(set(seen[direction])) > 2, "the stream must need several kernels"
