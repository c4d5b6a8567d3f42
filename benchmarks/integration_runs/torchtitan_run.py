"""torchtitan's Llama 3 debug model with magi-attention against torchtitan's own SDPA attention per document.
What it measures and how to run it: docs/benchmarks/cases.md (torchtitan)."""

import copy
import sys
import traceback
from itertools import pairwise

import torch

from benchmarks.integration_runs import harness

NAME = "torchtitan"
IMPORT_FAILED = 3


def import_torchtitan() -> None:
    """Import torchtitan and the integration first, so that a version mismatch is the first thing reported."""
    try:
        import magi_attention_torchtitan  # noqa: F401
        import torchtitan  # noqa: F401
        from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: F401
    except Exception as exc:
        traceback.print_exc()
        print(f"\n{NAME}: torchtitan does not import here (torch {torch.__version__}, python "
              f"{sys.version.split()[0]}): {type(exc).__name__}: {exc}", flush=True)  # fmt: skip
        raise SystemExit(IMPORT_FAILED) from exc


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The same torchtitan model and weights with torchtitan's SDPA as every layer's inner attention."""
    from torchtitan.models.common.attention import BaseAttention, ScaledDotProductAttention

    config = copy.deepcopy(model.config)
    for _, attention, _, _ in config.traverse(BaseAttention.Config):
        attention.inner_attention = ScaledDotProductAttention.Config()
    ref = config.build()
    ref.load_state_dict(model.state_dict())
    return ref


def run_comparison(cfg: harness.RunConfig, group) -> list[dict]:
    import_torchtitan()
    from magi_attention_torchtitan import apply_magi_fsdp, attention_shapes, dispatch_batch, magi_model_spec
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.loss import CrossEntropyLoss

    default_dtype = torch.get_default_dtype()
    try:
        flavor = "tiny" if cfg.tiny else "debugmodel"
        spec = magi_model_spec("llama3", flavor)
        # fp32 master weights and bf16 compute on a GPU (torchtitan's FSDP mixed precision), float64 on a CPU
        master_dtype = torch.float32 if cfg.device.type == "cuda" else cfg.dtype
        torch.set_default_dtype(master_dtype)
        torch.manual_seed(cfg.seed)
        with cfg.device:
            model = spec.model.build()
        model.init_weights()
        with cfg.device:
            ref = reference_model(model)
        fsdp_mesh = init_device_mesh(cfg.device.type, (1,), mesh_dim_names=("fsdp",))
        cp_mesh = init_device_mesh(cfg.device.type, (1,), mesh_dim_names=("cp",))
        for m in (model, ref):
            apply_magi_fsdp(m, fsdp_mesh, param_dtype=cfg.dtype, reduce_dtype=master_dtype)
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=spec.model.vocab_size).build()

        batch = harness.packed_batch(cfg.tokens, spec.model.vocab_size, seed=cfg.seed + 1, device=cfg.device)
        valid_tokens = (batch.labels != harness.IGNORE_INDEX).sum()
        num_heads_q, num_heads_kv, head_dim = attention_shapes(spec.model)
        dist_attn_config = cfg.dist_attn_config()
        keys = []

        def magi_step() -> torch.Tensor:
            local = dispatch_batch(
                batch.input_ids, batch.labels, positions=batch.position_ids, cp_mesh=cp_mesh,
                num_heads_q=num_heads_q, num_heads_kv=num_heads_kv, head_dim=head_dim,
                rope_positions="document", dist_attn_config=dist_attn_config,
            )  # fmt: skip
            keys.append(local.attention_masks.key)
            pred = model(local.input_ids, positions=local.positions, attention_masks=local.attention_masks)
            return loss_fn(pred, local.labels, valid_tokens)[0]

        def ref_step() -> torch.Tensor:
            ids, pos = batch.input_ids[0], batch.position_ids[0]
            preds = [ref(ids[s:e][None], positions=pos[s:e][None], attention_masks=None) for s, e in pairwise(batch.cu_seqlens)]  # fmt: skip
            return loss_fn(torch.cat(preds, dim=1), batch.labels, valid_tokens)[0]

        magi, reference = harness.train_pair(model, magi_step, ref, ref_step, cfg, grad_of=lambda g: g.full_tensor())  # fmt: skip
        result = harness.compare(
            NAME, cfg, batch, magi, reference, ref_label=f"torchtitan's SDPA on each document (llama3 {flavor})",
            key=keys[0], extra={"flavor": flavor,
                                "shapes": {"heads_q": num_heads_q, "heads_kv": num_heads_kv, "head_dim": head_dim}},
        )  # fmt: skip
    finally:
        torch.set_default_dtype(default_dtype)
    return [result]


def main(argv: list[str] | None = None) -> dict:
    return harness.main(NAME, __doc__, argv, run_comparison)


if __name__ == "__main__":
    raise SystemExit(harness.run_module(__spec__.name))
