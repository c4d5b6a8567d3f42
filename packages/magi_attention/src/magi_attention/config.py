"""User-facing configuration of the distributed attention runtime. Part of the product (`api`, `dispatch`,
`dist_attn`, `config`); `import magi_attention` hands on its `__all__`.

`DistAttnConfig` groups the dispatch (how the sequence is cut and balanced across ranks) and the overlap
(how remote K/V is split into stages that overlap with compute) settings. Configs are frozen and hashable:
they are part of the runtime key, so two calls with equal configs share one cached plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# The kernel's enum, not a copy: `magi_attention.config.KernelBackend is magi_ffa.KernelBackend` (auto, fa4,
# cudnn, triton, torch), defined in the lowest package that runs a kernel.
from magi_ffa import KernelBackend

# The planner's enums, not copies: `magi_attention.config.DispatchAlg is magi_solver.DispatchAlg` (same values:
# min_heap, sequential, zigzag, affinity; static, dynamic), so a config's choice reaches the solver unchanged.
from magi_solver import DispatchAlg, OverlapMode

from .env import deterministic_mode

__all__ = [
    "DispatchAlg",
    "DispatchConfig",
    "DistAttnConfig",
    "GrpCollConfig",
    "KernelBackend",
    "OverlapConfig",
    "OverlapMode",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchConfig:
    chunk_size: int | None = None
    """Tokens per dispatch chunk. None lets the planner choose per mask and cp size
    (`magi_solver.dispatch_choice`: the largest size whose balance bound, fragment cost and remote K/V are
    best, at most min(2048, ceil(total / (8 * cp_size))); `magi_attention.get_dispatch_choice(key)` says what
    it chose and why). The sequence is padded to a multiple of chunk_size * cp_size (unless `uneven_shard`)."""
    alg: DispatchAlg | str | None = None
    """Placement algorithm, a `DispatchAlg` or its name, used as given; None (the default) chooses per mask
    and cp size between the documents placement (`"documents"`: whole documents, clips or window runs on as
    few ranks as the balance of predicted kernel time allows) and the chunk dispatch, whichever the kernel
    law predicts faster, communication included (`get_dispatch_choice(key)` says which and why). With an
    explicit `chunk_size` and no algorithm: the chunk dispatch with `"min_heap"`. `"min_heap"` with no chunk
    size is the chunk dispatch of earlier releases."""
    uneven_shard: bool = False
    """No padding: the sequence is cut into ceil(total / chunk_size) chunks (the last one possibly shorter),
    ranks' chunk counts differ by at most one, so ranks hold slightly different token counts (never more
    than a padded shard; `key.shard_seqlens` lists them) and balance by mask area still holds. Needs at
    least one chunk per rank. A key's `pad_size` must then be None or 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.uneven_shard, bool):
            raise TypeError(
                f"DispatchConfig.uneven_shard must be a bool, got {type(self.uneven_shard).__name__}"
            )
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size <= 0):
            raise ValueError(
                f"DispatchConfig.chunk_size must be a positive int or None, got {self.chunk_size!r}"
            )
        if self.alg is None:
            return
        try:
            object.__setattr__(self, "alg", DispatchAlg(self.alg))
        except ValueError:
            valid = ", ".join(a.value for a in DispatchAlg)
            raise ValueError(f"DispatchConfig.alg must be one of {valid}, got {self.alg!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapConfig:
    degree: int | None = None
    """Remote stages: 0 = fetch all remote K/V at once and run one merged kernel call (no overlap, no
    partial-result merge); N >= 1 = N remote stages, each fetched while the previous one computes.
    None (the default) = dynamic: the cost model picks 0..max_degree."""
    mode: OverlapMode | str | None = None
    """None follows `degree` (None -> DYNAMIC, an int -> STATIC). DYNAMIC ignores `degree`."""
    min_chunk_size: int = 512
    """Remote K/V is cut into chunks of at least this many tokens before being grouped into stages."""
    max_num_chunks: int = 64
    """At most this many remote chunks (chunks grow beyond min_chunk_size to respect it)."""
    max_degree: int = 4
    """Largest degree the dynamic mode considers."""
    cost_profile: str | None = None
    """Cost-model constants for the dynamic mode: a profile name of `magi_solver.PROFILES` (e.g.
    "h200/fa4") or the path of a JSON file (`magi_solver.CostProfile.to_dict()` format). None = the shipped
    profile of the GPU kind and kernel backend (or `MAGI_ATTENTION_COST_PROFILE`)."""

    def __post_init__(self) -> None:
        if self.mode is None:
            object.__setattr__(
                self, "mode", OverlapMode.DYNAMIC if self.degree is None else OverlapMode.STATIC
            )
        try:
            object.__setattr__(self, "mode", OverlapMode(self.mode))
        except ValueError:
            valid = ", ".join(m.value for m in OverlapMode)
            raise ValueError(f"OverlapConfig.mode must be one of {valid}, got {self.mode!r}") from None
        if self.degree is None:
            if self.mode == OverlapMode.STATIC:
                raise ValueError("OverlapConfig: mode='static' needs an int degree (or leave mode unset)")
        elif isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 0:
            raise ValueError(f"OverlapConfig.degree must be an int >= 0 or None, got {self.degree!r}")
        for name in ("min_chunk_size", "max_num_chunks", "max_degree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"OverlapConfig.{name} must be a positive int, got {value!r}")
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise TypeError(
                f"OverlapConfig.cost_profile must be a str or None, got {type(self.cost_profile).__name__}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpCollConfig:
    """How the runtime's GroupCast / GroupReduce (remote K/V out, partial dK/dV back) are carried out. The
    table of how this combines with the environment variables and the device mesh is in the documentation
    of magi-group-collective ("Choosing the implementation")."""

    native: bool | None = None
    """True: the native implementation (symmetric memory inside one node: CUDA tensors, an NCCL cp group on
    one node, `magi-group-collective[native]`; elsewhere the first call raises NativeUnavailableError on
    every rank). False: all-to-all-v (hierarchical on a 2-D mesh unless MAGI_ATTENTION_HIERARCHICAL_COMM=0).
    None (default): the environment variable MAGI_ATTENTION_NATIVE_GRPCOLL decides (default false)."""

    def __post_init__(self) -> None:
        if self.native is not None and not isinstance(self.native, bool):
            raise TypeError(f"GrpCollConfig.native must be a bool or None, got {type(self.native).__name__}")


def _backend_name(value: object) -> KernelBackend | str:
    """A `KernelBackend` member where `value` names one, else the name itself (a registered backend's,
    checked when a key is built)."""
    if not isinstance(value, str) or not value.strip():
        raise TypeError(
            f"DistAttnConfig.kernel_backend must be a KernelBackend or a backend's name, got {value!r}"
        )
    try:
        return KernelBackend(value.strip().lower())
    except ValueError:
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class DistAttnConfig:
    dispatch_config: DispatchConfig = field(default_factory=DispatchConfig)
    overlap_config: OverlapConfig = field(default_factory=OverlapConfig)
    kernel_backend: KernelBackend | str = KernelBackend.AUTO
    """The attention kernel of every call: `auto`, a `KernelBackend` (or its value), or the name of any backend
    registered with `magi_ffa.contract.register_backend`. The name is checked when a key is built (a
    ValueError on every rank, before any data moves, when some rank cannot run it). `auto` can be overridden
    with the environment variable MAGI_ATTENTION_KERNEL_BACKEND (also accepting `ffa` = triton and `sdpa` =
    torch)."""
    high_precision_grad_reduce: bool = True
    """Sum the partial dK/dV that other ranks computed for this rank's keys in fp32 (True) or in the input
    dtype (False: one more rounding per contributing rank). At overlap degree 0 they travel in the input
    dtype either way (the owner widens them exactly before adding), so True costs no extra communication;
    at degree >= 1 every stage sends and sums its fp32 accumulator whatever this says."""
    grpcoll_config: GrpCollConfig = field(default_factory=GrpCollConfig)
    """Which group-collective implementation the runtime uses (native or all-to-all-v)."""
    deterministic: bool | None = None
    """Bitwise reproducible `calc_attn`: the same inputs, cp size, plan, backend and GPU kind give the same
    bits for out, lse and every gradient. Every kernel call asks its backend for a deterministic backward,
    GroupReduce sums in a fixed order, `auto` picks only among backends deterministic for every rank's
    problem, and an explicit backend that cannot be raises on every rank before any data moves. None (the
    default) is resolved when the config is built: True when MAGI_ATTENTION_DETERMINISTIC_MODE is true or
    `torch.use_deterministic_algorithms(True)` is in effect, else False. Part of the runtime key and agreed
    across ranks."""

    def __post_init__(self) -> None:
        if self.deterministic is None:
            # resolved here, once, so the key (and every rank's agreement on it) holds the value in use
            object.__setattr__(
                self, "deterministic", deterministic_mode() or torch.are_deterministic_algorithms_enabled()
            )
        elif not isinstance(self.deterministic, bool):
            raise TypeError(
                f"DistAttnConfig.deterministic must be a bool or None, got {type(self.deterministic).__name__}"
            )
        if not isinstance(self.high_precision_grad_reduce, bool):
            raise TypeError(
                f"high_precision_grad_reduce must be a bool, got {type(self.high_precision_grad_reduce).__name__}"
            )
        object.__setattr__(self, "kernel_backend", _backend_name(self.kernel_backend))
        if not isinstance(self.dispatch_config, DispatchConfig):
            raise TypeError(
                f"dispatch_config must be a DispatchConfig, got {type(self.dispatch_config).__name__}"
            )
        if not isinstance(self.overlap_config, OverlapConfig):
            raise TypeError(
                f"overlap_config must be an OverlapConfig, got {type(self.overlap_config).__name__}"
            )
        if not isinstance(self.grpcoll_config, GrpCollConfig):
            raise TypeError(
                f"grpcoll_config must be a GrpCollConfig, got {type(self.grpcoll_config).__name__}"
            )
