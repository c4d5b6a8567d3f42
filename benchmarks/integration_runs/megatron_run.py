"""Megatron-core GPTModel with magi-attention against Megatron's local core attention per document.
What it measures and how to run it: docs/benchmarks/cases.md (megatron)."""

import contextlib
import warnings
from itertools import pairwise
from unittest import mock

import torch

from benchmarks.integration_runs import harness

NAME = "megatron"


def build_model(spec, cfg: harness.RunConfig, shapes: dict) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=shapes["layers"], hidden_size=shapes["hidden"], num_attention_heads=shapes["heads_q"],
        num_query_groups=shapes["heads_kv"], ffn_hidden_size=shapes["ffn"], use_cpu_initialization=True,
        params_dtype=cfg.dtype, bf16=cfg.dtype == torch.bfloat16, add_bias_linear=False, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02,
        # the fused kernels need apex / Transformer Engine builds that a plain install lacks
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)  # built on the CPU from one seed: the same weights on both sides
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=shapes["vocab"],
        max_sequence_length=max(cfg.tokens, 4096), position_embedding_type="rope",
    )  # fmt: skip
    return model.to(cfg.device)


def _cpu_shims(device: torch.device) -> contextlib.AbstractContextManager:
    """What Megatron's local attention path assumes of a GPU, bridged for the CPU smoke run only: its
    RotaryEmbedding moves `inv_freq` to `torch.cuda.current_device()` at the first forward, and its
    DotProductAttention forks the CUDA RNG tracker (for dropout, 0 here) around the softmax."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    from megatron.core import tensor_parallel

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("torch.cuda.current_device", return_value="cpu"))
    stack.enter_context(mock.patch.object(tensor_parallel.get_cuda_rng_tracker(), "fork", contextlib.nullcontext))  # fmt: skip
    return stack


def run_comparison(cfg: harness.RunConfig, group) -> list[dict]:
    with warnings.catch_warnings():  # megatron-core warns at import about optional packages it lacks
        warnings.simplefilter("ignore")
        import magi_attention_megatron as mm
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    parallel_state.initialize_model_parallel(1, 1)
    if cfg.device.type == "cuda":  # the RNG states Megatron's layers fork (as its training scripts set them)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    try:
        shapes = cfg.shapes
        model = build_model(mm.magi_gpt_layer_spec(), cfg, shapes)
        mm.use_magi_rotary(model)
        ref = build_model(get_gpt_layer_local_spec(), cfg, shapes)
        mismatched = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]  # fmt: skip
        if mismatched:
            raise RuntimeError(f"the two models' initial weights differ: {mismatched[:4]}")

        batch = harness.packed_batch(cfg.tokens, shapes["vocab"], seed=cfg.seed + 1, device=cfg.device)
        # Megatron's convention: labels are the shifted tokens, a float loss_mask drops document ends
        loss_mask = (batch.labels != harness.IGNORE_INDEX).to(torch.float32)
        labels = batch.labels.clamp_min(0)
        dist_attn_config = cfg.dist_attn_config()
        head_dim = shapes["hidden"] // shapes["heads_q"]
        keys = []

        def magi_step() -> torch.Tensor:
            local = mm.get_batch_on_this_cp_rank_magi(
                {"tokens": batch.input_ids, "labels": labels, "loss_mask": loss_mask}, group,
                num_heads_q=shapes["heads_q"], num_heads_kv=shapes["heads_kv"], head_dim=head_dim,
                cu_seqlens=batch.cu_seqlens, dist_attn_config=dist_attn_config,
            )  # fmt: skip
            keys.append(local["magi_key"])
            per_token = model(input_ids=local["tokens"], position_ids=local["position_ids"],
                              attention_mask=None, labels=local["labels"])  # fmt: skip
            return mm.magi_loss(per_token, local)

        def ref_step() -> torch.Tensor:
            total = 0.0
            with _cpu_shims(cfg.device):
                for s, e in pairwise(batch.cu_seqlens):
                    # Megatron's convention (get_ltor_masks_and_position_ids): True where a query may not look
                    causal = torch.ones(e - s, e - s, dtype=torch.bool, device=cfg.device).triu(1)[None, None]
                    per_token = ref(input_ids=batch.input_ids[:, s:e], position_ids=batch.position_ids[:, s:e],
                                    attention_mask=causal, labels=labels[:, s:e])  # fmt: skip
                    total = total + (per_token * loss_mask[:, s:e].to(per_token.dtype)).sum()
            return total / loss_mask.sum()

        magi, reference = harness.train_pair(model, magi_step, ref, ref_step, cfg,
                                             sync_grads=lambda: mm.all_reduce_gradients(model, group))  # fmt: skip
        result = harness.compare(
            NAME, cfg, batch, magi, reference, ref_label="Megatron's local DotProductAttention on each document",
            key=keys[0], extra={"layer_spec": "local (no TE)"},
        )  # fmt: skip
    finally:
        parallel_state.destroy_model_parallel()
    return [result]


def main(argv: list[str] | None = None) -> dict:
    return harness.main(NAME, __doc__, argv, run_comparison)


if __name__ == "__main__":
    raise SystemExit(harness.run_module(__spec__.name))
