"""Plans built from a key, their per-device tensors, and the per-group LRU cache of both.

Planning (dispatch, comm plan, overlap stages) is pure Python in `magi_solver` and runs once per key;
it is a deterministic function of the key, so every rank builds the same plan without communicating.
Device tensors (kernel range tensors, gather indices, group-collective plans) are built lazily on the
first call on a device and cached with the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from magi_ffa.validation import CheckedSlices, check_slices
from magi_group_collective import GroupCastPlan, GroupReducePlan, NativeUnavailableError
from magi_solver import DistAttnPlan, RankPlan, SliceList
from magi_solver.comm import GroupCastArgs

from .._layout import DispatchLayout, build_layout, remember_lengths
from ..env import runtime_cache_bytes, runtime_dict_size
from ..key import DistAttnRuntimeKey
from .kernels import AttnKernel, KernelChoice, attn_kernel
from .key_route import CallSlices, KeyBuild, build_alone

_LOG = logging.getLogger("magi_attention")


@dataclass(slots=True)
class KernelSlices:
    """One kernel call's slices as int32 host tensors; `num_slices == 0` means skip the call. `checked`: the
    same slices checked once against the call's token counts, what every backend's launcher entry takes (the
    one FFA contract, `AttnKernel.fwd_slices`); None: checked on first use."""

    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    types: torch.Tensor
    num_slices: int
    checked: CheckedSlices | None = None

    @classmethod
    def from_slice_list(
        cls, slices: SliceList, total_q: int, total_k: int, checked: CheckedSlices | None = None
    ) -> KernelSlices:
        """The tensors of `slices`, checked here, once, against `total_q` query and `total_k` key tokens
        (`checked`: the same slices checked already, e.g. when the plan was built in deterministic mode)."""
        # Host tensors on purpose: FFA reads slice geometry on the host (cached by value) and keeps its own
        # device copy, so CUDA range tensors would only add a device->host sync to every kernel call.
        n = len(slices.types)
        if checked is not None:
            return cls(checked.q_ranges, checked.k_ranges, checked.types, n, checked)
        q = torch.tensor(slices.q_ranges, dtype=torch.int32).reshape(n, 2)
        k = torch.tensor(slices.k_ranges, dtype=torch.int32).reshape(n, 2)
        t = torch.tensor(slices.types, dtype=torch.int32).reshape(n)
        return cls(q, k, t, n, check_slices(q, k, t, total_q, total_k))


def _once(make: Callable[[], KernelSlices]) -> Callable[[], KernelSlices]:
    """`make`, called on first use only (its result kept)."""
    box: list[KernelSlices] = []

    def get() -> KernelSlices:
        if not box:
            box.append(make())
        return box[0]

    return get


class _LazyCalls(Sequence):
    """Kernel calls' slices, each built (and checked) on first use."""

    __slots__ = ("_calls",)

    def __init__(self, calls: list[Callable[[], KernelSlices]]) -> None:
        self._calls = [_once(c) for c in calls]

    def __len__(self) -> int:
        return len(self._calls)

    def __getitem__(self, i):  # int or slice, as a list's
        if isinstance(i, slice):
            return [c() for c in self._calls[i]]
        return self._calls[i]()


class DeviceMeta:
    """Everything one rank needs on one device to run the plan's attention without host work: the
    group-collective plans of its stages and its kernel calls' slices (`host`, `merged`, `stages`). The slices
    are built and checked on first use: a plan at overlap degree 0 runs its merged call only, so its host and
    stage calls are never checked. (The token indices of dispatch / undispatch are the runtime's own,
    `DistAttnRuntime.local_ids` / `unpermutation`: they need no tables.)"""

    __slots__ = ("_host", "_merged", "cast_plans", "reduce_plans", "remote_tokens", "stages")

    def __init__(
        self,
        host: Callable[[], KernelSlices],
        merged: Callable[[], KernelSlices],
        stages: list[Callable[[], KernelSlices]],
        remote_tokens: list[int],
        cast_plans: list[GroupCastPlan],
        reduce_plans: list[GroupReducePlan],
    ) -> None:
        self._host = _once(host)
        self._merged = self._host if merged is host else _once(merged)
        self.stages: Sequence[KernelSlices] = _LazyCalls(stages)
        self.remote_tokens = remote_tokens
        self.cast_plans = cast_plans
        self.reduce_plans = reduce_plans

    @property
    def host(self) -> KernelSlices:
        """This rank's queries against its own keys (the whole mask at cp 1)."""
        return self._host()

    @property
    def merged(self) -> KernelSlices:
        """This rank's queries against its own and every received key (overlap degree 0)."""
        return self._merged()


class DistAttnRuntime:
    """The plan of one key on this rank, its kernel choice, plus its device tensors. `checked`: per rank, its
    kernel calls (`rank_kernel_calls`) already checked when the key was planned (deterministic mode: their
    determinism verdicts are kept on them, so this rank's calls read them)."""

    def __init__(
        self,
        key: DistAttnRuntimeKey,
        layout: DispatchLayout,
        plan: DistAttnPlan | None,
        kernel_choice: KernelChoice,
        checked: Sequence[Sequence[tuple[CallSlices, CheckedSlices]]] = (),
    ) -> None:
        self.key = key
        self.layout = layout
        self.plan = plan
        self.kernel_choice = kernel_choice
        self._checked = checked
        # degree 0 (static or chosen by the cost model): all remote K/V at once, one kernel call
        self.merged_stage = plan is not None and plan.overlap_degree == 0
        self._device_meta: dict[torch.device, DeviceMeta] = {}
        self._token_ids: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._kernels: dict[tuple[torch.dtype, float], AttnKernel] = {}
        self.nbytes = 0  # estimated cache cost, set by RuntimeCache

    @functools.cached_property
    def rank(self) -> int:
        """This rank's index in the key's cp group."""
        return self.key.cp_group.local_rank()

    @functools.cached_property
    def checked(self) -> dict[CallSlices, CheckedSlices]:
        """This rank's kernel calls checked when the key was planned (empty: checked when first built)."""
        return dict(self._checked[self.rank if self.plan is not None else 0]) if self._checked else {}

    def kernel(self, dtype: torch.dtype, softcap: float = 0.0) -> AttnKernel:
        """The launchers for inputs of `dtype` with this `softcap` (same backends on every rank)."""
        # resolved once per (dtype, softcap): every forward and backward asks (a split choice's refinement
        # costs ~15 us of host time, as long as a small kernel's launch)
        kernel = self._kernels.get((dtype, softcap))
        if kernel is None:
            choice, d = self.kernel_choice, self.key.head_dim
            kernel = attn_kernel(
                choice.backend_for(dtype, d, softcap), choice.backward_for(dtype, d, softcap)
            )
            self._kernels[(dtype, softcap)] = kernel
        return kernel

    @property
    def local_seqlen(self) -> int:
        """This rank's query-side tokens."""
        return self.layout.shard_seqlens[self.rank]

    @property
    def kv_local_seqlen(self) -> int:
        """This rank's key/value tokens (its query tokens in self-attention)."""
        return self.layout.kv_shard_seqlens[self.rank]

    @property
    def rank_plan(self) -> RankPlan | None:
        return None if self.plan is None else self.plan.ranks[self.rank]

    @property
    def num_stages(self) -> int:
        return 0 if self.plan is None else self.plan.num_stages

    def local_ids(self, device: torch.device) -> torch.Tensor:
        """int64 `[shard]` on `device`: the global (padded) ids of this rank's tokens, what `dispatch` keeps
        (built once per device, locally: no tables, no communication)."""
        ids = self._token_ids.get(("local", device))
        if ids is None:
            ids = torch.from_numpy(self.layout.local_token_ids(self.rank).astype(np.int64)).to(device)
            self._token_ids[("local", device)] = ids
        return ids

    def unpermutation(self, device: torch.device) -> torch.Tensor:
        """int64 `[padded]` on `device`: where each global token sits in an all-gather of every rank's local
        tokens, each rank's rows padded to the largest shard (`gather_positions`), what `undispatch` reads
        (built once per device, on first use, locally)."""
        ids = self._token_ids.get(("gather", device))
        if ids is None:
            ids = torch.from_numpy(gather_positions(self.layout)).to(device)
            self._token_ids[("gather", device)] = ids
        return ids

    def device_meta(self, device: torch.device) -> DeviceMeta:
        meta = self._device_meta.get(device)
        if meta is None:
            meta = self._build_device_meta(device)
            self._device_meta[device] = meta
        return meta

    def _build_device_meta(self, device: torch.device) -> DeviceMeta:
        rank_plan = self.rank_plan
        if rank_plan is None:  # cp_size 1: the key's own slices, no stages
            key = self.key
            whole = SliceList(key.q_ranges, key.k_ranges, key.attn_mask_type)
            host = functools.partial(self._slices, whole, key.total_seqlen_q, key.total_seqlen_k)
            return DeviceMeta(host, host, [], [], [], [])
        group = self.key.cp_group.mesh if self.key.cp_group.mesh is not None else self.key.cp_group.group
        choice = self.key.collective
        cast_plans, reduce_plans = [], []
        for i in range(len(rank_plan.stages)):
            # every rank's tables of this stage come from the plan every rank built alike (checked by
            # `plan_digest` in the agreement before this build), so no table gather is needed here
            every = [cast_tables(r.stages[i].cast) for r in self.plan.ranks]
            try:
                cast = GroupCastPlan.from_every_rank(every, group=group, device=device, impl=choice.impl)
            except NativeUnavailableError as exc:  # name the setting that chose native
                raise NativeUnavailableError(
                    f"{exc} (magi_attention: selected by {choice.setting})"
                ) from None
            cast_plans.append(cast)
            reduce_plans.append(cast.transpose())
        # the token counts each call's slices index: this rank's queries against its own keys, a stage's
        # received keys, or both together (the merged call)
        rows, local_kv = self.local_seqlen, self.kv_local_seqlen
        remote = [s.num_remote_tokens for s in rank_plan.stages]
        call = functools.partial
        return DeviceMeta(
            host=call(self._slices, rank_plan.host_slices, rows, local_kv),
            merged=call(self._slices, rank_plan.merged_slices, rows, local_kv + sum(remote)),
            stages=[
                call(self._slices, s.remote_slices, rows, n)
                for s, n in zip(rank_plan.stages, remote, strict=True)
            ],
            remote_tokens=remote,
            cast_plans=cast_plans,
            reduce_plans=reduce_plans,
        )

    @functools.cached_property
    def plan_digest(self) -> int:
        """A 63-bit hash of every rank's GroupCast tables of the plan (0 at cp 1): ranks that planned the
        same key differently (other library versions) are told apart by it before any table is used."""
        if self.plan is None:
            return 0
        tables = [[cast_tables(s.cast) for s in r.stages] for r in self.plan.ranks]
        return int.from_bytes(hashlib.blake2b(repr(tables).encode(), digest_size=8).digest(), "little") >> 1

    def _slices(self, slices: SliceList, rows: int, keys: int) -> KernelSlices:
        call = (slices, rows, keys)
        return KernelSlices.from_slice_list(slices, rows, keys, self.checked.get(call))


def cast_tables(cast: GroupCastArgs) -> tuple:
    """A plan stage's GroupCast tables as `GroupCastPlan` takes them (input and output split sizes, the
    destinations of each input piece, the source of each output piece)."""
    return (list(cast.input_split_sizes), list(cast.output_split_sizes),
            [list(d) for d in cast.dst_indices], list(cast.src_index))  # fmt: skip


def gather_positions(layout: DispatchLayout) -> np.ndarray:
    """int64 `[padded_seqlen]`: for each global token, its row in the all-gather of every rank's local
    tokens when each rank's rows are padded to `layout.shard_seqlen` (rank r's rows start at
    r * shard_seqlen). With equal shards this is the dispatched position of each token."""
    # global id -> dispatched position: the inverse of the permutation, by one scatter (an argsort is
    # O(n log n): 4-5 ms at 64k tokens)
    perm = layout.permutation
    order = np.empty(len(perm), dtype=np.int64)
    order[perm] = np.arange(len(perm), dtype=np.int64)
    shards = np.asarray(layout.shard_seqlens, dtype=np.int64)
    if (shards == shards[0]).all():
        return order
    offsets = np.asarray(layout.shard_offsets[:-1], dtype=np.int64)
    rank = np.searchsorted(offsets, order, side="right") - 1
    return order + rank * layout.shard_seqlen - offsets[rank]


# -- the byte bound: a deterministic estimate, the same number on every rank (evictions must match across
# ranks: a rank that re-plans a key the others still hold would take part in a collective the others skip)
_INT_BYTES = 32  # a Python int object plus the pointer that holds it
_SEQ_BYTES = 56  # tuple / list header


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """The field names of a dataclass type (None: not one), looked up once per type: a plan holds thousands
    of dataclass instances of a few types."""
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(f.name for f in dataclasses.fields(cls))


def _py_nbytes(obj: object, depth: int = 0) -> int:
    """Approximate, deterministic size of a plan's Python objects (no sys.getsizeof: same on every rank)."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return _INT_BYTES
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes) + 112
    if depth > 12:
        return _SEQ_BYTES
    if isinstance(obj, tuple | list):
        if obj and all(type(x) is int for x in obj[:4]) and type(obj[-1]) is int:
            return _SEQ_BYTES + len(obj) * _INT_BYTES  # flat int tuple: skip the walk
        total = _SEQ_BYTES
        for x in obj:  # the common items (ints, flat int pairs) counted here, as the walk would count them
            t = type(x)
            if t is int:
                total += 8 + _INT_BYTES
            elif (t is tuple or t is list) and depth < 12 and x and all(type(e) is int for e in x[:4]):
                total += 8 + (
                    _SEQ_BYTES + len(x) * _INT_BYTES if type(x[-1]) is int else _py_nbytes(x, depth + 1)
                )
            else:
                total += 8 + _py_nbytes(x, depth + 1)
        return total
    if isinstance(obj, dict):
        return 232 + sum(_py_nbytes(k, depth + 1) + _py_nbytes(v, depth + 1) for k, v in obj.items())
    names = _field_names(type(obj))
    if names is not None:
        return _SEQ_BYTES + sum(8 + _py_nbytes(getattr(obj, n), depth + 1) for n in names)
    slots = getattr(type(obj), "__slots__", None)
    if slots:
        return _SEQ_BYTES + sum(8 + _py_nbytes(getattr(obj, s, None), depth + 1) for s in slots)
    values = getattr(obj, "__dict__", None)
    if values is not None:
        return _py_nbytes(dict(values), depth + 1)
    return _SEQ_BYTES


def runtime_nbytes(layout: object, plan: object) -> int:
    """Estimated bytes one cache entry costs on this rank: the host bytes of its plan (Python objects and numpy
    arrays) plus the device tensors one device holds for it (index tensors, GroupCast tables), counted in full
    up front although the device part is built lazily."""
    padded = int(layout.padded_seqlen)
    shard = int(layout.shard_seqlen)
    host = _py_nbytes(plan) + int(layout.permutation.nbytes)
    # device: local ids [shard] + unpermutation [padded] (int64) + per stage the GroupCast/GroupReduce index
    # tensors of the busiest rank (max over ranks: the same number on every rank)
    remote = 0
    if plan is not None:
        remote = max(sum(int(s.num_remote_tokens) for s in r.stages) for r in plan.ranks)
    device = 8 * (padded + shard) + 2 * 8 * 2 * (remote + shard)
    return host + device


class RuntimeCache:
    """Per-cp-group LRU of runtimes, bounded by entries (MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE) and by
    estimated bytes (MAGI_ATTENTION_RUNTIME_CACHE_MB; `runtime_nbytes`, the same number on every
    rank). Every rank makes the same calls, so evictions match across ranks. A dispatch layout is shared by
    its root key and the keys made after dispatch from it, and dropped with the last of them."""

    def __init__(self) -> None:
        self._by_group: dict[str, OrderedDict[DistAttnRuntimeKey, DistAttnRuntime]] = {}
        self._layouts: dict[DistAttnRuntimeKey, DispatchLayout] = {}
        self._layout_refs: dict[DistAttnRuntimeKey, int] = {}
        self._bytes: dict[str, int] = {}

    @staticmethod
    def capacity() -> int:
        return runtime_dict_size()

    @staticmethod
    def byte_budget() -> int:
        return runtime_cache_bytes()

    def __contains__(self, key: DistAttnRuntimeKey) -> bool:
        lru = self._by_group.get(key.cp_group.name)
        return lru is not None and key in lru

    def nbytes(self, group_name: str) -> int:
        """Estimated bytes of the plans cached for `group_name`."""
        return self._bytes.get(group_name, 0)

    def _forget(self, group_name: str, key: DistAttnRuntimeKey, runtime: DistAttnRuntime) -> None:
        self._bytes[group_name] = self._bytes.get(group_name, 0) - runtime.nbytes
        root = key.root_key
        refs = self._layout_refs.get(root, 0) - 1
        if refs <= 0:
            self._layout_refs.pop(root, None)
            self._layouts.pop(root, None)
        else:
            self._layout_refs[root] = refs

    def cached(self, key: DistAttnRuntimeKey) -> DistAttnRuntime | None:
        """The runtime of `key` if cached (marked most recently used), else None; communicates nothing."""
        lru = self._by_group.get(key.cp_group.name)
        runtime = None if lru is None else lru.get(key)
        if runtime is not None:
            lru.move_to_end(key)
        return runtime

    def get(self, key: DistAttnRuntimeKey) -> DistAttnRuntime:
        """The runtime of `key`, planned now when not cached (`key_route.build_alone`: exchanges of its own
        only where the kernel choice or import of the key's kind was not agreed before)."""
        runtime = self.cached(key)
        if runtime is not None:
            return runtime
        self.capacity(), self.byte_budget()  # bad env values raise before planning
        layout = self.layout_of(key)
        try:
            build = build_alone(key, layout)
        except BaseException:
            self.drop_unused_layout(key)
            raise
        return self.admit(key, layout, build)

    def layout_of(self, key: DistAttnRuntimeKey) -> DispatchLayout:
        """The dispatch layout of `key`'s root key: cached, else built now (communicates nothing)."""
        root = key.root_key
        layout = self._layouts.get(root)
        if layout is None:
            layout = build_layout(root)
            self._layouts[root] = layout
            remember_lengths(root, layout)
        return layout

    def drop_unused_layout(self, key: DistAttnRuntimeKey) -> None:
        """After a failed build: forget the root's layout unless a cached key uses it."""
        if key.root_key not in self._layout_refs:
            self._layouts.pop(key.root_key, None)

    def admit(self, key: DistAttnRuntimeKey, layout: DispatchLayout, build: KeyBuild) -> DistAttnRuntime:
        """Cache the runtime of `build` (every rank's build, settled), evicting the least recently used."""
        capacity, budget = self.capacity(), self.byte_budget()
        choice = build.choice
        _LOG.debug("magi_attention key %s: kernel backend %s%s (%s)", key.cp_group.name, choice.backend,
                   "" if choice.backward is None else f", backward {choice.backward}", choice.reason)  # fmt: skip
        try:
            runtime = DistAttnRuntime(key, layout, build.plan, choice, build.checked)
        except BaseException:
            self.drop_unused_layout(key)
            raise
        runtime.nbytes = runtime_nbytes(layout, runtime.plan)
        name, root = key.cp_group.name, key.root_key
        lru = self._by_group.setdefault(name, OrderedDict())
        lru[key] = runtime
        self._layout_refs[root] = self._layout_refs.get(root, 0) + 1
        self._bytes[name] = self._bytes.get(name, 0) + runtime.nbytes
        # the newest entry always stays, even when it alone is over the byte budget
        while len(lru) > capacity or (len(lru) > 1 and self._bytes[name] > budget):
            evicted, old = lru.popitem(last=False)
            self._forget(name, evicted, old)
        return runtime

    def most_recent_key(self, group_name: str) -> DistAttnRuntimeKey | None:
        lru = self._by_group.get(group_name)
        return next(reversed(lru)) if lru else None

    def clear(self, group_name: str | None = None) -> None:
        if group_name is None:
            self._by_group.clear()
            self._layouts.clear()
            self._layout_refs.clear()
            self._bytes.clear()
            return
        for key, runtime in self._by_group.pop(group_name, {}).items():
            self._forget(group_name, key, runtime)
        self._bytes.pop(group_name, None)


RUNTIME_CACHE = RuntimeCache()
