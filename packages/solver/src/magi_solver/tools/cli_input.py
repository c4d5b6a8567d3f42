"""What a `magi-attention-plan` command line asks for, turned into the planner's inputs: the mask (a builder
and its documents, a mask family, or a JSON file of slices), the model's shapes (`Workload`) and the hardware
profile. Bad input raises `CliError`, which the command prints with exit status 2."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from typing import Any

import numpy as np

from ..builders import (
    FAMILY_MASKS,
    family_doc_lengths,
    lognormal_doc_lengths,
    make_block_causal_mask,
    make_family_mask,
    make_global_window_mask,
    make_prefix_lm_mask,
    make_sliding_window_mask,
    make_varlen_causal_mask,
    make_varlen_full_mask,
)
from ..cost_model import load_profile
from .hardware import HardwareProfile, MaskFamily, get_hardware
from .predict import Workload

__all__ = [
    "DTYPE_BYTES",
    "MASKS",
    "CliError",
    "build_mask",
    "hardware_from_args",
    "int_list",
    "lognormal_doc_lens",
    "workload_from_args",
]

MASKS = (
    "full",
    "causal",
    "varlen-full",
    "varlen-causal",
    "sliding-window",
    "global-window",
    "block-causal",
    "prefix-lm",
    *(f for f in FAMILY_MASKS if f not in ("full", "causal")),
)
# the mask families' kernel throughput classes (`make_family_mask`; full and causal are the CLI's own)
_FAMILY_KIND = {
    "docs4k_causal": MaskFamily.VARLEN_CAUSAL,
    "docs4k_full": MaskFamily.VARLEN_FULL,
    "short_docs_causal": MaskFamily.VARLEN_CAUSAL,
    "docs4k_window2048": MaskFamily.SLIDING_WINDOW,
    "video_clips": MaskFamily.BLOCK_CAUSAL,
}
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


class CliError(ValueError):
    """Bad command-line input: printed as `magi-attention-plan: error: ...` with exit status 2."""


def int_list(text: str, name: str) -> list[int]:
    """The integers of `text` (separated by commas or spaces); `CliError` naming the option `name` else."""
    try:
        vals = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise CliError(f"{name} must be integers separated by commas, got {text!r}") from None
    if not vals:
        raise CliError(f"{name} is empty")
    return vals


def _pair(text: str, name: str) -> tuple[int, int]:
    vals = int_list(text, name)
    if len(vals) != 2:
        raise CliError(f"{name} must be two integers LEFT,RIGHT, got {text!r}")
    return vals[0], vals[1]


def _read_doc_lens(path: str) -> list[int]:
    try:
        with open(path, encoding="utf-8") as f:
            return int_list(f.read(), f"--doc-lens-file {path}")
    except OSError as e:
        raise CliError(f"cannot read --doc-lens-file: {e}") from None


def lognormal_doc_lens(total: int, num_docs: int, seed: int) -> list[int]:
    """`num_docs` long-tailed (log-normal) lengths, each >= 1, summing to `total` (seeded)."""
    if not 1 <= num_docs <= total:
        raise CliError(f"--num-docs must lie in [1, --total = {total}], got {num_docs}")
    return lognormal_doc_lengths(total, sigma=1.0, seed=seed, num_docs=num_docs)


def _cu_seqlens(args: argparse.Namespace) -> tuple[list[int], str]:
    """Document boundaries from --cu-seqlens, --doc-lens(-file) or --total (+ --num-docs)."""
    given = [x for x in ("cu_seqlens", "doc_lens", "doc_lens_file") if getattr(args, x) is not None]
    if len(given) > 1:
        raise CliError("give at most one of --cu-seqlens, --doc-lens, --doc-lens-file")
    if args.cu_seqlens is not None:
        cu = int_list(args.cu_seqlens, "--cu-seqlens")
        if cu[0] != 0 or any(b < a for a, b in itertools.pairwise(cu)):
            raise CliError(f"--cu-seqlens must start at 0 and never decrease, got {args.cu_seqlens!r}")
        return cu, f"{len(cu) - 1} documents (--cu-seqlens)"
    if given:
        lens = (
            _read_doc_lens(args.doc_lens_file)
            if args.doc_lens_file
            else int_list(args.doc_lens, "--doc-lens")
        )
        if any(n <= 0 for n in lens):
            raise CliError("document lengths must be positive")
        return [0, *np.cumsum(lens).tolist()], f"{len(lens)} documents"
    total = args.total
    varlen = args.mask.startswith("varlen-")
    num = args.num_docs if args.num_docs is not None else (300 if varlen else 1)
    if num == 1:
        return [0, total], "1 document"
    lens = lognormal_doc_lens(total, num, args.seed)
    return [0, *np.cumsum(lens).tolist()], f"{num} log-normal documents (seed {args.seed})"


def _load_slices(path: str) -> tuple[list, list, Any, int]:
    """A JSON mask: {"q_ranges", "k_ranges", "types"} or {"slices": [[qs, qe, ks, ke, type], ...]},
    with an optional "total_seqlen" (default: the largest range end)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"cannot read --slices {path}: {e}") from None
    if not isinstance(data, dict):
        raise CliError(f"--slices {path}: expected a JSON object")
    if "slices" in data:
        rows = data["slices"]
        q = [[r[0], r[1]] for r in rows]
        k = [[r[2], r[3]] for r in rows]
        t = [r[4] if len(r) > 4 else "full" for r in rows]
    elif "q_ranges" in data and "k_ranges" in data:
        q, k = data["q_ranges"], data["k_ranges"]
        t = data.get("types", "full")
    else:
        raise CliError(f"--slices {path}: needs `slices` or `q_ranges` + `k_ranges` (and `types`)")
    if not q:
        raise CliError(f"--slices {path}: no slices")
    total = int(data.get("total_seqlen", max(max(e for _, e in q), max(e for _, e in k))))
    return q, k, t, total


def build_mask(args: argparse.Namespace) -> tuple[Any, Any, Any, int, MaskFamily, str]:
    """`(q_ranges, k_ranges, types, total, family, description)` of the mask the arguments describe."""
    if args.slices:
        q, k, t, total = _load_slices(args.slices)
        fam = MaskFamily(args.family) if args.family else MaskFamily.OTHER
        return q, k, t, total, fam, f"{len(q)} slices from {os.path.basename(args.slices)}"
    name = args.mask
    if name in _FAMILY_KIND:
        return _family_mask(args)
    cu, docs = _cu_seqlens(args)
    total = cu[-1]
    many = len(cu) > 2
    if name in ("full", "varlen-full"):
        spec = make_varlen_full_mask(cu)
        fam = MaskFamily.VARLEN_FULL if many else MaskFamily.FULL
    elif name in ("causal", "varlen-causal"):
        spec = make_varlen_causal_mask(cu)
        fam = MaskFamily.VARLEN_CAUSAL if many else MaskFamily.CAUSAL
    elif name == "sliding-window":
        spec = make_sliding_window_mask(cu, _pair(args.window, "--window"))
        fam = MaskFamily.SLIDING_WINDOW
    elif name == "global-window":
        spec = make_global_window_mask(cu, _pair(args.window, "--window"), args.num_global)
        fam = MaskFamily.SLIDING_WINDOW
    elif name == "block-causal":
        spec = make_block_causal_mask(cu, args.block_size)
        fam = MaskFamily.BLOCK_CAUSAL
    elif name == "prefix-lm":
        spec = make_prefix_lm_mask(cu, args.prefix_len)
        fam = MaskFamily.VARLEN_CAUSAL if many else MaskFamily.CAUSAL
    else:  # argparse restricts the choices
        raise CliError(f"--mask must be one of {MASKS}, got {name!r}")
    if args.family:
        fam = MaskFamily(args.family)
    return spec.q_ranges, spec.k_ranges, spec.types, total, fam, f"{name}, {docs}"


def _family_mask(args: argparse.Namespace) -> tuple[Any, Any, Any, int, MaskFamily, str]:
    """A mask family of `make_family_mask` over --total tokens (its own documents, drawn with --seed)."""
    given = [
        x for x in ("cu_seqlens", "doc_lens", "doc_lens_file", "num_docs") if getattr(args, x) is not None
    ]
    if given:
        opts = ", ".join("--" + x.replace("_", "-") for x in given)
        raise CliError(f"--mask {args.mask} draws its own documents from --total and --seed; drop {opts}")
    if args.total < 1:
        raise CliError(f"--total must be at least 1, got {args.total}")
    spec = make_family_mask(args.mask, args.total, args.seed)
    fam = MaskFamily(args.family) if args.family else _FAMILY_KIND[args.mask]
    n = len(family_doc_lengths(args.mask, args.total, args.seed))
    unit = "clips" if args.mask == "video_clips" else "documents"
    return (
        spec.q_ranges,
        spec.k_ranges,
        spec.types,
        args.total,
        fam,
        f"{args.mask}, {n} {unit} (seed {args.seed})",
    )


def hardware_from_args(args: argparse.Namespace) -> HardwareProfile:
    """The --hardware profile (on --cost-profile's constants when given) with the explicit numbers on top."""
    hw = get_hardware(args.hardware)
    base = load_profile(args.cost_profile) if args.cost_profile else None
    return hw.with_overrides(
        fwd_tflops=args.fwd_tflops,
        bwd_tflops=args.bwd_tflops,
        nvlink_gbps=args.nvlink_gbps,
        internode_gbps=args.internode_gbps,
        gpus_per_node=args.gpus_per_node,
        base=base,
    )


def workload_from_args(args: argparse.Namespace) -> Workload:
    """Heads, head_dim, dtype, chunk size and overlap degree of the command line as a `Workload`."""
    heads = int_list(args.heads.replace(":", ","), "--heads")
    if len(heads) != 2:
        raise CliError(f"--heads must be Q:KV (e.g. 64:8), got {args.heads!r}")
    if args.degree == "dynamic":
        degree = None
    else:
        try:
            degree = int(args.degree)
        except ValueError:
            raise CliError(f"--degree must be `dynamic` or an int >= 0, got {args.degree!r}") from None
    return Workload(
        num_heads_q=heads[0],
        num_heads_kv=heads[1],
        head_dim=args.head_dim,
        bytes_per_elem=DTYPE_BYTES[args.dtype],
        chunk_size=args.chunk_size,
        max_degree=args.max_degree,
        overlap_degree=degree,
        uneven_shard=args.uneven_shard,
    )
