"""HF Transformers with magi-attention against Transformers' own SDPA attention, one process.
What it measures and how to run it: docs/benchmarks/cases.md (hf)."""

import copy
from collections.abc import Callable

import torch

from benchmarks.integration_runs import harness

NAME = "hf"
FAMILIES = ("llama", "qwen2_swa")


def build_model(family: str, cfg: harness.RunConfig) -> tuple[torch.nn.Module, int]:
    """The random-initialised model (same seed: same weights) on the run's device and dtype, and its window."""
    import transformers as tf

    s = cfg.shapes
    shapes = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                  num_hidden_layers=s["layers"], num_attention_heads=s["heads_q"], num_key_value_heads=s["heads_kv"],
                  max_position_embeddings=32768, initializer_range=0.02)  # fmt: skip
    window = 16 if cfg.tiny else 1024
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


def magi_step(model: torch.nn.Module, batch: harness.PackedBatch, group, keys: list) -> tuple[Callable, Callable]:  # fmt: skip
    """A training step of `model` (magi attention applied) as the integration's docs show: the forward
    (`dispatch_batch`, the model, `causal_lm_loss`; each step's runtime key goes to `keys`) and the gradient
    sync after its backward (`all_reduce_gradients`)."""
    from magi_attention_transformers import all_reduce_gradients, causal_lm_loss, dispatch_batch

    def step() -> torch.Tensor:
        local = dispatch_batch(batch.input_ids, group, cu_seqlens=batch.cu_seqlens)
        keys.append(local.key)
        logits = model(input_ids=local.input_ids, position_ids=local.position_ids).logits
        return causal_lm_loss(logits, local)

    return step, lambda: all_reduce_gradients(model, group)


def run_family(family: str, cfg: harness.RunConfig, group) -> dict:
    from magi_attention_transformers import apply_magi_attention

    model, window = build_model(family, cfg)
    ref = copy.deepcopy(model)  # the same initial weights, Transformers' own SDPA attention
    batch = harness.packed_batch(cfg.tokens, model.config.vocab_size, seed=cfg.seed + 1, device=cfg.device)
    apply_magi_attention(model, group, dist_attn_config=cfg.dist_attn_config())
    keys = []

    def ref_step() -> torch.Tensor:
        logits = ref(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        return harness.token_mean_loss(logits, batch.labels)

    step, sync_grads = magi_step(model, batch, group, keys)
    magi, reference = harness.train_pair(model, step, ref, ref_step, cfg, sync_grads=sync_grads)
    label = "SDPA, per-document position_ids" + (f", window {window} on layer 1" if family == "qwen2_swa" else "")  # fmt: skip
    return harness.compare(
        f"{NAME}/{family}", cfg, batch, magi, reference, ref_label=label, key=keys[0], extra={"window": window},
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    return harness.main(NAME, __doc__, argv, lambda cfg, group: [run_family(f, cfg, group) for f in FAMILIES])


if __name__ == "__main__":
    raise SystemExit(harness.run_module(__spec__.name))
