"""HF Transformers with magi-attention in deterministic mode: the same training twice gives the same bits.
What it measures and how to run it: docs/benchmarks/cases.md (hf-deterministic)."""

import os

# cuBLAS needs its workspace fixed before CUDA starts for deterministic GEMMs (torch raises otherwise)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


import torch

from benchmarks.integration_runs import harness, hf_run

NAME = "hf_deterministic"


def train_once(family: str, cfg: harness.RunConfig, group) -> tuple[list[float], list[torch.Tensor], str]:
    """One training from the seed: per-step losses, the parameters afterwards, and the kernel `auto` chose."""
    from magi_attention_transformers import apply_magi_attention

    from magi_attention.api import clear_cache, get_kernel_backend

    clear_cache()  # the second training plans again, as a fresh process would
    model, _ = hf_run.build_model(family, cfg)
    batch = harness.packed_batch(cfg.tokens, model.config.vocab_size, seed=cfg.seed + 1, device=cfg.device)
    config = cfg.dist_attn_config()
    if not config.deterministic:
        raise SystemExit("DistAttnConfig() did not resolve deterministic=True under torch's switch")
    apply_magi_attention(model, group, dist_attn_config=config)
    keys = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    step, sync_grads = hf_run.magi_step(model, batch, group, keys)
    side = harness.train(model, step, optimizer, cfg.steps, cfg.device, sync_grads=sync_grads)
    chosen, reason = get_kernel_backend(keys[0], cfg.dtype)
    params = [p.detach().clone() for p in model.parameters()]
    return side.losses, params, f"{chosen.value} ({reason})"


def run_family(family: str, cfg: harness.RunConfig, group) -> dict:
    first_losses, first_params, backend = train_once(family, cfg, group)
    second_losses, second_params, _ = train_once(family, cfg, group)
    differing = [i for i, (a, b) in enumerate(zip(first_params, second_params)) if not torch.equal(a, b)]
    max_diff = max(((a.double() - b.double()).abs().max().item() for a, b in zip(first_params, second_params)),
                   default=0.0)  # fmt: skip
    ok = first_losses == second_losses and not differing
    return {"run": f"{NAME}/{family}", "ok": ok, "kernel_backend": backend, "losses_first": first_losses,
            "losses_second": second_losses, "parameters": len(first_params), "parameters_differing": differing,
            "max_parameter_abs_diff": max_diff}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    def body(cfg: harness.RunConfig, group) -> list[dict]:
        torch.use_deterministic_algorithms(True)
        return [run_family(family, cfg, group) for family in hf_run.FAMILIES]

    return harness.main(NAME, __doc__, argv, body, verdicts)


def verdicts(name: str, cfg: harness.RunConfig, results: list[dict]) -> int:
    """Each family's verdict printed, the report written; the exit status is 1 where the two trainings differ."""
    report = {"name": NAME, "device": str(cfg.device), "dtype": str(cfg.dtype), "steps": cfg.steps,
              "tokens": cfg.tokens, "versions": harness.versions(), "results": results}  # fmt: skip
    for r in results:
        verdict = "identical" if r["ok"] else "DIFFER"
        print(f"{r['run']:<28} {verdict:<9} losses {r['losses_first']} kernel {r['kernel_backend']}")
        if not r["ok"]:
            print(f"  second losses {r['losses_second']}; parameters differing: {r['parameters_differing']}"
                  f" (max |d| {r['max_parameter_abs_diff']:.3e})")  # fmt: skip
    harness.write_report(cfg, report)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(harness.run_module(__spec__.name))
