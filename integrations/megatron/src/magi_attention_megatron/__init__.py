"""magi-attention context parallelism for Megatron-core GPT models.

Megatron itself runs with `context_parallel_size=1`; the sequence is split by magi dispatch over a
separate cp group, so Megatron's own CP slicing (zigzag batch split, RoPE slice) never happens:

- `MagiCoreAttention`: a core-attention module for a GPT layer spec (`core_attention=MagiCoreAttention`,
  or `magi_gpt_layer_spec()`); it runs `calc_attn` with the key of the group's current batch.
- `get_batch_on_this_cp_rank_magi(batch, cp_group, ...)`: the batch hook replacing Megatron's
  `get_batch_on_this_cp_rank`: dispatches tokens / labels / loss_mask and gives RoPE positions (global, or
  per document for packed sequences) from the dispatch.
- `use_magi_rotary(model)`: the model's RotaryEmbedding evaluated at those positions (same inv_freq,
  interpolation and interleaving convention as the model's own).
- `magi_loss(per_token_loss, batch)`: token mean over the whole batch from local tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from magi_attention.api import (
    PreparedDispatch,
    adopt_dispatch,
    calc_attn,
    dispatch,
    get_position_ids,
    magi_attn_varlen_key,
    undispatch,
)
from magi_attention.config import DistAttnConfig
from magi_attention.helpers import all_reduce_gradients as _all_reduce_gradients
from magi_attention.helpers import cu_seqlens_list

__all__ = [
    "MagiCoreAttention",
    "MagiRotaryEmbedding",
    "all_reduce_gradients",
    "get_batch_on_this_cp_rank_magi",
    "magi_gpt_layer_spec",
    "magi_loss",
    "undispatch_output",
    "use_magi_rotary",
]


@dataclass
class _Current:
    key: Any = None
    position_ids: torch.Tensor | None = None


_CURRENT = _Current()


class MagiCoreAttention(nn.Module):
    """Drop-in for `core_attention` (DotProductAttention / TEDotProductAttention) in a GPT layer spec.

    Takes Megatron's `[seq, batch=1, heads, head_dim]` q/k/v of this rank's tokens and returns
    `[seq, 1, heads * head_dim]`; the mask (causal, per document) is the current batch's magi key.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise NotImplementedError("MagiCoreAttention: attention dropout is not supported (set it to 0)")
        if attention_type != "self":
            raise NotImplementedError("MagiCoreAttention supports self-attention only")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if _CURRENT.key is None:
            raise RuntimeError("no batch dispatched: call get_batch_on_this_cp_rank_magi() before the model")
        if query.shape[1] != 1:
            raise ValueError(
                f"MagiCoreAttention expects micro-batch size 1 (one packed sequence), got {query.shape[1]}"
            )
        if attention_bias is not None:
            raise NotImplementedError("MagiCoreAttention: attention_bias is not supported")
        q, k, v = (x[:, 0].contiguous() for x in (query, key, value))
        out, _ = calc_attn(q, k, v, _CURRENT.key, softmax_scale=self.softmax_scale)
        return out.reshape(out.shape[0], 1, -1)


def magi_gpt_layer_spec(base_spec: Any = None, **local_spec_kwargs: Any) -> Any:
    """A GPT layer spec whose self-attention's core attention is `MagiCoreAttention`.

    Args:
        base_spec: a spec to adapt (e.g. from `get_gpt_layer_with_transformer_engine_spec()`); default
            `get_gpt_layer_local_spec(**local_spec_kwargs)` (no Transformer Engine needed).
    """
    if base_spec is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        base_spec = get_gpt_layer_local_spec(**local_spec_kwargs)
    spec = copy.deepcopy(base_spec)
    spec.submodules.self_attention.submodules.core_attention = MagiCoreAttention
    return spec


class MagiRotaryEmbedding(nn.Module):
    """Wraps a GPT model's `RotaryEmbedding`: returns its embedding at this rank's token positions
    `[local_tokens, 1, 1, dim]` (the positions of the current batch) instead of `[0, max_seq_len)`."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None
    ) -> torch.Tensor:
        pos = _CURRENT.position_ids
        if pos is None:
            raise RuntimeError("no batch dispatched: call get_batch_on_this_cp_rank_magi() before the model")
        r = self.rotary
        # on the positions' (the batch's) device: Megatron's own forward moves `inv_freq` (a plain attribute,
        # not a buffer, so `model.to("cuda")` leaves it where a CPU-initialized model made it) to the GPU
        # when it first runs, which this wrapper replaces
        inv_freq = r.inv_freq.to(pos.device)
        seq = pos.to(dtype=inv_freq.dtype) + offset
        if getattr(r, "seq_len_interpolation_factor", None) is not None:
            seq = seq * (1 / r.seq_len_interpolation_factor)
        freqs = torch.outer(seq, inv_freq)
        if not getattr(r, "rotary_interleaved", False):
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


def use_magi_rotary(model: nn.Module) -> None:
    """Make the GPT model's RoPE follow the dispatched positions (in place; no-op without RoPE)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None and not isinstance(rotary, MagiRotaryEmbedding):
        model.rotary_pos_emb = MagiRotaryEmbedding(rotary)


def get_batch_on_this_cp_rank_magi(
    batch: dict[str, torch.Tensor],
    cp_group: Any,
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cu_seqlens: Any = None,
    dist_attn_config: DistAttnConfig | None = None,
    prepared: PreparedDispatch | None = None,
) -> dict[str, Any]:
    """Replace Megatron's `get_batch_on_this_cp_rank`: plan attention and keep this rank's tokens.

    Args:
        batch: Megatron's global micro-batch, `[1, seq]` tensors: `tokens`, and optionally `labels`
            (already shifted, Megatron's convention) and `loss_mask`; `attention_mask` is dropped.
        cp_group: the magi context-parallel ProcessGroup (or 1-D DeviceMesh).
        num_heads_q, num_heads_kv, head_dim: per tensor-parallel partition.
        cu_seqlens: document boundaries of a packed sequence (`[0, ..., seq]`): each document causal and
            alone, RoPE positions restart per document (`labels`/`loss_mask` should then ignore document
            ends, as Megatron's datasets do with `eod_mask_loss`). None: one causal sequence, global positions.
        dist_attn_config: magi-attention settings (`DistAttnConfig()` if None).
        prepared: this batch's dispatch solved ahead, e.g. in a data-loader worker:
            `magi_attention.api.prepare_varlen_dispatch(cu, cu, cp_size, causal=True, dist_attn_config=...)`
            with `cu` = `cu_seqlens` (or `[0, seq]`) and this call's config. Adopted before the key is built,
            so the key takes it instead of solving. One solved for another cp size or token count raises
            `ValueError`; one for another batch of the same size or another config is not used (the key
            solves its own, with the same result).

    Returns the batch with local `[1, local_tokens]` tensors (padding: token 0, loss_mask 0), `position_ids`,
    `num_tokens` (loss_mask sum of the whole batch) and `magi_key`.
    """
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must be [1, seq] (micro-batch size 1), got {tuple(tokens.shape)}")
    total = tokens.shape[1]
    cu = [0, total] if cu_seqlens is None else cu_seqlens_list(cu_seqlens, total=total)
    if prepared is not None:  # errors before the key's collectives
        cp_size = (
            dist.get_world_size(_group(cp_group)) if dist.is_available() and dist.is_initialized() else 1
        )
        adopt_dispatch(prepared, cp_size=cp_size, total_seqlen=total)
    key = magi_attn_varlen_key(
        cu, cu, num_heads_q, num_heads_kv, head_dim, cp_group, causal=True, dist_attn_config=dist_attn_config
    )
    device = tokens.device
    valid = dispatch(torch.ones(total, dtype=torch.bool, device=device), key)
    pos = get_position_ids(key).to(device)
    if cu_seqlens is not None:
        cu_t = torch.tensor(cu, dtype=torch.long, device=device)
        pos = pos - cu_t[(torch.searchsorted(cu_t, pos, right=True) - 1).clamp(max=len(cu) - 2)]
    pos = torch.where(valid, pos, 0)
    out: dict[str, Any] = {
        "tokens": dispatch(tokens[0], key)[None],
        "position_ids": pos[None],
        "magi_key": key,
    }
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = torch.ones(1, total, device=device)
    out["loss_mask"] = (dispatch(loss_mask[0], key) * valid)[None]
    out["num_tokens"] = loss_mask.sum()
    if batch.get("labels") is not None:
        out["labels"] = dispatch(batch["labels"][0], key)[None]
    out["attention_mask"] = None
    _CURRENT.key = key
    _CURRENT.position_ids = pos
    out["cp_group"] = cp_group
    return out


def _group(cp_group: Any):
    if cp_group is not None and hasattr(cp_group, "get_group"):
        return cp_group.get_group()
    return cp_group


def magi_loss(per_token_loss: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """Token mean of `per_token_loss` (`[1, local_tokens]`, GPTModel's output with `labels`) over the whole
    batch: the value is reduced over the cp group; the gradient is this rank's share (sum it over cp:
    `all_reduce_gradients`, or Megatron DDP over a group that includes the cp ranks)."""
    mask = batch["loss_mask"].to(per_token_loss.dtype)
    local = (per_token_loss * mask).sum() / batch["num_tokens"].to(per_token_loss.dtype).clamp_min(1)
    total = local.detach().clone()
    group = _group(batch.get("cp_group"))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return local + (total - local.detach())


def all_reduce_gradients(model: nn.Module, cp_group: Any) -> None:
    """Sum parameter gradients over the cp group (replicated parameters, no DDP)."""
    _all_reduce_gradients(model, _group(cp_group))


def undispatch_output(local: torch.Tensor, key: Any) -> torch.Tensor:
    """`[1, local_tokens, ...]` (e.g. logits, batch first as GPTModel returns them) -> `[1, seq, ...]`."""
    return undispatch(local[0], key)[None]
