"""torchtitan's Llama 3 and Qwen 3 with magi-attention context parallelism over packed documents.

The main entry point is the command line, through this package's config functions::

    torchrun --nproc-per-node 4 -m torchtitan.train --module magi_attention_torchtitan \
        --config magi_llama3_tiny --parallelism.context_parallel_degree 2

Pieces, for your own config functions: `magi_model_spec` (torchtitan's model config with `MagiAttention` as
inner attention, `parallelize_magi` as parallelize function), `MagiTrainer` (dispatches each batch with
`dispatch_batch`: one magi key per batch from its documents), `plan_in_dataloader` (each batch's dispatch
solved in the dataloader's workers), `SyntheticDocumentsDataLoader` and `tokenizer_path` (offline data).
"""

from importlib.metadata import version as _version

# first: on a torch too old for torchtitan 0.3.0 this raises before any module below imports torchtitan
from . import _torch_requirement  # noqa: F401
from .attention import MagiAttention, MagiAttentionConverter, MagiAttentionMask
from .batch import (
    IGNORE_INDEX,
    MAGI_PREPARED,
    MagiBatch,
    PlanAheadCollate,
    RopePositions,
    dispatch_batch,
    document_cu_seqlens,
    plan_batch_ahead,
    plan_in_dataloader,
)
from .data import SyntheticDocumentsDataLoader, SyntheticDocumentsDataset, synthetic_document, tokenizer_path
from .models import MODELS, magi_model_spec, model_flavors
from .parallelize import apply_magi_fsdp, fsdp_mesh, parallelize_magi
from .trainer import MagiAttentionConfig, MagiTrainer, attention_shapes, prepare_magi_input

__version__ = _version("magi-attention-torchtitan")

__all__ = [
    "IGNORE_INDEX",
    "MAGI_PREPARED",
    "MODELS",
    "MagiAttention",
    "MagiAttentionConfig",
    "MagiAttentionConverter",
    "MagiAttentionMask",
    "MagiBatch",
    "MagiTrainer",
    "PlanAheadCollate",
    "RopePositions",
    "SyntheticDocumentsDataLoader",
    "SyntheticDocumentsDataset",
    "__version__",
    "apply_magi_fsdp",
    "attention_shapes",
    "dispatch_batch",
    "document_cu_seqlens",
    "fsdp_mesh",
    "magi_model_spec",
    "model_flavors",
    "parallelize_magi",
    "plan_batch_ahead",
    "plan_in_dataloader",
    "prepare_magi_input",
    "synthetic_document",
    "tokenizer_path",
]
