"""Overlap cost model: predicted seconds of a rank's forward and backward schedule for each overlap degree.

The planner uses it to pick ONE overlap degree for the forward and the backward together, the same on every
rank (the one whose slowest rank is fastest). Everything is in SI units: seconds, bytes, FLOP.

Notation for one rank: `A_h` host area (local q x local k pairs), `A_i` / `T_i` the area / remote K/V tokens
of remote stage i, `A_r = sum A_i`, `T_r = sum T_i`, `L` local tokens (q rows, and local K/V tokens: this
is self-attention), `Hq`, `Hkv`, `D` heads and head dim. Building blocks (`p` = the `CostProfile`):

* compute: with a kernel law (`OverlapCostModel.law`, the one law of `kernel_law`) a call's time is the
  law's on its area, its key columns (the call's keys: `L` for the host call, `T_i` for stage i, `L + T_r`
  for the merged call) and its `L` rows; without one, `calc(A) = 4 * A * Hq * D / (p.fwd_tflops * 1e12)`,
  backward `2.5 * 4 * A * Hq * D / (p.bwd_tflops * 1e12)`; a kernel call adds `p.kernel_fixed_s` (launch, and the tail of a grid that no
  longer fills the GPU). A call with no area is skipped by the runtime, so it costs nothing.
* fetch of `T` tokens of K and V: `p.comm_latency_s + T * 2 * Hkv * D * bytes_per_elem / (p.comm_gbps *
  1e9)`; the backward's dK/dV reduce is the same with `grad_reduce_bytes_per_elem` (each stage's fp32
  accumulator) at degree d >= 1, and with `bytes_per_elem` at degree 0 (the merged kernel's own dK/dV, in
  the input dtype; the owner widens them when it sums). Every stage the runtime runs calls its
  collectives, so each one pays the latency even when this rank moves nothing.
* per remote stage (`stage_overhead`): one more kernel call plus folding its partial result into the
  accumulator, `p.kernel_fixed_s + bytes * L * Hq * D / (p.mem_gbps * 1e9)` with `bytes` =
  `p.fwd_merge_bytes_per_elem` (forward: partial output into out/lse) or `p.bwd_accum_bytes_per_elem`
  (backward: dQ into the fp32 accumulator).
* degree 0 receives the remote K/V behind the local rows of one buffer and copies only the local K/V into
  it (`copy`): a read and a write of every local byte, `2 * L * 2 * Hkv * D * bytes_per_elem / (p.mem_gbps *
  1e9)`.

Schedules (`schedule_time`):

* degree 0, forward: `fetch(T_r) + copy + kernel(A_h + A_r)`, all in sequence (the fetch blocks);
  backward: `fetch(T_r) + copy + kernel_bwd(A_h + A_r) + reduce_0(T_r)`, the reduce blocking at the end
  (`reduce_0`: the reduce at `bytes_per_elem`).
* degree d >= 1, two streams replayed in the runtime's issue order. A collective issued from the compute
  stream first waits for the compute work issued before it, so stage i+1's fetch starts when stage i's
  compute starts (`s_i`). With `H` the host kernel, `K_i = kernel(A_i) + stage_overhead(L)`, `F_i`, `R_i`
  the fetch and reduce of stage i, and the comm stream serial:
  `s_0 = max(H, F_0)`, `s_{i+1} = max(s_i + K_i, s_i + F_{i+1})`; forward time `s_{d-1} + K_{d-1}`, which
  is `sum_i max(F_i, K_{i-1}) + K_{d-1}` with `K_{-1} = H`.
  Backward: the same, except each stage's reduce `R_i` is queued on the comm stream (after the next
  fetch) once stage i's compute ends, stage i+1's compute also waits for `R_{i-1}`, and the last reduce
  is waited for at the end.
* `total_time` = forward + backward.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .kernel_law import KernelLaw

__all__ = [
    "PROFILES",
    "CostProfile",
    "OverlapCostModel",
    "get_profile",
    "gpu_kind",
    "load_profile",
]

# FLOPs of the backward kernel relative to the forward for the same area (dQ, dK, dV and the recompute).
BWD_FLOP_RATIO = 2.5


@dataclass(frozen=True, slots=True)
class CostProfile:
    """Hardware and kernel-backend constants of the overlap cost model (SI units).

    Rates must be positive; fixed costs and bytes may be zero (an idealised device). All finite.
    """

    name: str
    """Profile key, `"<gpu kind>/<backend>"` for the shipped ones (e.g. `"h200/fa4"`)."""
    fwd_tflops: float
    """Forward attention kernel throughput in TFLOP/s, counting `4 * area * heads_q * head_dim` FLOP."""
    bwd_tflops: float
    """Backward attention kernel throughput in TFLOP/s, counting 2.5x the forward FLOP of the same area."""
    kernel_fixed_s: float
    """Seconds added by every kernel call: launch plus the under-used tail of its grid."""
    mem_gbps: float
    """Device memory bandwidth in GB/s (1e9 bytes/s) reached by merges, accumulations and copies."""
    fwd_merge_bytes_per_elem: float
    """Bytes moved per (local q token x head_q x head_dim) element when one remote stage's forward
    partial output is merged into the accumulator (fp32 read + bf16 read + fp32 write: 10)."""
    bwd_accum_bytes_per_elem: float
    """Bytes moved per (local q token x head_q x head_dim) element when one remote stage's dQ is added into
    the fp32 accumulator."""
    comm_gbps: float
    """Per-rank bandwidth of the K/V collectives in GB/s (1e9 bytes/s)."""
    comm_latency_s: float
    """Seconds of fixed cost per collective call."""
    estimate: bool = False
    """True when the numbers are estimated rather than measured on that hardware."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"CostProfile `name` must be a non-empty string, got {self.name!r}")
        if not isinstance(self.estimate, bool):
            raise ValueError(f"CostProfile `estimate` must be a bool, got {self.estimate!r}")
        for f in fields(self):
            if f.name in ("name", "estimate"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"CostProfile `{f.name}` must be a finite number, got {v!r}")
            # rates divide; fixed costs and byte counts may be zero
            if f.name in _RATES and v <= 0:
                raise ValueError(f"CostProfile `{f.name}` must be > 0, got {v!r}")
            if v < 0:
                raise ValueError(f"CostProfile `{f.name}` must be >= 0, got {v!r}")
            object.__setattr__(self, f.name, float(v))

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of every field."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostProfile:
        """Inverse of `to_dict`. Unknown or missing keys raise `ValueError` (`estimate` defaults to False)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a CostProfile needs a mapping, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"unknown CostProfile keys {unknown}; valid keys: {names}")
        missing = [n for n in names if n not in data and n != "estimate"]
        if missing:
            raise ValueError(f"CostProfile keys missing: {missing}")
        return cls(**dict(data))


_RATES = frozenset({"fwd_tflops", "bwd_tflops", "mem_gbps", "comm_gbps"})

# THE profile table. Columns: key, fwd TFLOP/s, bwd TFLOP/s, kernel fixed s, memory GB/s,
# fwd merge bytes/elem, bwd dQ-accumulate bytes/elem, comm GB/s, comm latency s, estimate.
# h200: calibrated on 2 H200s (NVLink, NCCL) by benchmarks/calibrate_overlap.py (64:8 heads, d 128, bf16):
# kernel lines fitted over FULL masks of 8k queries x 1k-16k keys, copy bandwidth, all_to_all_single of
# 0.5k-32k tokens. The per-stage bytes (40 / 80) are effective values fitted to the end-to-end cp = 2 degree
# sweep of benchmarks/cp_bench.py (16k 64:8 and 32k 32:32): besides the merge and dQ accumulation measured
# alone (7.4 / 19.8 bytes per element on FA4), a stage pays its accumulator buffers and a collective that
# competes with the kernel for SMs. The Triton rows assume the same per-stage cost.
# h100 = h200 kernels x 0.95 (same SMs, slower HBM); b200, generic and cpu are guesses (estimate=True).
_PROFILE_TABLE: tuple[tuple[str, float, float, float, float, float, float, float, float, bool], ...] = (
    ("h200/fa4", 761.0, 591.0, 166e-6, 4246.0, 40.0, 80.0, 304.0, 37e-6, False),
    ("h200/triton", 478.0, 221.0, 1.2e-3, 4246.0, 40.0, 80.0, 304.0, 37e-6, False),
    ("h100/fa4", 722.95, 561.45, 166e-6, 3350.0, 40.0, 80.0, 250.0, 37e-6, True),
    ("h100/triton", 454.1, 209.95, 1.2e-3, 3350.0, 40.0, 80.0, 250.0, 37e-6, True),
    ("b200/fa4", 1200.0, 900.0, 100e-6, 6000.0, 40.0, 80.0, 400.0, 30e-6, True),
    ("generic/triton", 200.0, 100.0, 20e-6, 1500.0, 10.0, 10.0, 100.0, 50e-6, True),
    ("cpu/torch", 0.05, 0.05, 1e-4, 20.0, 10.0, 10.0, 2.0, 1e-4, True),
)

PROFILES: dict[str, CostProfile] = {row[0]: CostProfile(*row) for row in _PROFILE_TABLE}
"""Shipped profiles by `"<gpu kind>/<backend>"`."""

DEFAULT_PROFILE = "generic/triton"

# Device-name words that identify a GPU kind ("NVIDIA H100 80GB HBM3" -> "h100").
_KNOWN_KINDS = frozenset(
    {"gb200", "gh200", "b300", "b200", "b100", "h200", "h100", "h800", "h20", "a100", "a800", "l40s", "l40"}
)
_VENDOR_WORDS = frozenset({"nvidia", "tesla", "geforce", "amd", "intel"})


def gpu_kind(device_name: str) -> str:
    """Short lower-case kind of a device name: `"NVIDIA H200"` -> `"h200"`, `"cpu"` -> `"cpu"`.

    A name with a known kind word anywhere (h200, h100, b200, a100, ...) gives that word; any other name
    gives its words joined by "-" without vendor words ("AMD Instinct MI300X" -> "instinct-mi300x"); an
    empty name gives "generic". A kind key passes through unchanged.
    """
    if not isinstance(device_name, str):
        raise TypeError(f"`device_name` must be a str, got {type(device_name).__name__}")
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    for w in words:
        if w in _KNOWN_KINDS or w in ("cpu", "generic"):
            return w
    rest = [w for w in words if w not in _VENDOR_WORDS]
    return "-".join(rest) or "generic"


def get_profile(gpu: str, backend: str) -> CostProfile:
    """The shipped profile of a GPU (a kind or a device name, see `gpu_kind`) and kernel backend.

    Looks up `"<kind>/<backend>"`, then `"generic/<backend>"`, then `"generic/triton"`; never raises for an
    unknown GPU or backend name (check `.name` and `.estimate` to see what was picked).
    """
    kind = gpu_kind(gpu)
    be = str(backend).strip().lower()
    for key in (f"{kind}/{be}", f"generic/{be}"):
        if key in PROFILES:
            return PROFILES[key]
    return PROFILES[DEFAULT_PROFILE]


def load_profile(path: str | os.PathLike[str]) -> CostProfile:
    """A profile from a JSON file: either every field (as `CostProfile.to_dict` writes), or
    `{"base": "<profile key>", <fields to override>...}` starting from a shipped profile."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{os.fspath(path)}: a cost profile must be a JSON object")
    base = data.pop("base", None)
    if base is None:
        return CostProfile.from_dict(data)
    if base not in PROFILES:
        raise ValueError(f"{os.fspath(path)}: unknown base profile {base!r}; valid: {sorted(PROFILES)}")
    return CostProfile.from_dict(PROFILES[base].to_dict() | data)


@dataclass(frozen=True, slots=True)
class OverlapCostModel:
    """Predicted seconds of a rank's overlap schedule (formulas in the module docstring).

    Attributes:
        profile: hardware and kernel constants.
        num_heads_q, num_heads_kv, head_dim: the attention shape.
        bytes_per_elem: bytes of one K/V element on the wire and in the merged buffer (2 for bf16); also
            of one dK/dV element in the backward reduce at degree 0.
        grad_reduce_bytes_per_elem: bytes of one dK/dV element in each stage's backward reduce at degree
            d >= 1 (4: the fp32 accumulator).
    """

    profile: CostProfile
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    bytes_per_elem: int = 2
    grad_reduce_bytes_per_elem: int = 4
    law: KernelLaw | None = None
    """The kernel law (`kernel_law`, fitted at 64:8 heads, d 128; scaled here to this model's shape): when
    set, a kernel call's time comes from its area, its key columns and its rows instead of the profile's
    TFLOP/s (`p.kernel_fixed_s` still counts per call); the profile keeps the links and memory terms."""

    def __post_init__(self) -> None:
        if not isinstance(self.profile, CostProfile):
            raise TypeError(f"`profile` must be a CostProfile, got {type(self.profile).__name__}")
        if self.law is not None:
            if not isinstance(self.law, KernelLaw):
                raise TypeError(f"`law` must be a KernelLaw or None, got {type(self.law).__name__}")
            object.__setattr__(self, "law", self.law.scaled(self.num_heads_q, self.head_dim))
        for f in fields(self)[1:-1]:
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"OverlapCostModel `{f.name}` must be an int >= 1, got {v!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V."""
        return 2 * self.num_heads_kv * self.head_dim * self.bytes_per_elem

    @property
    def grad_kv_bytes_per_token(self) -> int:
        """Bytes of one token's dK and dV in a stage's backward reduce at degree d >= 1 (the stage's
        accumulator, `grad_reduce_bytes_per_elem`)."""
        return 2 * self.num_heads_kv * self.head_dim * self.grad_reduce_bytes_per_elem

    @property
    def merged_grad_kv_bytes_per_token(self) -> int:
        """Bytes of one token's dK and dV in the backward reduce at degree 0: the merged kernel call writes
        dK / dV in the input dtype and the runtime sends them as they are (the owner widens them exactly
        into its fp32 sum), so they cost what K and V cost, `kv_bytes_per_token`."""
        return self.kv_bytes_per_token

    def calc(
        self, area: float, backward: bool = False, *, keys: float | None = None, rows: float | None = None
    ) -> float:
        """Seconds of kernel throughput for `area` (q, k) pairs, without the per-call fixed cost. With a
        `law` and the call's `keys` (its key tokens) and `rows` (its query tokens): the law's time."""
        if self.law is not None and keys is not None and rows is not None:
            if area <= 0:
                return 0.0
            ms = self.law.bwd_ms(area, keys, rows) if backward else self.law.fwd_ms(area, keys, rows)
            return float(ms) * 1e-3
        flops = 4.0 * area * self.num_heads_q * self.head_dim
        if backward:
            return BWD_FLOP_RATIO * flops / (self.profile.bwd_tflops * 1e12)
        return flops / (self.profile.fwd_tflops * 1e12)

    def kernel(
        self, area: float, backward: bool = False, *, keys: float | None = None, rows: float | None = None
    ) -> float:
        """Seconds of one kernel call over `area` pairs (0 for no area: the runtime skips the call); `keys`,
        `rows`: see `calc`."""
        return (
            self.profile.kernel_fixed_s + self.calc(area, backward, keys=keys, rows=rows) if area > 0 else 0.0
        )

    def fetch(self, tokens: float) -> float:
        """Seconds of one K/V fetch collective moving `tokens` tokens to this rank."""
        return self.profile.comm_latency_s + tokens * self.kv_bytes_per_token / (self.profile.comm_gbps * 1e9)

    def reduce(self, tokens: float, *, merged: bool = False) -> float:
        """Seconds of one dK/dV reduce collective sending `tokens` tokens' gradients back: a stage's at
        degree d >= 1, or with `merged` the one reduce of degree 0 (`merged_grad_kv_bytes_per_token`)."""
        per_token = self.merged_grad_kv_bytes_per_token if merged else self.grad_kv_bytes_per_token
        return self.profile.comm_latency_s + tokens * per_token / (self.profile.comm_gbps * 1e9)

    def comm(self, tokens: float, backward: bool = False, *, merged: bool = False) -> float:
        """Seconds of communication for `tokens` remote tokens: the fetch, plus the reduce in backward
        (`merged`: the degree-0 reduce)."""
        return self.fetch(tokens) + (self.reduce(tokens, merged=merged) if backward else 0.0)

    def stage_overhead(self, local_q_tokens: float, backward: bool = False) -> float:
        """Seconds one remote stage adds besides its kernel throughput: a kernel call's fixed cost and the
        merge of its partial output (forward) or the dQ accumulation (backward) over the local q rows."""
        p = self.profile
        per_elem = p.bwd_accum_bytes_per_elem if backward else p.fwd_merge_bytes_per_elem
        nbytes = per_elem * local_q_tokens * self.num_heads_q * self.head_dim
        return p.kernel_fixed_s + nbytes / (p.mem_gbps * 1e9)

    def copy(self, tokens: float) -> float:
        """Seconds to copy `tokens` tokens of K/V into one buffer (read and write every byte)."""
        return 2.0 * tokens * self.kv_bytes_per_token / (self.profile.mem_gbps * 1e9)

    def schedule_time(
        self,
        degree: int,
        host_area: float,
        stage_areas: Sequence[float],
        stage_tokens: Sequence[float],
        local_q_tokens: float,
        backward: bool = False,
    ) -> float:
        """Predicted seconds of one rank's forward (or backward) pass.

        Args:
            degree: 0 = one merged call after one blocking fetch; d >= 1 = d pipelined remote stages.
            host_area: mask area of local q x local k.
            stage_areas, stage_tokens: per remote stage, its mask area and remote K/V tokens (`degree`
                entries; one entry holding all remote work for degree 0).
            local_q_tokens: the rank's local tokens (q rows; also its local K/V tokens).
            backward: the backward pass instead of the forward.
        """
        n = max(degree, 1)
        if degree < 0 or len(stage_areas) != n or len(stage_tokens) != n:
            raise ValueError(
                f"degree {degree} needs {n} stage areas and tokens, got {len(stage_areas)} and "
                f"{len(stage_tokens)}"
            )
        if degree == 0:
            remote = stage_tokens[0]
            t = self.fetch(remote) + self.copy(local_q_tokens)
            L = local_q_tokens
            t += self.kernel(host_area + stage_areas[0], backward, keys=L + remote, rows=L)
            return t + (self.reduce(remote, merged=True) if backward else 0.0)
        L = local_q_tokens
        host = self.kernel(host_area, backward, keys=L, rows=L)
        over = self.stage_overhead(local_q_tokens, backward)
        kernels = [
            self.calc(a, backward, keys=t, rows=L) + over if a > 0 else 0.0
            for a, t in zip(stage_areas, stage_tokens)
        ]
        fetches = [self.fetch(t) for t in stage_tokens]
        reduces = [self.reduce(t) for t in stage_tokens] if backward else None
        return _pipeline(host, kernels, fetches, reduces)

    def total_time(
        self,
        degree: int,
        host_area: float,
        stage_areas: Sequence[float],
        stage_tokens: Sequence[float],
        local_q_tokens: float,
    ) -> float:
        """Predicted seconds of forward + backward (the quantity the planner minimises)."""
        args = (degree, host_area, stage_areas, stage_tokens, local_q_tokens)
        return self.schedule_time(*args, backward=False) + self.schedule_time(*args, backward=True)


def _pipeline(
    host: float, kernels: Sequence[float], fetches: Sequence[float], reduces: Sequence[float] | None
) -> float:
    """End time of a compute stream and a serial comm stream, replaying the runtime's issue order."""
    comm = fetches[0]  # stage 0's fetch is issued before the host kernel
    fetch_end = comm
    compute = host
    prev_reduce_end = 0.0
    for i, k in enumerate(kernels):
        start = max(compute, fetch_end)  # stage i waits for its K/V
        if i + 1 < len(kernels):  # issued now: waits for the compute issued so far and the comm queue
            comm = max(comm, start) + fetches[i + 1]
            fetch_end = comm
        compute = start + k
        if reduces is not None:
            comm = max(comm, compute) + reduces[i]  # this stage's dK/dV, once its kernel is done
            compute = max(compute, prev_reduce_end)  # the runtime waits for the previous reduce here
            prev_reduce_end = comm
    return max(compute, prev_reduce_end)
