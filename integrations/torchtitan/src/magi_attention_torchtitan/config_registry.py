"""Config functions for torchtitan's command line: `--module magi_attention_torchtitan --config <name>`.

    torchrun --nproc-per-node 2 -m torchtitan.train --module magi_attention_torchtitan \
        --config magi_llama3_tiny --parallelism.context_parallel_degree 2

Every function returns a `MagiTrainer.Config`; any field can be overridden on the command line as usual
(`--training.seq_len 8192`, `--magi.rope_positions global`, ...).
"""

from __future__ import annotations

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import ParallelismConfig, TrainingConfig

from .data import SyntheticDocumentsDataLoader, tokenizer_path
from .models import magi_model_spec
from .trainer import MagiTrainer

__all__ = [
    "magi_llama3_debugmodel",
    "magi_llama3_tiny",
    "magi_qwen3_debugmodel",
    "magi_qwen3_tiny",
    "magi_trainer_config",
]


def magi_trainer_config(
    model: str, flavor: str, *, training: TrainingConfig, lr: float
) -> MagiTrainer.Config:
    """A `MagiTrainer.Config` for `magi_model_spec(model, flavor)` on the synthetic documents.

    The tokenizer is the one shipped here (`tokenizer_path()`), the loss torchtitan's token-mean cross
    entropy, the optimizer AdamW with 2 warm-up steps, FSDP2 on the "partial_dtensor" backend, no activation
    checkpointing, metrics logged every step. Replace `dataloader` and `hf_assets_path` to train on real data.
    """
    model_spec = magi_model_spec(model, flavor)
    return MagiTrainer.Config(
        model_spec=model_spec,
        hf_assets_path=tokenizer_path(),
        dataloader=SyntheticDocumentsDataLoader.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size),
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=training,
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        activation_checkpoint=None,
        metrics=MetricsProcessor.Config(log_freq=1),
    )


def _cpu_training(steps: int) -> TrainingConfig:
    # float32 throughout: bfloat16 on CPUs is slow and gloo reduces it no faster
    return TrainingConfig(
        local_batch_size=2,
        seq_len=256,
        steps=steps,
        mixed_precision_param="float32",
        disable_cuda_graphs=True,
    )


def magi_llama3_tiny() -> MagiTrainer.Config:
    """Llama 3 "tiny" (dim 64, 2 layers) on synthetic documents, 2 x 256 tokens per step, 30 steps: runs on CPUs."""
    return magi_trainer_config("llama3", "tiny", training=_cpu_training(30), lr=1e-2)


def magi_qwen3_tiny() -> MagiTrainer.Config:
    """Qwen 3 "tiny" (dim 64, 2 layers, QK norm, tied embeddings) like `magi_llama3_tiny`."""
    return magi_trainer_config("qwen3", "tiny", training=_cpu_training(30), lr=1e-2)


def magi_llama3_debugmodel() -> MagiTrainer.Config:
    """torchtitan's Llama 3 "debugmodel" (dim 256, 6 layers) on synthetic documents, 8 x 2048 tokens per step."""
    training = TrainingConfig(local_batch_size=8, seq_len=2048, steps=10)
    return magi_trainer_config("llama3", "debugmodel", training=training, lr=8e-4)


def magi_qwen3_debugmodel() -> MagiTrainer.Config:
    """torchtitan's Qwen 3 "debugmodel" (dim 256, 8 layers) on synthetic documents, 8 x 2048 tokens per step."""
    training = TrainingConfig(local_batch_size=8, seq_len=2048, steps=10)
    return magi_trainer_config("qwen3", "debugmodel", training=training, lr=8e-4)
