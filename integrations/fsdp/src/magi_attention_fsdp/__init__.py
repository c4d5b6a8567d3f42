"""FSDP2 with magi-attention context parallelism over a (dp, cp) DeviceMesh.

Parameters are sharded over the flattened dp x cp ranks (cp ranks hold the same model, so they shard it
like data-parallel ranks); the data is split by dp (each dp replica reads its own pack of documents) and
the sequence by cp (magi dispatch). Gradients are reduced as a sum over cp and a mean over dp, so a
(dp, cp) step equals a single-process step on the dp packs (the loss being the mean of their pack means).

    mesh = init_dp_cp_mesh(dp=2, cp=2)
    fully_shard_dp_cp(model, mesh, blocks=model.blocks)
    shard = dispatch_pack(tokens, mesh, cu_seqlens=cu, num_heads_q=hq, num_heads_kv=hkv, head_dim=d)
    logits = model(shard.input_ids, shard.position_ids, shard.key)   # attention: calc_attn(q, k, v, key)
    pack_loss(logits, shard).backward()
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from magi_attention.api import dispatch, get_position_ids, magi_attn_varlen_key, undispatch
from magi_attention.config import DistAttnConfig
from magi_attention.helpers import cu_seqlens_list

__all__ = [
    "PackShard",
    "dispatch_pack",
    "fully_shard_dp_cp",
    "init_dp_cp_mesh",
    "pack_loss",
    "undispatch_pack",
]

IGNORE_INDEX = -100


def init_dp_cp_mesh(dp: int, cp: int, device_type: str | None = None) -> DeviceMesh:
    """A 2-D DeviceMesh with dims ("dp", "cp") over all ranks (world size must be dp * cp).

    Ranks r and r+1 are cp neighbours (cp is the inner dim: keep it inside a node on GPUs).
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def _check_mesh(mesh: Any) -> None:
    if (
        not isinstance(mesh, DeviceMesh)
        or mesh.mesh_dim_names is None
        or set(mesh.mesh_dim_names) != {"dp", "cp"}
    ):
        raise ValueError("mesh must be a 2-D DeviceMesh with dims ('dp', 'cp'); use init_dp_cp_mesh(dp, cp)")


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for m in model.modules() if isinstance(m, nn.ModuleList) for block in m]


def fully_shard_dp_cp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: Iterable[nn.Module] | None = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """Apply FSDP2 `fully_shard` to each block and to the root, over the flattened dp x cp ranks.

    Args:
        model: the model, identical on every rank (e.g. built after the same `torch.manual_seed`).
        mesh: from `init_dp_cp_mesh` (dims "dp", "cp").
        blocks: the submodules to shard one by one (transformer layers); default: every element of every
            `nn.ModuleList` in the model.
        fully_shard_kwargs: passed to `fully_shard` (`mp_policy`, `reshard_after_forward`, ...).

    Gradient reduction divides by dp only: cp ranks hold shares of one pack's gradient (summed), dp ranks
    hold different packs (averaged). Returns the model (now an `FSDPModule`).
    """
    _check_mesh(mesh)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    for block in list(blocks) if blocks is not None else _default_blocks(model):
        fully_shard(block, mesh=dp_cp, **fully_shard_kwargs)
    fully_shard(model, mesh=dp_cp, **fully_shard_kwargs)
    dp = mesh["dp"].size()
    # A custom divide factor becomes a PREMUL_SUM reduction for fp32/bf16, which only NCCL has: elsewhere
    # (gloo on CPUs) FSDP must scale separately and reduce with a plain sum.
    force_sum = dist.get_backend(dp_cp.get_group()) != "nccl"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dp))
            if force_sum and hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    return model


@dataclass
class PackShard:
    """This rank's share of one packed sequence (the pack of its dp replica, split over cp)."""

    input_ids: torch.Tensor
    """`[local_tokens]` this rank's tokens (padding rows hold token 0)."""
    position_ids: torch.Tensor
    """`[local_tokens]` RoPE positions: index within the document (`positions="document"`) or within the
    pack (`positions="global"`)."""
    labels: torch.Tensor
    """`[local_tokens]` next token within the document; -100 at document ends, ignored labels, padding."""
    key: Any
    """The magi-attention key: pass it to `calc_attn` in every attention layer."""
    num_label_tokens: int
    """Targets != -100 in the whole pack (same on every cp rank)."""
    cp_group: Any = field(default=None, repr=False)


def dispatch_pack(
    input_ids: torch.Tensor,
    mesh: DeviceMesh,
    *,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    cu_seqlens: Any = None,
    labels: torch.Tensor | None = None,
    positions: str = "document",
    dist_attn_config: DistAttnConfig | None = None,
) -> PackShard:
    """Plan causal per-document attention for this dp replica's pack and keep this cp rank's tokens.

    Args:
        input_ids: `[total_tokens]` (or `[1, total_tokens]`), the same on the cp ranks of a dp replica.
        mesh: from `init_dp_cp_mesh`; the sequence is split over `mesh["cp"]`.
        num_heads_q, num_heads_kv, head_dim: the model's attention shapes.
        cu_seqlens: `[0, ..., total_tokens]` document boundaries; None: one document.
        labels: targets aligned with `input_ids` (shifted here, within each document); None: `input_ids`.
        positions: "document" (restart at each document) or "global" (index in the pack).
        dist_attn_config: magi-attention settings (default `DistAttnConfig()`).
    """
    _check_mesh(mesh)
    if positions not in ("document", "global"):
        raise ValueError(f"positions must be 'document' or 'global', got {positions!r}")
    ids = input_ids[0] if input_ids.ndim == 2 and input_ids.shape[0] == 1 else input_ids
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(
            f"input_ids must be one non-empty packed sequence, got shape {tuple(input_ids.shape)}"
        )
    total = ids.shape[0]
    cu = [0, total] if cu_seqlens is None else cu_seqlens_list(cu_seqlens, total=total)
    cp_mesh = mesh["cp"]
    key = magi_attn_varlen_key(
        cu, cu, num_heads_q, num_heads_kv, head_dim, cp_mesh, causal=True, dist_attn_config=dist_attn_config
    )
    device = ids.device
    cu_t = torch.tensor(cu, dtype=torch.long, device=device)
    source = ids if labels is None else (labels[0] if labels.ndim == 2 else labels).to(device)
    targets = torch.full((total,), IGNORE_INDEX, dtype=torch.long, device=device)
    targets[:-1] = source[1:]
    targets[cu_t[1:][cu_t[1:] > cu_t[:-1]] - 1] = IGNORE_INDEX

    valid = dispatch(torch.ones(total, dtype=torch.bool, device=device), key)
    pos = get_position_ids(key).to(device)
    if positions == "document":
        doc = (torch.searchsorted(cu_t, pos, right=True) - 1).clamp(max=len(cu) - 2)
        pos = pos - cu_t[doc]
    return PackShard(
        input_ids=dispatch(ids, key),
        position_ids=torch.where(valid, pos, 0),
        labels=dispatch(targets, key).masked_fill(~valid, IGNORE_INDEX),
        key=key,
        num_label_tokens=int((targets != IGNORE_INDEX).sum()),
        cp_group=cp_mesh.get_group(),
    )


def pack_loss(local_logits: torch.Tensor, shard: PackShard) -> torch.Tensor:
    """Token-mean cross entropy of the whole pack from this rank's logits `[local_tokens, vocab]`.

    The value is the pack's mean loss (all-reduced over cp, for logging); the gradient is this rank's
    share, which FSDP's reduction (sum over cp, mean over dp, set by `fully_shard_dp_cp`) completes.
    """
    logits = local_logits.float() if local_logits.dtype in (torch.float16, torch.bfloat16) else local_logits
    local = F.cross_entropy(logits, shard.labels, ignore_index=IGNORE_INDEX, reduction="sum")
    local = local / max(shard.num_label_tokens, 1)
    total = local.detach().clone()
    if dist.get_world_size(shard.cp_group) > 1:
        dist.all_reduce(total, group=shard.cp_group)
    return local + (total - local.detach())


def undispatch_pack(local: torch.Tensor, shard: PackShard) -> torch.Tensor:
    """`[local_tokens, ...]` -> `[total_tokens, ...]` in pack order (autograd), e.g. logits for evaluation."""
    return undispatch(local, shard.key)
