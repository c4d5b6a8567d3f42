"""Test helpers shared by every package that checks attention numerics (stable API).

- :func:`make_attn_mask`: dense bool mask ``[total_q, total_k]`` from slices (union of slice masks).
- :func:`ref_attn`: dense, autograd-capable reference attention in the inputs' dtype; call it with float64
  copies for ground truth and with same-dtype copies for the "naive low-precision" error.
- :func:`random_banded_slices` (slices in a grid of q and k bands: overlapping in q or in k, never in a
  (q, k) pair), :func:`random_overlapping_slices` (uniformly random: any overlap), :func:`varlen_slices`
  (one per document): slice generators (all four types, empty slices, rows with no keys);
  :func:`random_qkv`: seeded inputs. ``random_slices`` is the deprecated old name of
  :func:`random_banded_slices`.
- :func:`assert_close_to_ref` / :func:`tolerance_for`: the acceptance rule of MagiAttention's tests: the
  error to the float64 reference may be at most ``norm_ratio`` (2) times the error of the same-dtype naive
  reference plus an atol derived from the dtype's rounding, and elementwise mismatches (beyond ``rtol``) may
  be at most 2x as frequent as the naive reference's (capped at 75%).
- :func:`interpret_triton_without_cuda`: the one rule of every test suite's ``conftest.py``: Triton's
  interpreter only where no CUDA device is present.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import torch
from magi_mask import AttnMaskType, dense_mask

from ._common import RangesLike, TypeMapLike, as_ranges, as_type_map
from ._deprecation import deprecated_aliases
from ._slice import make_slice
from .env import interpret_triton_without_cuda

__all__ = [
    "assert_bitwise_repeatable",
    "assert_close_to_ref",
    "deterministic_mask_cases",
    "interpret_triton_without_cuda",
    "make_attn_mask",
    "random_banded_slices",
    "random_overlapping_slices",
    "random_qkv",
    "ref_attn",
    "ref_max_logits",
    "split_keys_into_stages",
    "tolerance_for",
    "varlen_slices",
]


def make_attn_mask(
    q_ranges: RangesLike, k_ranges: RangesLike, attn_type_map: TypeMapLike, total_q: int, total_k: int
) -> torch.Tensor:
    """Dense bool mask ``[total_q, total_k]`` (True = visible), the OR of every slice's mask, built on the CPU
    by the one dense oracle ``magi_mask.dense_mask`` (types as in ``magi_mask.AttnMaskType``)."""
    qr = as_ranges(q_ranges, "q_ranges", torch.device("cpu")).cpu().tolist()
    kr = as_ranges(k_ranges, "k_ranges", torch.device("cpu")).cpu().tolist()
    tm = as_type_map(attn_type_map, len(qr), torch.device("cpu")).cpu().tolist()
    return torch.from_numpy(dense_mask(qr, kr, tm, total_q, total_k))


def ref_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    *,
    sink: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention: q ``[total_q, num_heads_q, head_dim]``, k/v ``[total_k, num_heads_kv, head_dim]``,
    mask bool ``[total_q, total_k]``. Returns out (q's shape) and lse ``[total_q, num_heads_q]`` in the inputs'
    dtype, computed in that dtype (or in ``dtype``, on copies of q, k, v, when given; differentiable). Rows
    with no visible key: out 0, lse -inf, gradients 0 (no NaN).

    ``sink`` ``[num_sink, num_heads_q]`` (autograd-capable): extra logits in every row's softmax that carry
    no value (concatenated to the scores as value-less columns); lse includes them and rows with no
    visible key then have out 0 and a finite lse."""
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    s = _scores(q, k, mask, softmax_scale, softcap)
    vh = v.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    if sink is not None:
        tq = q.shape[0]
        cols = sink.to(s.dtype).t()[:, None, :].expand(hq, tq, sink.shape[0])
        full = torch.cat([s, cols], dim=-1)
        lse = torch.logsumexp(full, dim=-1)  # [hq, tq], finite: the sinks are in every row
        out = torch.matmul(torch.exp(s - lse[..., None]), vh).transpose(0, 1)
        return out, lse.transpose(0, 1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    pos = l > 0
    l_safe = torch.where(pos, l, torch.ones_like(l))
    out = torch.matmul(e / l_safe, vh).transpose(0, 1)
    lse = torch.where(pos, torch.log(l_safe) + m, torch.full_like(m, float("-inf")))[..., 0].transpose(0, 1)
    return out, lse


def _scores(q, k, mask, softmax_scale, softcap) -> torch.Tensor:
    """Masked (-inf) scaled, soft-capped scores ``[num_heads_q, total_q, total_k]``."""
    hq, hk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    kh = k.repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    s = torch.matmul(q.transpose(0, 1), kh.transpose(1, 2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~mask.to(q.device)[None], float("-inf"))


def ref_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Dense max logits ``[num_heads_q]`` in the inputs' dtype: per head the largest scaled (soft-capped)
    score over the visible pairs of ``mask``; -inf for a head with none."""
    s = _scores(q, k, mask, softmax_scale, softcap)
    return s.flatten(1).amax(1) if s[0].numel() else s.new_full((q.shape[1],), float("-inf"))


def random_qkv(
    total_q: int,
    total_k: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded normal q ``[total_q, heads_q, head_dim]``, k/v ``[total_k, heads_kv, head_dim]`` (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total_q, heads_q, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(total_k, heads_kv, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(total_k, heads_kv, head_dim, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _cuts(total: int, bands: int, rng: random.Random) -> list[tuple[int, int]]:
    pts = sorted({0, total, *(rng.randrange(total + 1) for _ in range(bands - 1))})
    return list(itertools.pairwise(pts))


def _sub(lo: int, hi: int, rng: random.Random, empty_prob: float) -> tuple[int, int]:
    u = rng.random()
    if u < empty_prob:
        x = rng.randint(lo, hi)
        return x, x
    if u > 0.6:  # the whole band: dense, aligned cases
        return lo, hi
    a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)))
    if a == b:  # keep non-empty unless asked
        a, b = lo, hi
    return a, b


def random_overlapping_slices(
    rng: random.Random,
    total_q: int,
    total_k: int,
    num_slices: int,
    *,
    types: tuple[int, ...] = (0, 1, 2, 3),
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Uniformly random slices: any two may overlap in q, in k and in (q, k) pairs; some are empty.

    Returns python lists ``(q_ranges, k_ranges, attn_type_map)`` of ``num_slices`` entries."""
    qr, kr, tm = [], [], []
    for _ in range(num_slices):
        a, b = sorted(rng.randrange(total_q + 1) for _ in range(2))
        c, e = sorted(rng.randrange(total_k + 1) for _ in range(2))
        qr.append([a, b])
        kr.append([c, e])
        tm.append(rng.choice(types))
    return qr, kr, tm


def random_banded_slices(
    total_q: int,
    total_k: int,
    *,
    seed: int,
    max_bands: int = 4,
    density: float = 0.7,
    types: Sequence[int] = (0, 1, 2, 3),
    empty_prob: float = 0.1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded random slices with disjoint areas: q and k are cut into bands, each (q band, k band) cell holds
    at most one slice on random sub-ranges, so slices overlap in q (same q band) and in k (same k band).
    Includes empty slices (``empty_prob``) and uncovered rows. Returns CPU int32 ``q_ranges [n, 2]``,
    ``k_ranges [n, 2]``, ``attn_type_map [n]`` in shuffled order (n may be 0 only if ``density`` is 0)."""
    rng = random.Random(seed)
    qb = _cuts(total_q, rng.randint(min(2, max_bands), max_bands), rng)
    kb = _cuts(total_k, rng.randint(min(2, max_bands), max_bands), rng)
    out: list[tuple[int, int, int, int, int]] = []
    for q0, q1 in qb:
        for k0, k1 in kb:
            if rng.random() < density:
                out.append(
                    (*_sub(q0, q1, rng, empty_prob), *_sub(k0, k1, rng, empty_prob), rng.choice(types))
                )
    if density > 0 and all(make_slice(*x) is None for x in out):  # guarantee some visible pairs
        (q0, q1), (k0, k1) = qb[0], kb[-1]
        out.append((q0, q1, k0, k1, AttnMaskType.FULL))
    rng.shuffle(out)
    t = torch.tensor(out, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def varlen_slices(seqlens: Sequence[int], attn_type: int = AttnMaskType.FULL) -> tuple[torch.Tensor, ...]:
    """One slice per packed document (self-attention): q_range = k_range = the document's rows."""
    starts = [0]
    for n in seqlens:
        starts.append(starts[-1] + n)
    r = torch.tensor([[a, b] for a, b in itertools.pairwise(starts)], dtype=torch.int32).reshape(-1, 2)
    return r, r.clone(), torch.full((r.shape[0],), int(attn_type), dtype=torch.int32)


# default elementwise rtol per quantity and dtype (MagiAttention's FFA tests); atol from the dtype's rounding
_RTOL = {
    "out": {torch.bfloat16: 0.05, torch.float16: 0.05},
    "lse": {torch.bfloat16: 1e-3, torch.float16: 1e-3},
    "dq": {torch.bfloat16: 0.3, torch.float16: 0.2},
    "dk": {torch.bfloat16: 0.15, torch.float16: 0.08},
    "dv": {torch.bfloat16: 0.05, torch.float16: 0.05},
}
_ATOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def tolerance_for(name: str, dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for quantity ``name`` (out, lse, dq, dk, dv) computed from ``dtype`` inputs."""
    rtol = _RTOL.get(name, {}).get(dtype, 1e-3 if dtype == torch.float32 else 1e-8)
    return _ATOL[dtype], rtol


def assert_close_to_ref(
    name: str,
    actual: torch.Tensor,
    ref64: torch.Tensor,
    ref_lp: torch.Tensor,
    dtype: torch.dtype,
    *,
    norm_ratio: float = 2.0,
    mismatch_ratio: float = 2.0,
    min_mismatch: float = 5e-3,
    max_mismatch: float = 0.75,
) -> None:
    """Assert ``actual`` is as close to the float64 truth ``ref64`` as the rule allows.

    ``ref_lp`` is the same-dtype naive reference (pass ``ref64`` itself for float64 inputs). Infinite values
    (lse -inf of empty rows) must match exactly; NaN always fails. Raises AssertionError naming ``name``.
    """
    a = actual.detach().to(torch.float64).cpu()
    r = ref64.detach().to(torch.float64).cpu()
    lp = ref_lp.detach().to(torch.float64).cpu()
    assert a.shape == r.shape, f"{name}: shape {tuple(a.shape)} != reference {tuple(r.shape)}"
    assert not torch.isnan(a).any(), f"{name}: {int(torch.isnan(a).sum())} NaN values"
    inf_a, inf_r = torch.isinf(a), torch.isinf(r)
    assert torch.equal(inf_a, inf_r) and torch.equal(a[inf_a], r[inf_r]), (
        f"{name}: infinite entries differ ({int(inf_a.sum())} vs {int(inf_r.sum())} in the reference)"
    )
    fin = ~inf_r
    a, r, lp = a[fin], r[fin], torch.where(torch.isinf(lp[fin]), r[fin], lp[fin])
    if a.numel() == 0:
        return
    atol, rtol = tolerance_for(name, dtype)
    err = (a - r).abs().max().item()
    err_lp = (lp - r).abs().max().item()
    bound = norm_ratio * err_lp + atol
    assert err <= bound, (
        f"{name}: max error {err:.3e} > {norm_ratio} x naive {dtype} error {err_lp:.3e} + {atol:.1e}"
    )
    bad = ((a - r).abs() > atol + rtol * r.abs()).double().mean().item()
    bad_lp = ((lp - r).abs() > atol + rtol * r.abs()).double().mean().item()
    allowed = min(max(mismatch_ratio * bad_lp, min_mismatch), max_mismatch)
    assert bad <= allowed, f"{name}: {bad:.2%} elements beyond rtol {rtol} (allowed {allowed:.2%})"


def split_keys_into_stages(
    q_ranges: Sequence[Sequence[int]],
    k_ranges: Sequence[Sequence[int]],
    types: Sequence[int],
    cuts: Sequence[int],
) -> list[tuple[list, list, list]]:
    """The slices of each key stage ``[cuts[i], cuts[i + 1])`` in stage-local key coordinates, as the runtime
    splits keys into overlap stages (for tests of stage-wise launcher calls). FULL slices are cut at the stage
    bounds; any other slice must lie inside one stage (cutting a causal slice would move its diagonal)."""
    stages: list[tuple[list, list, list]] = [([], [], []) for _ in range(len(cuts) - 1)]
    for (qs, qe), (ks, ke), t in zip(q_ranges, k_ranges, types):
        for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
            a, b = max(ks, lo), min(ke, hi)
            if a >= b:
                continue
            if t != 0 and (a, b) != (ks, ke):
                raise ValueError("only FULL slices may span stages")
            for part, value in zip(stages[i], ([qs, qe], [a - lo, b - lo], t)):
                part.append(value)
    return stages


def deterministic_mask_cases(total: int, seed: int = 0) -> dict[str, tuple[list, list, list]]:
    """The masks of the deterministic-mode tests, as python lists ``(q_ranges, k_ranges, attn_type_map)`` over
    ``total`` tokens: ``random_overlap`` (overlapping slices of all four types, rows that see nothing),
    ``packed_docs`` (causal documents of random lengths, packed) and ``sliding_window`` (a causal window of
    ``total // 8`` keys per row: a causal head and a bi-causal band)."""
    rng = random.Random(seed)
    cuts, s = [], 0
    while s < total:
        e = min(total, s + rng.randrange(max(1, total // 8), max(2, total // 2)))
        cuts.append([s, e])
        s = e
    w = max(1, total // 8)
    return {
        "random_overlap": random_overlapping_slices(rng, total, total, 9),
        "packed_docs": (cuts, [list(c) for c in cuts], [1] * len(cuts)),
        "sliding_window": ([[0, w], [w, total]], [[0, w], [1, total]], [1, 3]),
    }


def assert_bitwise_repeatable(
    func: Callable[..., tuple[torch.Tensor, ...]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_ranges: RangesLike,
    k_ranges: RangesLike,
    attn_type_map: TypeMapLike,
    *,
    runs: int = 4,
    seed: int = 0,
) -> None:
    """Run ``func(q, k, v, q_ranges, k_ranges, attn_type_map, deterministic=True)`` (a backend's
    ``flex_flash_attn_func``) forward and backward ``runs`` times on the same inputs and the same output
    gradient (and lse gradient); AssertionError unless out, lse, dq, dk and dv are bitwise equal every time."""
    gen = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(q.shape, generator=gen, device=q.device).to(q.dtype)
    dlse = torch.randn(q.shape[:2], generator=gen, device=q.device)
    results = []
    for _ in range(runs):
        xs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = func(*xs, q_ranges, k_ranges, attn_type_map, deterministic=True)[:2]
        grads = torch.autograd.grad((out, lse), xs, (do, torch.where(torch.isneginf(lse), 0.0, dlse)))
        results.append((out.detach(), lse.detach(), *grads))
    names = ("out", "lse", "dq", "dk", "dv")
    for i, other in enumerate(results[1:], 1):
        for name, a, b in zip(names, results[0], other):
            if not torch.equal(a, b):
                diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
                raise AssertionError(f"{name} of run {i} differs from run 0 (max |diff| {diff:.3e})")


# old names, for one release (docs/migration.md)
__getattr__ = deprecated_aliases(__name__, {"random_slices": "random_banded_slices"})
