"""The model spec's `parallelize_fn`: activation checkpointing and FSDP2 over the data x context ranks.

Context parallelism is not applied to the model here: magi owns the sequence split (the trainer dispatches each
batch, `MagiAttention` exchanges keys and values). The cp ranks hold the same model, so FSDP shards it over
dp_shard x cp together (torchtitan's "fsdp" mesh), exactly as torchtitan does for its own context parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

__all__ = ["apply_magi_fsdp", "fsdp_mesh", "parallelize_magi"]


def _check_supported(
    parallel_dims: ParallelDims, parallelism: ParallelismConfig, compile_config: CompileConfig
):
    unsupported = {
        "tensor_parallel_degree": parallel_dims.tp,
        "pipeline_parallel_degree": parallel_dims.pp,
        "expert_parallel_degree": parallel_dims.ep,
    }
    for name, degree in unsupported.items():
        if degree > 1:
            raise NotImplementedError(
                f"parallelism.{name}={degree}: magi-attention-torchtitan supports data parallelism (FSDP / HSDP) "
                "and context parallelism only; set it to 1"
            )
    if parallelism.spmd_backend != "partial_dtensor":
        raise ValueError(
            f"parallelism.spmd_backend={parallelism.spmd_backend!r}: magi-attention-torchtitan shards the model "
            "with FSDP on torchtitan's 'fsdp' mesh, which only the 'partial_dtensor' backend builds; "
            "set --parallelism.spmd_backend partial_dtensor (the config functions of this package do)"
        )
    if compile_config.enable and "model" in compile_config.components:
        raise NotImplementedError(
            "compile.enable with 'model' in compile.components: the model is not compiled with magi attention "
            "here; leave 'model' out of --compile.components"
        )


def fsdp_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The mesh FSDP shards over: dp_shard x cp flattened ("fsdp"), with "dp_replicate" in front for HSDP."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    return parallel_dims.get_mesh(names)


def apply_magi_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward_policy: str = "default",
    enable_symm_mem: bool = False,
) -> nn.Module:
    """FSDP2 on a torchtitan decoder (each block, embeddings, norm + head) over `mesh`, gradients summed.

    torchtitan's losses are already divided by the global token count, so FSDP's own gradient division is
    off (torchtitan's `apply_fsdp_to_decoder`): each rank's gradient is its share of the global mean, and the
    reduce-scatter sums the shares of every dp and cp rank.

    Args:
        model: a torchtitan `Decoder` (meta or materialised), the same on every rank.
        mesh: from `fsdp_mesh`.
        param_dtype, reduce_dtype: FSDP mixed precision (compute / gradient-reduction dtypes).
        cpu_offload, reshard_after_forward_policy, enable_symm_mem: as in torchtitan's `apply_fsdp_to_decoder`.

    Returns:
        The model, now an `FSDPModule`.
    """
    apply_fsdp_to_decoder(
        model,
        mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        pp_enabled=False,
        cpu_offload=cpu_offload,
        reshard_after_forward_policy=reshard_after_forward_policy,
        enable_symm_mem=enable_symm_mem,
    )
    # A gradient divide factor, even 1, becomes a PREMUL_SUM reduction that only NCCL has: with other
    # backends (gloo on CPUs) FSDP must reduce with a plain sum.
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    if any(dist.get_backend(group) != "nccl" for group in groups):
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def parallelize_magi(
    model: nn.Module,
    *,
    parallel_dims: ParallelDims,
    training: TrainingConfig,
    parallelism: ParallelismConfig,
    compile_config: CompileConfig,
    ac_config: ActivationCheckpointingConfig,
    dump_folder: str,
) -> nn.Module:
    """torchtitan `ParallelizeFunction` for models with magi attention: activation checkpointing, then FSDP2.

    Raises NotImplementedError for tensor, pipeline and expert parallelism and for a compiled model, and
    ValueError unless `parallelism.spmd_backend` is "partial_dtensor".
    """
    _check_supported(parallel_dims, parallelism, compile_config)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    return apply_magi_fsdp(
        model,
        fsdp_mesh(parallel_dims),
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
