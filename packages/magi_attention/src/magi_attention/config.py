"""User-facing configuration of the distributed attention runtime.

`DistAttnConfig` groups the dispatch (how the sequence is cut and balanced across ranks) and the overlap
(how remote K/V is split into stages that overlap with compute) settings. Configs are frozen and hashable:
they are part of the runtime key, so two calls with equal configs share one cached plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class DispatchAlg(StrEnum):
    """How chunks are assigned to ranks (all give every rank the same number of chunks)."""

    MIN_HEAP = "min_heap"
    """Greedy on mask area, largest chunk first to the least-loaded rank (default)."""
    SEQUENTIAL = "sequential"
    """Contiguous blocks of chunks: plain sequence sharding."""
    ZIGZAG = "zigzag"
    """Head-tail pairing, the ring-attention balancing; for comparison."""
    AFFINITY = "affinity"
    """Min-heap that prefers ranks already holding the chunk's keys (less communication)."""


class OverlapMode(StrEnum):
    STATIC = "static"
    """Use `OverlapConfig.degree` stages."""
    DYNAMIC = "dynamic"
    """Choose the degree from a cost model (compute ~ area, communication ~ tokens); same on every rank."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchConfig:
    chunk_size: int | None = None
    """Tokens per dispatch chunk. None picks min(2048, ceil(total / (8 * cp_size))) so every rank gets at
    least about eight chunks to balance with. The sequence is padded to a multiple of chunk_size * cp_size."""
    alg: DispatchAlg | str = DispatchAlg.MIN_HEAP
    """Balancing algorithm, a `DispatchAlg` or its name."""

    def __post_init__(self) -> None:
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(
                f"DispatchConfig.chunk_size must be a positive int or None, got {self.chunk_size!r}"
            )
        try:
            object.__setattr__(self, "alg", DispatchAlg(self.alg))
        except ValueError:
            valid = ", ".join(a.value for a in DispatchAlg)
            raise ValueError(f"DispatchConfig.alg must be one of {valid}, got {self.alg!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapConfig:
    degree: int | None = 1
    """Remote stages: 0 = fetch all remote K/V at once and run one merged kernel call (no overlap, no
    partial-result merge); N >= 1 = N remote stages, each fetched while the previous one computes.
    None = dynamic (same as mode=DYNAMIC)."""
    mode: OverlapMode | str = OverlapMode.STATIC
    """STATIC uses `degree`; DYNAMIC picks the degree (1..max_degree) from the cost model."""
    min_chunk_size: int = 512
    """Remote K/V is cut into chunks of at least this many tokens before being grouped into stages."""
    max_num_chunks: int = 64
    """At most this many remote chunks (chunks grow beyond min_chunk_size to respect it)."""
    max_degree: int = 8
    """Largest degree the dynamic mode considers."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", OverlapMode(self.mode))
        except ValueError:
            valid = ", ".join(m.value for m in OverlapMode)
            raise ValueError(f"OverlapConfig.mode must be one of {valid}, got {self.mode!r}") from None
        if self.degree is None:
            object.__setattr__(self, "mode", OverlapMode.DYNAMIC)
        elif not isinstance(self.degree, int) or self.degree < 0:
            raise ValueError(f"OverlapConfig.degree must be an int >= 0 or None, got {self.degree!r}")
        for name in ("min_chunk_size", "max_num_chunks", "max_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"OverlapConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DistAttnConfig:
    dispatch_config: DispatchConfig = field(default_factory=DispatchConfig)
    overlap_config: OverlapConfig = field(default_factory=OverlapConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.dispatch_config, DispatchConfig):
            raise TypeError(
                f"dispatch_config must be a DispatchConfig, got {type(self.dispatch_config).__name__}"
            )
        if not isinstance(self.overlap_config, OverlapConfig):
            raise TypeError(
                f"overlap_config must be an OverlapConfig, got {type(self.overlap_config).__name__}"
            )
