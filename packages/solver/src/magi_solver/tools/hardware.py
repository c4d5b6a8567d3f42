"""Hardware profiles of `magi-attention-plan`: kernel TFLOP/s per mask family and link bandwidths.

A `HardwareProfile` turns into the `CostProfile` of the overlap cost model (the one the runtime's dynamic
overlap uses) for one mask family: the family's kernel throughput replaces the profile's `fwd_tflops` /
`bwd_tflops`; the per-call, merge and collective constants stay those of the shipped runtime profile
(`PROFILES["<gpu>/fa4"]`). Links: `nvlink_gbps` between the GPUs of one node, `internode_gbps` per GPU
between nodes of `gpus_per_node` GPUs.

Where the numbers come from:

* **h200**: measured on NVIDIA H200 with the FA4 kernel backend (magi-ffa-fa4; 32k tokens, heads 64:8,
  head_dim 128, bf16; `docs/benchmarks/ffa_fa4.md`), except `varlen_full` (the mean of full and varlen
  causal: not measured on one GPU). NVLink: all_to_all_single between 2 H200s (the shipped `h200/fa4`
  profile). Inter-node: 50 GB/s per GPU, a 400 Gb/s NIC per GPU (published; not measured here).
* **h100**: an estimate, the H200 table x 0.95 (the same GH100 chip and peak TFLOP/s; slower HBM), the
  shipped `h100/fa4` profile's NVLink figure, 50 GB/s inter-node.
* **b200**: an estimate, the H200 table x 2.27 (published dense BF16 peak, 2.25 against 0.989 PFLOP/s,
  assuming the same kernel efficiency), the shipped `b200/fa4` profile's NVLink figure, 100 GB/s
  inter-node (an 800 Gb/s NIC per GPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from ..cost_model import PROFILES, CostProfile

__all__ = ["HARDWARE", "HardwareProfile", "MaskFamily", "get_hardware"]


class MaskFamily(StrEnum):
    """Kernel-throughput classes of masks (the kernel runs at a different speed on each)."""

    FULL = "full"
    CAUSAL = "causal"
    VARLEN_FULL = "varlen_full"
    VARLEN_CAUSAL = "varlen_causal"
    SLIDING_WINDOW = "sliding_window"
    BLOCK_CAUSAL = "block_causal"
    OTHER = "other"
    """Anything else (random or hand-made slices): the random-slice measurement."""


# H200, FA4 backend, one GPU (docs/benchmarks/ffa_fa4.md): forward / backward TFLOP/s.
_H200_FA4: dict[MaskFamily, tuple[float, float]] = {
    MaskFamily.FULL: (662.0, 568.0),
    MaskFamily.CAUSAL: (653.0, 572.0),
    MaskFamily.VARLEN_FULL: (560.0, 477.0),  # not measured: mean of full and varlen causal
    MaskFamily.VARLEN_CAUSAL: (459.0, 386.0),
    MaskFamily.SLIDING_WINDOW: (473.0, 309.0),
    MaskFamily.BLOCK_CAUSAL: (556.0, 406.0),
    MaskFamily.OTHER: (484.0, 291.0),
}


def _scaled(
    table: dict[MaskFamily, tuple[float, float]], factor: float
) -> dict[MaskFamily, tuple[float, float]]:
    return {f: (round(a * factor, 1), round(b * factor, 1)) for f, (a, b) in table.items()}


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One GPU kind as `magi-attention-plan` sees it (SI-based units)."""

    name: str
    """Short name (`h200`, `h100`, `b200`, or `custom`)."""
    kernel_tflops: dict[MaskFamily, tuple[float, float]]
    """Per mask family, the attention kernel's forward and backward TFLOP/s (FLOP counted from the area)."""
    nvlink_gbps: float
    """Per-GPU collective bandwidth inside a node, GB/s (1e9 bytes/s)."""
    internode_gbps: float
    """Per-GPU bandwidth between nodes, GB/s."""
    gpus_per_node: int
    """GPUs joined by NVLink; ranks `r // gpus_per_node` share a node."""
    base: CostProfile
    """The shipped runtime profile whose per-call, merge and latency constants are used."""
    estimate: bool
    """True when the kernel numbers are estimates rather than measurements on that GPU."""
    source: str
    """Where the numbers come from, in one line."""

    def __post_init__(self) -> None:
        for field in ("nvlink_gbps", "internode_gbps"):
            v = getattr(self, field)
            if not v > 0:
                raise ValueError(f"HardwareProfile `{field}` must be > 0, got {v!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"HardwareProfile `gpus_per_node` must be >= 1, got {self.gpus_per_node!r}")
        for fam, (a, b) in self.kernel_tflops.items():
            if not (a > 0 and b > 0):
                raise ValueError(f"HardwareProfile kernel TFLOP/s of {fam} must be > 0, got {(a, b)}")

    def tflops(self, family: MaskFamily | str) -> tuple[float, float]:
        """Forward and backward kernel TFLOP/s of a mask family (`OTHER` for families not in the table)."""
        fam = MaskFamily(family)
        return self.kernel_tflops.get(fam, self.kernel_tflops[MaskFamily.OTHER])

    def cost_profile(self, family: MaskFamily | str, comm_gbps: float | None = None) -> CostProfile:
        """The overlap cost model's profile for one mask family (and a link bandwidth, default NVLink)."""
        fwd, bwd = self.tflops(family)
        return dataclasses.replace(
            self.base,
            name=f"{self.name}/{MaskFamily(family).value}",
            fwd_tflops=fwd,
            bwd_tflops=bwd,
            comm_gbps=self.nvlink_gbps if comm_gbps is None else comm_gbps,
            estimate=self.estimate,
        )

    def with_overrides(
        self,
        *,
        fwd_tflops: float | None = None,
        bwd_tflops: float | None = None,
        nvlink_gbps: float | None = None,
        internode_gbps: float | None = None,
        gpus_per_node: int | None = None,
        base: CostProfile | None = None,
    ) -> HardwareProfile:
        """A copy with explicit numbers; `fwd_tflops` / `bwd_tflops` replace every family's value."""
        table = dict(self.kernel_tflops)
        if fwd_tflops is not None or bwd_tflops is not None:
            table = {
                f: (fwd_tflops if fwd_tflops is not None else a, bwd_tflops if bwd_tflops is not None else b)
                for f, (a, b) in table.items()
            }
        changed = any(
            x is not None for x in (fwd_tflops, bwd_tflops, nvlink_gbps, internode_gbps, gpus_per_node, base)
        )
        return HardwareProfile(
            name=self.name if not changed else f"{self.name}+custom",
            kernel_tflops=table,
            nvlink_gbps=self.nvlink_gbps if nvlink_gbps is None else nvlink_gbps,
            internode_gbps=self.internode_gbps if internode_gbps is None else internode_gbps,
            gpus_per_node=self.gpus_per_node if gpus_per_node is None else gpus_per_node,
            base=self.base if base is None else base,
            estimate=self.estimate,
            source=self.source if not changed else f"{self.source}; with explicit numbers",
        )


_SOURCES = {
    "h200": "measured on H200 (FA4 backend kernels, NVLink collectives); inter-node 50 GB/s is published",
    "h100": "estimate: H200 measurements x 0.95 (same chip and peak, slower memory)",
    "b200": "estimate: H200 measurements x 2.27 (published dense BF16 peak ratio)",
}


def _shipped(
    name: str, kernel_tflops: dict[MaskFamily, tuple[float, float]], internode_gbps: float, estimate: bool
) -> HardwareProfile:
    """A shipped profile: 8 GPUs a node; NVLink and the other constants from the runtime's `<name>/fa4`."""
    base = PROFILES[f"{name}/fa4"]
    return HardwareProfile(
        name=name,
        kernel_tflops=kernel_tflops,
        nvlink_gbps=base.comm_gbps,
        internode_gbps=internode_gbps,
        gpus_per_node=8,
        base=base,
        estimate=estimate,
        source=_SOURCES[name],
    )


HARDWARE: dict[str, HardwareProfile] = {
    "h200": _shipped("h200", _H200_FA4, internode_gbps=50.0, estimate=False),
    "h100": _shipped("h100", _scaled(_H200_FA4, 0.95), internode_gbps=50.0, estimate=True),
    "b200": _shipped("b200", _scaled(_H200_FA4, 2.27), internode_gbps=100.0, estimate=True),
}
"""Shipped hardware profiles by name."""


def get_hardware(name: str) -> HardwareProfile:
    """The shipped profile `h100`, `h200` or `b200` (case-insensitive); `ValueError` lists the valid names."""
    key = str(name).strip().lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; valid: {sorted(HARDWARE)} (or give explicit numbers)")
    return HARDWARE[key]
