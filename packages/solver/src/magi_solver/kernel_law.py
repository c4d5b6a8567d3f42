"""One law of a rank's predicted attention-kernel time, used by the dispatch choice, the placement, the
overlap cost model and the CLI.

A rank's kernel works on 128 x 128 tiles. Measured on one H200 (`docs/benchmarks/scaling.md`), its time is
linear in three counts of its problem:

* ``tiles``: the rank's mask area over 128^2 (every (q, k) pair it computes, in tile units);
* ``key columns``: the keys it holds plus the keys it receives, over 128 (each key tile is one CTA column of
  the backward, which loads K / V and writes dK / dV once per column however few query tiles it meets);
* ``rows``: its query rows over 128 (the forward's per-query-tile work: loading Q, writing O and LSE).

``fwd_us = a_f * tiles + b_f * columns + c_f * rows + d_f`` and ``bwd_us`` alike, per kernel backend and GPU
kind. The constants were fitted at 64:8 heads, head dim 128, bf16; another shape scales every term by
``heads_q * head_dim / (64 * 128)`` (tiles and columns both grow with the heads and the head dim).

The constants live in ``kernel_tables/<gpu kind>_law.json`` beside the kernel tables, with the data they were
fitted on and their error (``benchmarks/fit_kernel_law.py`` writes that file from scaling runs). ``auto``
prices with the law of the backend ``kernel_choice``'s table picks for the whole mask (forward and backward
may differ), so the law is a pure function of the mask: every rank and the layout re-solve price alike.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

__all__ = [
    "LAW_HEADS_Q",
    "LAW_HEAD_DIM",
    "TILE",
    "DirectionLaw",
    "KernelLaw",
    "find_kernel_law",
    "get_kernel_law",
    "law_for_mask",
    "load_law_table",
]

TILE = 128
"""Tile edge the counts are taken in."""
LAW_HEADS_Q = 64
LAW_HEAD_DIM = 128
"""The shape the shipped constants were fitted at."""
_TERMS = ("tiles", "key_columns", "rows", "call")


@dataclass(frozen=True, slots=True)
class DirectionLaw:
    """Microseconds of one direction's kernel per tile, key column, row (query tile) and call.

    Attributes:
        backend: the kernel backend the constants were measured on.
        tiles, key_columns, rows, call: the law's constants (us each); all finite and >= 0.
        estimate: True when no measured rank of this backend fitted them (another backend's constants).
        source: the data they were fitted on and the fit's error, in words.
    """

    backend: str
    tiles: float
    key_columns: float
    rows: float
    call: float = 0.0
    estimate: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        for name in _TERMS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0:
                raise ValueError(f"DirectionLaw `{name}` must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))

    def us(self, tiles: Any, key_columns: Any, rows: Any) -> np.ndarray:
        """float64 microseconds for arrays (or scalars) of counts, broadcast; a rank with no tiles runs no
        call (the runtime skips empty calls), so it costs 0."""
        t = np.asarray(tiles, dtype=np.float64)
        c = np.asarray(key_columns, dtype=np.float64)
        r = np.asarray(rows, dtype=np.float64)
        out = self.tiles * t + self.key_columns * c + self.rows * r + self.call
        return np.where(t > 0, out, 0.0)

    @classmethod
    def from_dict(cls, backend: str, data: Mapping[str, Any]) -> DirectionLaw:
        """From the law file's entry ``{"tiles": .., "key_columns": .., "rows": .., "call": .., ...}``."""
        missing = [k for k in ("tiles", "key_columns", "rows") if k not in data]
        if missing:
            raise ValueError(f"kernel law entry of {backend!r} lacks {missing}")
        return cls(
            backend,
            data["tiles"],
            data["key_columns"],
            data["rows"],
            data.get("call", 0.0),
            bool(data.get("estimate", False)),
            str(data.get("source", "")),
        )


@dataclass(frozen=True, slots=True)
class KernelLaw:
    """The forward and backward laws of one GPU kind (and backend, or the pair ``auto`` picks), scaled to an
    attention shape.

    Attributes:
        gpu: the GPU kind ("h200").
        fwd, bwd: the two directions' laws (their backends may differ under ``auto``).
        scale: ``heads_q * head_dim / (LAW_HEADS_Q * LAW_HEAD_DIM)``, applied to every term.
    """

    gpu: str
    fwd: DirectionLaw
    bwd: DirectionLaw
    scale: float = 1.0

    @property
    def backend(self) -> str:
        """``"cudnn"``, or ``"<fwd>/<bwd>"`` where the directions differ."""
        f, b = self.fwd.backend, self.bwd.backend
        return f if f == b else f"{f}/{b}"

    def fwd_ms(self, area: Any, key_tokens: Any, rows_tokens: Any) -> np.ndarray:
        """float64 ms of the forward for per-rank arrays of mask area (pairs), key tokens (own + received)
        and query tokens; tiles, columns and rows are those over 128^2, 128 and 128 (ceil for rows)."""
        return self._ms(self.fwd, area, key_tokens, rows_tokens)

    def bwd_ms(self, area: Any, key_tokens: Any, rows_tokens: Any) -> np.ndarray:
        """float64 ms of the backward; arguments as `fwd_ms`."""
        return self._ms(self.bwd, area, key_tokens, rows_tokens)

    def _ms(self, law: DirectionLaw, area: Any, keys: Any, rows: Any) -> np.ndarray:
        tiles = np.asarray(area, dtype=np.float64) / (TILE * TILE)
        cols = np.asarray(keys, dtype=np.float64) / TILE
        qt = np.ceil(np.asarray(rows, dtype=np.float64) / TILE)
        return law.us(tiles, cols, qt) * (self.scale * 1e-3)

    def scaled(self, num_heads_q: int, head_dim: int) -> KernelLaw:
        """This law for another attention shape (every term times ``heads_q * head_dim / (64 * 128)``)."""
        for v, name in ((num_heads_q, "num_heads_q"), (head_dim, "head_dim")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {v!r}")
        return KernelLaw(self.gpu, self.fwd, self.bwd, num_heads_q * head_dim / (LAW_HEADS_Q * LAW_HEAD_DIM))


@cache
def load_law_table(gpu: str) -> dict[str, Any] | None:
    """The shipped law file of a GPU kind (``kernel_tables/<gpu>_law.json``) as a dict, or None."""
    folder = resources.files("magi_solver").joinpath("kernel_tables")
    name = f"{gpu}_law.json"
    if not folder.joinpath(name).is_file():
        return None
    return json.loads(folder.joinpath(name).read_text())


_FALLBACK_GPU = "h200"
"""The kind whose law prices a GPU with no law of its own (the choice needs only ratios of its terms)."""


@cache
def get_kernel_law(gpu: str = "h200", backend: str = "cudnn", backward: str | None = None) -> KernelLaw:
    """The shipped law of ``gpu`` for ``backend`` (forward) and ``backward`` (default: the same backend).

    A GPU kind with no law file uses the H200's (the planner compares placements, which needs the terms'
    ratios, not the device's speed); a backend with no entry raises ValueError naming the known ones.
    """
    table = load_law_table(gpu)
    if table is None:
        table = load_law_table(_FALLBACK_GPU)
        if table is None:  # pragma: no cover - the package ships it
            raise ValueError(f"no kernel law shipped for {gpu!r} nor {_FALLBACK_GPU!r}")
    laws = table["laws"]
    bwd_backend = backward or backend
    for b in (backend, bwd_backend):
        if b not in laws:
            raise ValueError(f"`backend` must be one of {sorted(laws)} for the kernel law, got {b!r}")
    fwd = DirectionLaw.from_dict(backend, laws[backend]["fwd"])
    bwd = DirectionLaw.from_dict(bwd_backend, laws[bwd_backend]["bwd"])
    return KernelLaw(str(table["gpu_kind"]), fwd, bwd)


def find_kernel_law(gpu: str, backend: str, backward: str | None = None) -> KernelLaw | None:
    """The shipped law of exactly this GPU kind and backends, or None where none was fitted (another GPU
    kind, the Triton backend): the caller then keeps its own model (the overlap cost model its profile)."""
    table = load_law_table(gpu)
    if table is None or backend not in table["laws"] or (backward or backend) not in table["laws"]:
        return None
    return get_kernel_law(gpu, backend, backward)


_DEFAULT_BACKEND = "cudnn"
"""``auto``'s law where the kernel table has no row to pick from."""


def law_for_mask(
    slices: list[tuple[int, int, int, int, int]], total_q: int, gpu: str = "h200", backend: str = "auto"
) -> KernelLaw:
    """The law to price ``slices`` with: ``backend``'s, or for ``auto`` the forward and backward backends the
    kernel table of ``gpu`` picks for the WHOLE mask (FA4 and cuDNN as candidates, head dim 128). A pure
    function of the mask: the dispatch is solved before the runtime agrees on a backend, and every rank and
    the layout's re-solve must price alike."""
    if backend != "auto":
        return get_kernel_law(gpu, backend)
    # the pick walks the mask's rows in Python: remembered per mask (a key's layout and plan ask alike)
    digest = (
        hashlib.blake2b(np.asarray(slices, dtype=np.int64).tobytes(), digest_size=16).digest(),
        total_q,
        gpu,
    )
    pair = _AUTO_CACHE.get(digest)
    if pair is None:
        pair = _auto_pair(slices, total_q, gpu)
        _AUTO_CACHE[digest] = pair
        while len(_AUTO_CACHE) > _AUTO_CACHE_SIZE:
            _AUTO_CACHE.popitem(last=False)
    else:
        _AUTO_CACHE.move_to_end(digest)
    return get_kernel_law(gpu, *pair)


_AUTO_CACHE: OrderedDict[tuple, tuple[str, str]] = OrderedDict()
_AUTO_CACHE_SIZE = 256


def _auto_pair(slices: list, total_q: int, gpu: str) -> tuple[str, str]:
    from .kernel_choice import load_kernel_table, mask_features, pick_kernel

    table = load_kernel_table(gpu) or load_kernel_table(_FALLBACK_GPU)
    if not slices:
        return _DEFAULT_BACKEND, _DEFAULT_BACKEND
    pick = pick_kernel(table, mask_features(slices, total_q), LAW_HEAD_DIM, ("cudnn", "fa4"))
    if pick is None:
        return _DEFAULT_BACKEND, _DEFAULT_BACKEND
    return pick.forward, pick.backward
