"""HF Transformers with magi-attention against Transformers' own SDPA attention, one process.

Two random-initialised models, each trained a few AdamW steps twice from the same weights on the same packed
batch of documents: Llama, and Qwen2 with one sliding-window layer (`layer_types`). magi's side goes through
`magi_attention_transformers` as its docs show (`apply_magi_attention`, `dispatch_batch` every step,
`causal_lm_loss`, `all_reduce_gradients`); the reference is the model with `attn_implementation="sdpa"` on the
whole pack with per-document `position_ids`, from which Transformers builds the per-document causal (and
sliding-window) mask itself.

    python -m benchmarks.integration_runs.hf_run                  # GPU: bf16, NCCL world 1, 12288 tokens
    python -m benchmarks.integration_runs.hf_run --device cpu     # CPU smoke run: float64, gloo, a toy model
"""

from __future__ import annotations

import copy
import sys

import torch

from benchmarks.integration_runs import harness

NAME = "hf"
FAMILIES = ("llama", "qwen2_swa")


def build_model(family: str, cfg: harness.RunConfig) -> tuple[torch.nn.Module, int]:
    """The random-initialised model (same seed: same weights) on the run's device and dtype, and its window."""
    import transformers as tf

    if cfg.tiny:
        shapes = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        window = 16
    else:  # head_dim 128, GQA 8:2: the shapes FA4 and cuDNN run
        shapes = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
        window = 1024
    shapes.update(max_position_embeddings=32768, initializer_range=0.02)
    if family == "llama":
        config = tf.LlamaConfig(**shapes)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2_swa":  # layer 1 slides over `window` tokens, the others see the whole document
        layers = ["full_attention"] * shapes["num_hidden_layers"]
        layers[1] = "sliding_attention"
        config = tf.Qwen2Config(**shapes, use_sliding_window=True, sliding_window=window, layer_types=layers)
        cls = tf.Qwen2ForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    model = cls(config).to(device=cfg.device, dtype=cfg.dtype)
    return model, window


def run_family(family: str, cfg: harness.RunConfig, group) -> dict:
    from magi_attention_transformers import (
        all_reduce_gradients,
        apply_magi_attention,
        causal_lm_loss,
        dispatch_batch,
    )

    from magi_attention.api import get_kernel_backend
    from magi_attention.config import DistAttnConfig

    model, window = build_model(family, cfg)
    ref = copy.deepcopy(model)  # the same initial weights, Transformers' own SDPA attention
    batch = harness.packed_batch(cfg.tokens, model.config.vocab_size, seed=cfg.seed + 1, device=cfg.device)
    dist_attn_config = DistAttnConfig(kernel_backend=cfg.kernel_backend)
    apply_magi_attention(model, group, dist_attn_config=dist_attn_config)

    keys = []

    def magi_step() -> torch.Tensor:
        local = dispatch_batch(batch.input_ids, group, cu_seqlens=batch.cu_seqlens)
        keys.append(local.key)
        logits = model(input_ids=local.input_ids, position_ids=local.position_ids).logits
        loss = causal_lm_loss(logits, local)
        loss.backward()
        all_reduce_gradients(model, group)
        return loss

    def ref_step() -> torch.Tensor:
        logits = ref(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        loss = harness.token_mean_loss(logits, batch.labels)
        loss.backward()
        return loss

    magi, reference = harness.train_pair(model, magi_step, ref, ref_step, cfg)
    backend, reason = get_kernel_backend(keys[0], cfg.dtype)
    label = "SDPA, per-document position_ids" + (
        f", window {window} on layer 1" if family == "qwen2_swa" else ""
    )
    return harness.compare(
        f"{NAME}/{family}", cfg, batch, magi, reference, ref_label=label,
        extra={"kernel_backend": backend.value, "kernel_reason": reason, "window": window},
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    cfg = harness.parse_args(NAME, __doc__, argv)
    group = harness.init_world_1(cfg.device)
    try:
        results = [run_family(family, cfg, group) for family in FAMILIES]
    finally:
        harness.close_world()
    return harness.finish(NAME, cfg, results)


if __name__ == "__main__":
    sys.exit(harness.exit_code(main()))
