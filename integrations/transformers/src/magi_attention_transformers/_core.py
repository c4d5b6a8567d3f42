"""magi-attention as a Transformers attention implementation, plus the per-batch dispatch.

How it fits Transformers 5.x: decoder models call `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
with `[batch, heads, seq, head_dim]` q/k/v (K/V not repeated for GQA) and build their mask with
`ALL_MASK_ATTENTION_FUNCTIONS[config._attn_implementation]`. We register both under "magi_attention":
the mask function returns None (the mask is the packed-document mask planned by `dispatch_batch`), the
attention function runs `calc_attn` on this rank's tokens with the group's current dispatch key.

State is kept per context-parallel group (identified by its rank list): the heads and head_dim of the
model last passed to `apply_magi_attention`, its `DistAttnConfig`, the key and documents of the most
recent `dispatch_batch`, and the sliding-window keys derived from it (same token placement).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from magi_attention.api import (
    PreparedDispatch,
    adopt_dispatch,
    calc_attn,
    dispatch,
    get_most_recent_key,
    get_position_ids,
    magi_attn_varlen_key,
    make_flex_key_for_new_mask_after_dispatch,
    undispatch,
)
from magi_attention.config import DistAttnConfig
from magi_attention.helpers import all_reduce_gradients as _all_reduce_gradients
from magi_attention.helpers import cu_seqlens_list

ATTN_IMPLEMENTATION = "magi_attention"
"""The name registered with Transformers' `AttentionInterface` and `AttentionMaskInterface`."""

IGNORE_INDEX = -100
_MAX_WINDOW_KEYS = 64


@dataclass
class DispatchedBatch:
    """One packed batch, as this rank sees it after dispatch."""

    input_ids: torch.Tensor
    """`[1, local_tokens]` this rank's tokens (padding rows hold token 0)."""
    position_ids: torch.Tensor
    """`[1, local_tokens]` index of each local token within its own document (RoPE positions)."""
    labels: torch.Tensor
    """`[1, local_tokens]` next-token target of each local token within its document; -100 at each
    document's last token, where the given labels were -100, and on padding."""
    key: Any
    """The magi-attention runtime key the batch was dispatched with (for `undispatch_logits`)."""
    num_label_tokens: int = 0
    """Targets different from -100 in the whole pack (the loss's denominator, the same on every rank)."""
    cp_group_or_mesh: Any = field(default=None, repr=False)
    """The group or mesh given to `dispatch_batch`."""


@dataclass
class _GroupState:
    cp_group_or_mesh: Any
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    dist_attn_config: DistAttnConfig | None
    key: Any = None
    cu_seqlens: tuple[int, ...] | None = None
    window_keys: OrderedDict = field(default_factory=OrderedDict)


_STATES: dict[tuple, _GroupState] = {}


def _group_id(cp_group_or_mesh: Any) -> tuple:
    """A group's identity: its global ranks (equal sub-meshes or groups built twice map to one state)."""
    if cp_group_or_mesh is None:
        if dist.is_available() and dist.is_initialized():
            return tuple(range(dist.get_world_size()))
        return ()
    if isinstance(cp_group_or_mesh, DeviceMesh):
        return tuple(int(r) for r in cp_group_or_mesh.mesh.flatten().tolist())
    if isinstance(cp_group_or_mesh, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(cp_group_or_mesh))
    raise TypeError(
        f"cp_group_or_mesh must be a ProcessGroup, a DeviceMesh or None, got {type(cp_group_or_mesh).__name__}"
    )


def _process_group(cp_group_or_mesh: Any) -> dist.ProcessGroup | None:
    """The ProcessGroup to reduce over (None when there is no distributed run)."""
    if cp_group_or_mesh is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if isinstance(cp_group_or_mesh, DeviceMesh):
        mesh = cp_group_or_mesh
        return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    return cp_group_or_mesh


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def apply_magi_attention(
    model: torch.nn.Module, cp_group_or_mesh: Any, *, dist_attn_config: DistAttnConfig | None = None
) -> None:
    """Switch `model`'s attention to magi-attention over `cp_group_or_mesh`, in place.

    Registers the attention and mask functions under `"magi_attention"`, sets the model's attention
    implementation to it, records the model's heads and head_dim for `dispatch_batch` on this group, and
    turns the KV cache off (`config.use_cache = False`: context-parallel training only, no generation).

    Args:
        model: a Transformers decoder model (`PreTrainedModel`) whose attention uses `AttentionInterface`
            (Llama, Qwen2, Qwen3, Mistral and most current decoders).
        cp_group_or_mesh: the context-parallel ProcessGroup, a 1-D DeviceMesh (e.g. `mesh["cp"]`), or None
            for the default group.
        dist_attn_config: dispatch/overlap/kernel settings for this group's batches (default
            `DistAttnConfig()`); `dispatch_batch(..., dist_attn_config=...)` overrides it per batch.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if dist_attn_config is not None and not isinstance(dist_attn_config, DistAttnConfig):
        raise TypeError(f"dist_attn_config must be a DistAttnConfig, got {type(dist_attn_config).__name__}")
    gid = _group_id(cp_group_or_mesh)
    text = _text_config(model.config)
    hq = int(text.num_attention_heads)
    hkv = int(getattr(text, "num_key_value_heads", None) or hq)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // hq)

    AttentionInterface.register(ATTN_IMPLEMENTATION, magi_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, magi_attention_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for config in {id(c): c for c in (model.config, text)}.values():
        config.use_cache = False
    for module in model.modules():
        module._magi_cp_group_id = gid
    _STATES[gid] = _GroupState(cp_group_or_mesh, hq, hkv, head_dim, dist_attn_config)


def _as_row(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 2 and x.shape[0] == 1:
        return x[0]
    if x.ndim == 1:
        return x
    raise ValueError(f"{name} must be one packed sequence [1, total_tokens], got shape {tuple(x.shape)}")


def dispatch_batch(
    input_ids: torch.Tensor,
    cp_group_or_mesh: Any,
    *,
    cu_seqlens: Any = None,
    labels: torch.Tensor | None = None,
    dist_attn_config: DistAttnConfig | None = None,
    prepared: PreparedDispatch | None = None,
) -> DispatchedBatch:
    """Plan attention for one packed batch and keep this rank's tokens.

    Args:
        input_ids: `[1, total_tokens]`, one packed sequence, the same on every rank of the group.
        cp_group_or_mesh: the group given to `apply_magi_attention`.
        cu_seqlens: `[0, ..., total_tokens]` document boundaries (list or int tensor); None: one document.
            Every document is causal and sees only itself.
        labels: `[1, total_tokens]` Transformers-style labels aligned with `input_ids` (-100 = ignore); the
            targets are shifted here, within each document. None: `input_ids`.
        dist_attn_config: overrides the config given to `apply_magi_attention` for this batch.
        prepared: this batch's dispatch solved ahead, e.g. in a data-loader worker:
            `magi_attention.api.prepare_varlen_dispatch(cu_seqlens, cu_seqlens, cp_size, causal=True,
            dist_attn_config=...)` with the config this call uses. It is adopted (`adopt_dispatch`) before
            the key is built, so the key takes it instead of solving. One solved for another cp size or
            token count raises `ValueError`; one for another batch of the same size or another config is
            not used (the key solves its own, with the same result).

    Returns:
        a `DispatchedBatch`; afterwards `model(input_ids=batch.input_ids, position_ids=batch.position_ids)`
        attends with this batch's key (the group's most recent batch).
    """
    gid = _group_id(cp_group_or_mesh)
    state = _STATES.get(gid)
    if state is None:
        raise RuntimeError(
            f"no model is registered for this cp group (ranks {list(gid)}): call apply_magi_attention(model, group) first"
        )
    ids = _as_row(input_ids, "input_ids")
    total = ids.shape[0]
    if total == 0:
        raise ValueError("input_ids is empty")
    cu = [0, total] if cu_seqlens is None else cu_seqlens_list(cu_seqlens, total=total)
    config = dist_attn_config if dist_attn_config is not None else state.dist_attn_config
    if prepared is not None:  # errors before the key's collectives
        adopt_dispatch(prepared, cp_size=max(len(gid), 1), total_seqlen=total)  # gid: the group's ranks
    key = magi_attn_varlen_key(
        cu, cu, state.num_heads_q, state.num_heads_kv, state.head_dim, cp_group_or_mesh,
        causal=True, dist_attn_config=config,
    )  # fmt: skip
    device = ids.device
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)

    # Targets in global order first (shift within each document), then dispatched like the tokens.
    source = ids if labels is None else _as_row(labels, "labels").to(device)
    if source.shape[0] != total:
        raise ValueError(f"labels has {source.shape[0]} tokens, input_ids has {total}")
    targets = torch.full((total,), IGNORE_INDEX, dtype=torch.long, device=device)
    targets[:-1] = source[1:]
    doc_ends = cu_t[1:][cu_t[1:] > cu_t[:-1]] - 1
    targets[doc_ends] = IGNORE_INDEX

    local_ids = dispatch(ids, key)
    valid = dispatch(torch.ones(total, dtype=torch.bool, device=device), key)  # padding rows are False
    global_pos = get_position_ids(key).to(device)
    doc = torch.searchsorted(cu_t, global_pos, right=True) - 1
    local_pos = torch.where(valid, global_pos - cu_t[doc.clamp(max=len(cu) - 2)], 0)
    local_labels = dispatch(targets, key).masked_fill(~valid, IGNORE_INDEX)

    state.key = key
    state.cu_seqlens = tuple(cu)
    return DispatchedBatch(
        input_ids=local_ids[None],
        position_ids=local_pos[None],
        labels=local_labels[None],
        key=key,
        num_label_tokens=int((targets != IGNORE_INDEX).sum()),
        cp_group_or_mesh=cp_group_or_mesh,
    )


def undispatch_logits(local_logits: torch.Tensor, key: Any) -> torch.Tensor:
    """`[1, local_tokens, vocab]` -> `[1, total_tokens, vocab]` in global order (autograd; for evaluation
    and tests: every rank then holds the whole pack's logits)."""
    if local_logits.ndim != 3 or local_logits.shape[0] != 1:
        raise ValueError(
            f"local_logits must be [1, local_tokens, vocab], got shape {tuple(local_logits.shape)}"
        )
    return undispatch(local_logits[0], key)[None]


def causal_lm_loss(local_logits: torch.Tensor, batch: DispatchedBatch) -> torch.Tensor:
    """Token-mean cross entropy over the whole pack, computed from this rank's logits only.

    The value is the pack's mean loss (reduced over the cp group), the same on every rank; its gradient is
    this rank's share, so the parameter gradients summed over the cp group are those of the single-process
    loss: follow `backward()` with `all_reduce_gradients(model, group)` (or a DDP/FSDP reduction over the cp
    ranks that sums rather than averages). No rank ever holds `[total_tokens, vocab]`.
    """
    logits = local_logits[0]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    local_sum = F.cross_entropy(logits, batch.labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
    local = local_sum / max(batch.num_label_tokens, 1)
    total = local.detach().clone()
    group = _process_group(batch.cp_group_or_mesh)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return local + (total - local.detach())


def all_reduce_gradients(model: torch.nn.Module, cp_group_or_mesh: Any) -> None:
    """Sum every parameter's gradient over the cp group (plain replicated parameters, no DDP/FSDP)."""
    group = _process_group(cp_group_or_mesh)
    if group is not None:
        _all_reduce_gradients(model, group)


def magi_attention_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function registered with `AttentionMaskInterface`: no dense mask (the key holds the mask)."""
    return None


def _window_key(state: _GroupState, base: Any, window: int) -> Any:
    """The key of Transformers' sliding window (`q - window < k <= q`, inside each document) on the same
    token placement as `base`; cached per (dispatch key, window)."""
    cache_key = (base, window)
    cached = state.window_keys.get(cache_key)
    if cached is not None:
        state.window_keys.move_to_end(cache_key)
        return cached
    if state.key is not base or state.cu_seqlens is None:
        raise RuntimeError(
            "sliding-window layers need the documents of the batch: dispatch it with dispatch_batch()"
        )
    q_ranges, k_ranges, types = [], [], []
    cu = state.cu_seqlens
    for s, e in pairwise(cu):
        if e <= s:
            continue
        head = min(e, s + window)
        q_ranges.append((s, head))  # the first `window` rows see the whole prefix: causal
        k_ranges.append((s, head))
        types.append("causal")
        if head < e:  # row q sees keys q-window+1 .. q: a band, bi-causal over k [s+1, e)
            q_ranges.append((head, e))
            k_ranges.append((s + 1, e))
            types.append("bi_causal")
    key = make_flex_key_for_new_mask_after_dispatch(q_ranges, k_ranges, types, base)
    state.window_keys[cache_key] = key
    while len(state.window_keys) > _MAX_WINDOW_KEYS:
        state.window_keys.popitem(last=False)
    return key


def magi_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function registered with `AttentionInterface` (Transformers' calling convention).

    q `[1, heads_q, local_tokens, head_dim]`, k/v `[1, heads_kv, local_tokens, head_dim]` ->
    `([1, local_tokens, heads_q, head_dim], None)`.
    """
    gid = getattr(module, "_magi_cp_group_id", None)
    if gid is None and len(_STATES) == 1:
        gid = next(iter(_STATES))
    state = _STATES.get(gid)
    if state is None:
        raise RuntimeError("this module's model was not prepared with apply_magi_attention(model, group)")
    base = state.key
    if base is None:
        recent = get_most_recent_key(state.cp_group_or_mesh)
        base = None if recent is None else recent.root_key
    if base is None:
        raise RuntimeError("no batch dispatched on this cp group: call dispatch_batch() before the model")
    if attention_mask is not None:
        raise ValueError(
            "magi_attention ignores dense attention masks: describe documents with dispatch_batch(cu_seqlens=...)"
        )
    if dropout:
        raise NotImplementedError("attention dropout is not supported by magi_attention")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("magi_attention_transformers supports causal decoder attention only")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by magi_attention_transformers")
    if query.shape[0] != 1:
        raise ValueError(f"expected one packed sequence (batch 1), got batch {query.shape[0]}")
    attn_key = base if sliding_window is None else _window_key(state, base, int(sliding_window))
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    out, _ = calc_attn(q, k, v, attn_key, softmax_scale=scaling, softcap=float(softcap or 0.0))
    return out[None], None
