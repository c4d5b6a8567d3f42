"""Plans built from a key, their per-device tensors, and the per-group LRU cache of both.

Planning (dispatch, comm plan, overlap stages) is pure Python in `magi_solver` and runs once per key;
it is a deterministic function of the key, so every rank builds the same plan without communicating.
Device tensors (kernel range tensors, gather indices, group-collective plans) are built lazily on the
first call on a device and cached with the plan.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from magi_group_collective import GroupCastPlan, GroupReducePlan
from magi_solver import (
    PROFILES,
    DispatchPlan,
    DistAttnPlan,
    OverlapCostModel,
    RankPlan,
    SliceList,
    get_profile,
    load_profile,
    plan_dist_attn,
    solve_dispatch,
)

from ._kernels import AttnKernel, KernelChoice, agree_kernel_choice, attn_kernel
from .config import KernelBackend, OverlapMode
from .env import cost_profile_override, runtime_dict_size
from .key import DistAttnRuntimeKey

_MIN_CHUNKS_PER_RANK = 8
_DEFAULT_MAX_CHUNK = 2048


def choose_chunk_size(total_seqlen: int, cp_size: int, chunk_size: int | None) -> int:
    """User's chunk size, or min(2048, ceil(total / (8 * cp))) so each rank has ~8 chunks to balance."""
    if chunk_size is not None:
        return chunk_size
    return max(1, min(_DEFAULT_MAX_CHUNK, math.ceil(total_seqlen / (_MIN_CHUNKS_PER_RANK * cp_size))))


@dataclass(frozen=True, slots=True)
class DispatchLayout:
    """Where every token lives after dispatch. Tokens past `total_seqlen` are padding (no keys, zero rows)."""

    total_seqlen: int
    padded_seqlen: int
    shard_seqlen: int
    cp_size: int
    chunk_size: int
    permutation: np.ndarray
    """int64 [padded_seqlen]: global token id of each dispatched position (rank 0's tokens first)."""
    dispatch_plan: DispatchPlan | None

    def local_token_ids(self, rank: int) -> np.ndarray:
        return self.permutation[rank * self.shard_seqlen : (rank + 1) * self.shard_seqlen]


@dataclass(slots=True)
class KernelSlices:
    """One kernel call's slices as int32 host tensors; `num_slices == 0` means skip the call."""

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    types: torch.Tensor
    num_slices: int

    @classmethod
    def from_slice_list(cls, slices: SliceList) -> KernelSlices:
        # Host tensors on purpose: FFA reads slice geometry on the host (cached by value) and keeps its own
        # device copy, so CUDA range tensors would only add a device->host sync to every kernel call.
        n = len(slices.types)
        q = torch.tensor(slices.q_ranges, dtype=torch.int32).reshape(n, 2)
        k = torch.tensor(slices.k_ranges, dtype=torch.int32).reshape(n, 2)
        t = torch.tensor(slices.types, dtype=torch.int32).reshape(n)
        return cls(q, k, t, n)


@dataclass(slots=True)
class DeviceMeta:
    """Everything one rank needs on one device to run the plan without host work."""

    local_ids: torch.Tensor  # int64 [shard]: global (padded) ids of local tokens
    unpermutation: torch.Tensor  # int64 [padded]: dispatched position of each global token
    host: KernelSlices
    merged: KernelSlices
    stages: list[KernelSlices]
    remote_tokens: list[int]
    cast_plans: list[GroupCastPlan]
    reduce_plans: list[GroupReducePlan]


class DistAttnRuntime:
    """The plan of one key on this rank, its kernel choice, plus its device tensors."""

    def __init__(
        self,
        key: DistAttnRuntimeKey,
        layout: DispatchLayout,
        plan: DistAttnPlan | None,
        kernel_choice: KernelChoice,
    ) -> None:
        self.key = key
        self.layout = layout
        self.plan = plan
        self.kernel_choice = kernel_choice
        self.rank = key.cp_group.local_rank()
        # degree 0 (static or chosen by the cost model): all remote K/V at once, one kernel call
        self.merged_stage = plan is not None and plan.overlap_degree == 0
        self._device_meta: dict[torch.device, DeviceMeta] = {}

    def kernel(self, dtype: torch.dtype) -> AttnKernel:
        """The launchers for inputs of `dtype` (same backend on every rank)."""
        return attn_kernel(self.kernel_choice.backend_for(dtype, self.key.head_dim))

    @property
    def rank_plan(self) -> RankPlan | None:
        return None if self.plan is None else self.plan.ranks[self.rank]

    @property
    def num_stages(self) -> int:
        return 0 if self.plan is None else self.plan.num_stages

    def device_meta(self, device: torch.device) -> DeviceMeta:
        meta = self._device_meta.get(device)
        if meta is None:
            meta = self._build_device_meta(device)
            self._device_meta[device] = meta
        return meta

    def _build_device_meta(self, device: torch.device) -> DeviceMeta:
        layout = self.layout
        local_ids = torch.from_numpy(layout.local_token_ids(self.rank).astype(np.int64)).to(device)
        unperm = torch.from_numpy(np.argsort(layout.permutation, kind="stable").astype(np.int64)).to(device)
        rank_plan = self.rank_plan
        if rank_plan is None:  # cp_size 1: the key's own slices, no stages
            key = self.key
            whole = SliceList(key.q_ranges, key.k_ranges, key.attn_mask_type)
            host = KernelSlices.from_slice_list(whole)
            return DeviceMeta(local_ids, unperm, host, host, [], [], [], [])
        group = self.key.cp_group.mesh if self.key.cp_group.mesh is not None else self.key.cp_group.group
        cast_plans, reduce_plans = [], []
        for stage in rank_plan.stages:
            c = stage.cast
            cast = GroupCastPlan(
                list(c.input_split_sizes),
                list(c.output_split_sizes),
                [list(d) for d in c.dst_indices],
                list(c.src_index),
                group=group,
                device=device,
            )
            cast_plans.append(cast)
            reduce_plans.append(cast.transpose())
        return DeviceMeta(
            local_ids=local_ids,
            unpermutation=unperm,
            host=KernelSlices.from_slice_list(rank_plan.host_slices),
            merged=KernelSlices.from_slice_list(rank_plan.merged_slices),
            stages=[KernelSlices.from_slice_list(s.remote_slices) for s in rank_plan.stages],
            remote_tokens=[s.num_remote_tokens for s in rank_plan.stages],
            cast_plans=cast_plans,
            reduce_plans=reduce_plans,
        )


def build_layout(key: DistAttnRuntimeKey) -> DispatchLayout:
    """Dispatch of the key's own mask (only for root keys)."""
    cp = key.cp_size
    total = key.total_seqlen_q
    if cp == 1:
        return DispatchLayout(total, total, total, 1, total, np.arange(total, dtype=np.int64), None)
    dispatch_cfg = key.config.dispatch_config
    chunk = choose_chunk_size(total, cp, dispatch_cfg.chunk_size)
    padded = math.ceil(total / (chunk * cp)) * chunk * cp
    dplan = solve_dispatch(
        [list(r) for r in key.q_ranges],
        [list(r) for r in key.k_ranges],
        list(key.attn_mask_type),
        padded,
        cp,
        chunk,
        alg=str(dispatch_cfg.alg),
    )
    perm = np.concatenate(
        [np.arange(c * chunk, (c + 1) * chunk, dtype=np.int64) for part in dplan.partitions for c in part]
    )
    return DispatchLayout(total, padded, padded // cp, cp, chunk, perm, dplan)


def overlap_cost_model(key: DistAttnRuntimeKey, choice: KernelChoice) -> OverlapCostModel:
    """The dynamic overlap's cost model: the configured profile, else MAGI_ATTENTION_COST_PROFILE, else the
    shipped profile of (rank 0's GPU kind, backend). Sized for 16-bit inputs (the dtype is not in the key)."""
    name = key.config.overlap_config.cost_profile or cost_profile_override()
    if name is None:
        profile = get_profile(choice.gpu_kind, choice.backend.value)
    elif name in PROFILES:
        profile = PROFILES[name]
    elif name.endswith(".json") or os.path.sep in name:
        profile = load_profile(name)
    else:
        raise ValueError(
            f"cost profile {name!r} is neither a JSON file nor one of {sorted(PROFILES)} "
            "(OverlapConfig.cost_profile / MAGI_ATTENTION_COST_PROFILE)"
        )
    return OverlapCostModel(
        profile=profile, num_heads_q=key.num_heads_q, num_heads_kv=key.num_heads_kv, head_dim=key.head_dim
    )


def build_plan(key: DistAttnRuntimeKey, layout: DispatchLayout, choice: KernelChoice) -> DistAttnPlan | None:
    """Comm plan and stages of the key's mask on the (possibly borrowed) dispatch layout."""
    if key.cp_size == 1:
        return None
    ov = key.config.overlap_config
    dynamic = ov.mode == OverlapMode.DYNAMIC
    return plan_dist_attn(
        [list(r) for r in key.q_ranges],
        [list(r) for r in key.k_ranges],
        list(key.attn_mask_type),
        layout.padded_seqlen,
        key.cp_size,
        layout.chunk_size,
        dispatch_alg=str(key.config.dispatch_config.alg),
        overlap_degree=None if dynamic else ov.degree,
        overlap_mode="dynamic" if dynamic else "static",
        min_chunk_size=ov.min_chunk_size,
        max_num_chunks=ov.max_num_chunks,
        dynamic_max_degree=ov.max_degree,
        cost_model=overlap_cost_model(key, choice) if dynamic else None,
        # A mask made after dispatch keeps the dispatch of the key it was made from.
        **({} if key.dispatch_key is None else {"dispatch": layout.dispatch_plan}),
    )


class RuntimeCache:
    """Per-cp-group LRU of runtimes. Every rank makes the same calls, so evictions match across ranks."""

    def __init__(self) -> None:
        self._by_group: dict[str, OrderedDict[DistAttnRuntimeKey, DistAttnRuntime]] = {}
        self._layouts: dict[DistAttnRuntimeKey, DispatchLayout] = {}

    @staticmethod
    def capacity() -> int:
        return runtime_dict_size()

    def get(self, key: DistAttnRuntimeKey) -> DistAttnRuntime:
        lru = self._by_group.setdefault(key.cp_group.name, OrderedDict())
        runtime = lru.get(key)
        if runtime is not None:
            lru.move_to_end(key)
            return runtime
        root = key.root_key
        layout = self._layouts.get(root)
        if layout is None:
            layout = build_layout(root)
            self._layouts[root] = layout
        choice = agree_kernel_choice(key.cp_group, KernelBackend(key.config.kernel_backend), key.head_dim)
        runtime = DistAttnRuntime(key, layout, build_plan(key, layout, choice), choice)
        lru[key] = runtime
        while len(lru) > self.capacity():
            evicted, _ = lru.popitem(last=False)
            self._layouts.pop(evicted, None)
        return runtime

    def most_recent_key(self, group_name: str) -> DistAttnRuntimeKey | None:
        lru = self._by_group.get(group_name)
        return next(reversed(lru)) if lru else None

    def clear(self, group_name: str | None = None) -> None:
        if group_name is None:
            self._by_group.clear()
            self._layouts.clear()
            return
        for key in self._by_group.pop(group_name, {}):
            self._layouts.pop(key, None)


RUNTIME_CACHE = RuntimeCache()
