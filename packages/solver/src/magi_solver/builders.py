"""Mask builders: common masks as slice lists. Each returns a `MaskSpec` `(q_ranges, k_ranges, types)`
(unpacks as a 3-tuple) whose slices share no (q, k) pair; `spec.to_dense(total)` draws it for tests.

Documents are given as `cu_seqlens` (`[0, len_0, len_0 + len_1, ...]`); tokens attend only inside their
document. Windows are `(left, right)`: row q sees keys `q - left .. q + right` (-1 = unbounded), as in
FlashAttention's `window_size`.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .mask import AttnMaskType, decompose_region, tighten_region
from .ranges import AttnRange, AttnRanges, _check_int

__all__ = [
    "DOC_WINDOW",
    "FAMILY_MASKS",
    "VIDEO_FRAME_TOKENS",
    "MaskSpec",
    "family_doc_lengths",
    "lognormal_doc_lengths",
    "long_tailed_cu_seqlens",
    "make_block_causal_mask",
    "make_family_mask",
    "make_global_window_mask",
    "make_prefix_lm_mask",
    "make_shared_question_mask",
    "make_sliding_window_mask",
    "make_varlen_causal_mask",
    "make_varlen_full_mask",
]

_TYPES = tuple(AttnMaskType)  # by code


class MaskSpec(NamedTuple):
    """A mask as slices: `q_ranges[i]`, `k_ranges[i]`, `types[i]`."""

    q_ranges: AttnRanges
    k_ranges: AttnRanges
    types: tuple[AttnMaskType, ...]

    def to_dense(self, total_q: int, total_k: int | None = None) -> np.ndarray:
        """Bool `[total_q, total_k]` mask (the union of the slices)."""
        total_k = total_q if total_k is None else total_k
        out = np.zeros((total_q, total_k), dtype=bool)
        for q, k, t in zip(self.q_ranges, self.k_ranges, self.types):
            sq, sk = q.seqlen, k.seqlen
            i = np.arange(sq)[:, None]
            j = np.arange(sk)[None, :]
            m = np.ones((sq, sk), dtype=bool)
            if t.code & 1:
                m &= j <= i + sk - sq
            if t.code & 2:
                m &= j >= i
            out[q.start : q.end, k.start : k.end] |= m
        return out

    @property
    def num_slices(self) -> int:
        return len(self.types)


class _Builder:
    def __init__(self) -> None:
        self.q: list[AttnRange] = []
        self.k: list[AttnRange] = []
        self.t: list[AttnMaskType] = []

    def region(
        self, qs: int, qe: int, ks: int, ke: int, lo: int | None = None, hi: int | None = None
    ) -> None:
        """Add `[qs, qe) x [ks, ke)` with `lo <= k - q <= hi` (None = unbounded) as typed slices."""
        lo = ks - qe + 1 if lo is None else lo
        hi = ke - 1 - qs if hi is None else hi
        r = tighten_region(qs, qe, ks, ke, lo, hi)
        if r is None:
            return
        for a, b, c, d, t in decompose_region(r):
            self.q.append(AttnRange(a, b))
            self.k.append(AttnRange(c, d))
            self.t.append(_TYPES[t])

    def spec(self) -> MaskSpec:
        return MaskSpec(AttnRanges(tuple(self.q)), AttnRanges(tuple(self.k)), tuple(self.t))


def _docs(cu_seqlens: Any) -> list[tuple[int, int]]:
    return AttnRanges.from_cu_seqlens(cu_seqlens).to_tuples()


def _window(window: Any) -> tuple[int | None, int | None]:
    if not isinstance(window, Sequence) or len(window) != 2:
        raise ValueError(f"`window` must be a (left, right) pair, got {window!r}")
    left, right = (_check_int(w, "window") for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"`window` entries must be >= 0, or -1 for unbounded, got {window!r}")
    return (None if left == -1 else -left), (None if right == -1 else right)


def lognormal_doc_lengths(
    total: int,
    *,
    median: float | None = None,
    sigma: float = 1.0,
    seed: int = 0,
    num_docs: int | None = None,
    floor: int = 1,
    cap: int | None = None,
    unit: int = 1,
) -> list[int]:
    """Seeded log-normal document lengths summing to exactly `total`: the one document-length generator of the
    planner's masks, the CLI, the demos and the benchmarks. Two ways to fill `total`:

    - `num_docs=None` (drawn until full): each length is `unit * max(floor, min(int(x), cap))` with
      `x ~ LogNormal(log(median), sigma)` from `random.Random(seed)` (`floor`, `cap` and `median` in units
      of `unit` tokens; `cap=None`: no cap); documents are drawn until `total` is reached, the last one cut
      at `total` (so it may be shorter than `floor` or not a multiple of `unit`).
    - `num_docs=n`: `n` draws `x ~ LogNormal(log(median), sigma)` from `numpy.random.default_rng(seed)`
      (`median=None`: 1) scaled to shares of `total`, each rounded down and at least `floor`, the rounding
      remainder given to the longest (its median is that of the shares, not `median`). `cap` and `unit`
      do not apply.

    Returns the lengths in order (`[0, *itertools.accumulate(lengths)]` are the `cu_seqlens`). The same on
    every machine for a seed.
    """
    total = _check_int(total, "total")
    if total < 0:
        raise ValueError(f"`total` must be >= 0, got {total}")
    floor, unit = _check_int(floor, "floor"), _check_int(unit, "unit")
    if floor < 1 or unit < 1:
        raise ValueError(f"`floor` and `unit` must be >= 1, got floor={floor}, unit={unit}")
    if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or not sigma >= 0:
        raise ValueError(f"`sigma` must be a number >= 0, got {sigma!r}")
    if median is not None and (
        isinstance(median, bool) or not isinstance(median, (int, float)) or not median > 0
    ):
        raise ValueError(f"`median` must be a number > 0, got {median!r}")
    if num_docs is not None:
        n = _check_int(num_docs, "num_docs")
        if not (1 <= n and n * floor <= total):
            raise ValueError(f"`num_docs` must lie in [1, total / floor = {total // floor}], got {n}")
        if cap is not None or unit != 1:
            raise ValueError("`cap` and `unit` apply only without `num_docs` (documents drawn until full)")
        mu = 0.0 if median is None else math.log(median)
        w = np.random.default_rng(seed).lognormal(mu, sigma, n)
        lens = np.maximum(floor, np.floor(w / w.sum() * total)).astype(np.int64)
        lens[np.argmax(lens)] += total - int(lens.sum())
        return lens.tolist()
    if median is None:
        raise ValueError("`median` is needed when documents are drawn until full (`num_docs=None`)")
    hi = math.inf if cap is None else _check_int(cap, "cap")
    rng, mu = random.Random(seed), math.log(median)
    lengths: list[int] = []
    filled = 0
    while filled < total:
        # exp(normalvariate) is random.Random's own log-normal draw (CPython defines it so): the same numbers
        n = unit * max(floor, min(int(math.exp(rng.normalvariate(mu, sigma))), hi))
        lengths.append(min(n, total - filled))
        filled += lengths[-1]
    return lengths


def long_tailed_cu_seqlens(total: int, seed: int = 0) -> list[int]:
    """`cu_seqlens` of packed documents with long-tailed lengths: log-normal around `total / 16` (sigma 1),
    each between 128 tokens and `total / 4`, the last one cut at `total`; seeded, the same on every machine
    (the documents of the benchmarks' varlen masks; `lognormal_doc_lengths`)."""
    if _check_int(total, "total") < 1:
        raise ValueError(f"total must be at least 1, got {total}")
    lengths = lognormal_doc_lengths(total, median=total / 16, sigma=1.0, seed=seed, floor=128, cap=total // 4)
    return [0, *itertools.accumulate(lengths)]


def make_varlen_full_mask(cu_seqlens: Sequence[int]) -> MaskSpec:
    """Each document attends to itself fully: one FULL slice per document."""
    b = _Builder()
    for s, e in _docs(cu_seqlens):
        b.region(s, e, s, e)
    return b.spec()


def make_varlen_causal_mask(cu_seqlens: Sequence[int]) -> MaskSpec:
    """Causal attention inside each document: one CAUSAL slice per document."""
    b = _Builder()
    for s, e in _docs(cu_seqlens):
        b.region(s, e, s, e, hi=0)
    return b.spec()


def make_sliding_window_mask(cu_seqlens: Sequence[int], window: tuple[int, int]) -> MaskSpec:
    """Row q of a document sees keys `q - left .. q + right` of that document (at most three slices each).

    `(left, 0)` is causal sliding-window attention; `(-1, 0)` is plain causal; `(-1, -1)` is full.
    """
    lo, hi = _window(window)
    b = _Builder()
    for s, e in _docs(cu_seqlens):
        b.region(s, e, s, e, lo, hi)
    return b.spec()


def make_global_window_mask(cu_seqlens: Sequence[int], window: tuple[int, int], num_global: int) -> MaskSpec:
    """Sliding window plus `num_global` global tokens at the start of each document (attention sinks).

    Row q sees its window and also the document's first `num_global` keys, still subject to the window's
    right bound (so a causal window stays causal): `k in window(q)  or  (k < start + num_global and
    k <= q + right)`.
    """
    lo, hi = _window(window)
    g = _check_int(num_global, "num_global")
    if g < 0:
        raise ValueError(f"`num_global` must be >= 0, got {g}")
    b = _Builder()
    for s, e in _docs(cu_seqlens):
        m = min(e, s + g)
        b.region(s, e, s, m, None, hi)  # the global keys: only the right bound applies
        b.region(s, e, m, e, lo, hi)
    return b.spec()


def make_block_causal_mask(cu_seqlens: Sequence[int], block_size: int) -> MaskSpec:
    """Block-causal (video / Magi-1): block i of a document sees blocks 0..i of it fully (last block may be short)."""
    bs = _check_int(block_size, "block_size")
    if bs <= 0:
        raise ValueError(f"`block_size` must be positive, got {bs}")
    b = _Builder()
    for s, e in _docs(cu_seqlens):
        for a in range(s, e, bs):
            b.region(a, min(e, a + bs), s, min(e, a + bs))
    return b.spec()


def make_prefix_lm_mask(cu_seqlens: Sequence[int], prefix_lens: Sequence[int] | int) -> MaskSpec:
    """Prefix-LM: every row of a document sees the document's prefix bidirectionally, and is causal after it."""
    docs = _docs(cu_seqlens)
    if isinstance(prefix_lens, int) or not isinstance(prefix_lens, Sequence):
        prefix_lens = [prefix_lens] * len(docs)  # type: ignore[list-item]
    if len(prefix_lens) != len(docs):
        raise ValueError(f"`prefix_lens` has {len(prefix_lens)} entries for {len(docs)} non-empty documents")
    b = _Builder()
    for i, ((s, e), p) in enumerate(zip(docs, prefix_lens)):
        p = _check_int(p, f"prefix_lens[{i}]")
        if not 0 <= p <= e - s:
            raise ValueError(f"`prefix_lens[{i}]` = {p} must lie in [0, {e - s}] (the document length)")
        b.region(s, e, s, s + p)
        b.region(s, e, s + p, e, hi=0)
    return b.spec()


def make_shared_question_mask(question_lens: Sequence[int], answer_lens: Sequence[Sequence[int]]) -> MaskSpec:
    """Shared-question packing: each sample is `[question, answer_0, answer_1, ...]` packed back to back.

    The question is causal; each answer sees the whole question and itself causally, never other answers.
    """
    if len(question_lens) != len(answer_lens):
        raise ValueError(
            f"`question_lens` ({len(question_lens)}) and `answer_lens` ({len(answer_lens)}) differ in length"
        )
    b = _Builder()
    off = 0
    for i, (ql, answers) in enumerate(zip(question_lens, answer_lens)):
        ql = _check_int(ql, f"question_lens[{i}]")
        if ql <= 0:
            raise ValueError(f"`question_lens[{i}]` must be positive, got {ql}")
        q0, q1 = off, off + ql
        b.region(q0, q1, q0, q1, hi=0)
        off = q1
        for j, al in enumerate(answers):
            al = _check_int(al, f"answer_lens[{i}][{j}]")
            if al <= 0:
                raise ValueError(f"`answer_lens[{i}][{j}]` must be positive, got {al}")
            b.region(off, off + al, q0, q1)
            b.region(off, off + al, off, off + al, hi=0)
            off += al
    return b.spec()


# ------------------------------------------------------------------------------------------ mask families
class _Family(NamedTuple):
    """A family's document lengths (`lognormal_doc_lengths` drawn until full), in units of `unit` tokens."""

    median: float
    sigma: float
    floor: int
    cap: int | None
    unit: int
    doc: str


VIDEO_FRAME_TOKENS = 1560
"""Tokens of one frame of `video_clips` (not a power of two: frames do not line up with dispatch chunks)."""

_DOCS4K = _Family(4096, 1.0, 1, 65536, 1, "log-normal lengths, median 4,096 tokens, sigma 1, at most 65,536")
_FAMILIES: dict[str, _Family | None] = {
    "full": None,
    "causal": None,
    "docs4k_causal": _DOCS4K,
    "docs4k_full": _DOCS4K,
    "short_docs_causal": _Family(
        512, 1.5, 1, 65536, 1, "log-normal lengths, median 512, sigma 1.5, at most 65,536"
    ),
    "docs4k_window2048": _DOCS4K,
    "video_clips": _Family(
        16,
        0.5,
        8,
        32,
        VIDEO_FRAME_TOKENS,
        "clips of 8-32 frames of 1,560 tokens (log-normal, median 16 frames)",
    ),
}
FAMILY_MASKS: tuple[str, ...] = tuple(_FAMILIES)
"""Names of `make_family_mask`: masks defined in tokens (document lengths do not scale with the total), so the
same family is drawn at every total token count."""

DOC_WINDOW = 2048
"""`docs4k_window2048`: each row sees its own key and the 2,047 before it, inside its document."""


def family_doc_lengths(name: str, total: int, seed: int = 0) -> list[int]:
    """The document (or clip) lengths of family `name` over `total` tokens: drawn until `total` is filled, the
    last one cut (`lognormal_doc_lengths`); `[total]` for `full` and `causal`. Seeded."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown mask family {name!r}; choose from {FAMILY_MASKS}")
    if _check_int(total, "total") < 1:
        raise ValueError(f"`total` must be at least 1, got {total}")
    f = _FAMILIES[name]
    if f is None:
        return [total]
    return lognormal_doc_lengths(
        total, median=f.median, sigma=f.sigma, seed=seed, floor=f.floor, cap=f.cap, unit=f.unit
    )


def make_family_mask(name: str, total: int, seed: int = 0) -> MaskSpec:
    """Mask family `name` over `total` tokens (`FAMILY_MASKS`), its documents from `family_doc_lengths`:

    - `full`, `causal`: one document of `total` tokens.
    - `docs4k_causal` / `docs4k_full`: packed documents, causal / full inside each; log-normal lengths, median
      4,096 tokens, sigma 1.0, capped at 65,536.
    - `short_docs_causal`: packed causal documents, median 512 tokens, sigma 1.5, capped at 65,536.
    - `docs4k_window2048`: the `docs4k` documents, each a causal sliding window of 2,048 keys (`DOC_WINDOW`).
    - `video_clips`: clips of 8-32 frames of 1,560 tokens (`VIDEO_FRAME_TOKENS`), block-causal by frame:
      a frame sees every frame of its clip up to itself, fully.
    """
    cu = [0, *itertools.accumulate(family_doc_lengths(name, total, seed))]
    if name in ("full", "docs4k_full"):
        return make_varlen_full_mask(cu)
    if name == "docs4k_window2048":
        return make_sliding_window_mask(cu, (DOC_WINDOW - 1, 0))
    if name == "video_clips":
        return make_block_causal_mask(cu, VIDEO_FRAME_TOKENS)
    return make_varlen_causal_mask(cu)
