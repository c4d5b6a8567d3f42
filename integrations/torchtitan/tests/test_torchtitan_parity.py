"""torchtitan's Llama 3 and Qwen 3 with magi attention at cp 2 and cp 3 (gloo, float64) equal a single-process
run of every document alone.

Each rank builds the model from `magi_model_spec` (torchtitan's modules, `MagiAttention` inside), shards it with
`apply_magi_fsdp` over the cp ranks, and trains 3 AdamW steps on batches of the synthetic documents (the shipped
tokenizer, torchtitan-style packing with documents cut across samples) prepared by `prepare_magi_input`, with
the loss of torchtitan's trainer (cross entropy summed over the rank's tokens, divided by the batch's
valid-token count; in float64 here, where torchtitan's computes in float32). The reference
is the same weights in the same torchtitan model with SDPA (causal) as inner attention, run on each document
alone. Compared: the first step's logits (undispatched), loss and gradients (full tensors of FSDP's shards), the
loss of every step and the final weights. A third launch forces the documents placement
(`MagiAttentionConfig(dispatch_alg="documents")`: these batches are too small for magi to choose it) and checks
every step's key used it; its batches come from the dataloader with `plan_in_dataloader`, each carrying its
dispatch solved in the dataloader's worker process, which `prepare_magi_input` hands to the key
(tests/test_plan_ahead.py checks that the key takes it).
"""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from magi_attention.testing import run_distributed

TOL = 1e-9
STEPS, BATCH, SEQ_LEN = 3, 2, 100
CASES = [("llama3", "document"), ("qwen3", "document"), ("llama3", "global")]


def _reference_model(model):
    from torchtitan.models.common.attention import BaseAttention, ScaledDotProductAttention

    config = copy.deepcopy(model.config)
    for _, attention, _, _ in config.traverse(BaseAttention.Config):
        attention.inner_attention = ScaledDotProductAttention.Config()
    ref = config.build()
    ref.load_state_dict(model.state_dict())
    return ref


def _reference_step(ref, input_dict, labels, rope_positions):
    """Every document alone through the SDPA model: packed logits `[B * L, vocab]` and the token-mean loss."""
    from magi_attention_torchtitan import document_cu_seqlens

    inputs, positions = input_dict["input"], input_dict["positions"]
    cu = document_cu_seqlens(positions, *inputs.shape)
    flat_ids, flat_labels = inputs.flatten(), labels.flatten()
    flat_pos = positions.flatten() if rope_positions == "document" else torch.arange(SEQ_LEN).repeat(BATCH)
    logits = [
        ref(flat_ids[s:e][None], positions=flat_pos[s:e][None], attention_masks=None)[0]
        for s, e in pairwise(cu)
    ]
    logits = torch.cat(logits)
    loss = F.cross_entropy(logits, flat_labels, ignore_index=-100, reduction="sum")
    return logits, loss / (flat_labels != -100).sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _magi_config(rope_positions: str, alg: str | None):
    from magi_attention_torchtitan import MagiAttentionConfig

    return MagiAttentionConfig(rope_positions=rope_positions, chunk_size=16, dispatch_alg=alg)


def _planned_batches(cp: int, alg: str | None, tokenizer) -> list:
    """The STEPS batches `_case` reads, from the dataloader with each batch's dispatch solved in its worker."""
    from magi_attention_torchtitan import SyntheticDocumentsDataLoader, plan_in_dataloader

    loader = SyntheticDocumentsDataLoader.Config(seed=7, min_doc_len=3, max_doc_len=60, num_workers=1).build(
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=BATCH
    )
    # rope positions do not change the dispatch
    plan_in_dataloader(loader, cp_size=cp, dist_attn_config=_magi_config("document", alg).dist_attn_config())
    return [batch for _, batch in zip(range(STEPS), loader)]


def _case(
    model_name: str, rope_positions: str, cp_mesh, tokenizer, alg: str | None, batches: list | None
) -> dict:
    from magi_attention_torchtitan import (
        MAGI_PREPARED,
        SyntheticDocumentsDataset,
        apply_magi_fsdp,
        magi_model_spec,
        prepare_magi_input,
    )

    from magi_attention.api import get_dispatch_choice, undispatch

    spec = magi_model_spec(model_name, "tiny")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = spec.model.build()
    model.init_weights()
    ref = _reference_model(model)
    apply_magi_fsdp(model, cp_mesh, param_dtype=torch.float64, reduce_dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    magi = _magi_config(rope_positions, alg)
    data = iter(
        SyntheticDocumentsDataset(
            tokenizer, seq_len=SEQ_LEN, seed=7, dp_rank=0, min_doc_len=3, max_doc_len=60
        )
    )
    out = {"losses": [], "ref_losses": [], "algs": set()}
    for step in range(STEPS):
        if batches is None:
            samples = [next(data) for _ in range(BATCH)]
            input_dict = {k: torch.stack([s[0][k] for s in samples]) for k in ("input", "positions")}
            labels = torch.stack([s[1] for s in samples])
        else:  # the same samples, batched by the dataloader, with their dispatch solved in its worker
            input_dict, labels = batches[step]
            assert set(input_dict) == {"input", "positions", MAGI_PREPARED}, sorted(input_dict)
        global_valid_tokens = (labels != -100).sum()
        inputs, local_labels, extra = prepare_magi_input(
            input_dict, labels, cp_mesh=cp_mesh, model_config=spec.model, magi_config=magi
        )
        out["algs"].add(get_dispatch_choice(extra["attention_masks"].key).algorithm)
        pred = model(inputs, **extra)
        # torchtitan's loss (sum over this rank's tokens / the batch's valid tokens), kept in float64 here:
        # torchtitan's cross_entropy_loss computes in float32
        loss = (
            F.cross_entropy(pred[0], local_labels[0], ignore_index=-100, reduction="sum")
            / global_valid_tokens
        )
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each cp rank's loss is its tokens' share of the batch mean
        out["losses"].append(total.item())

        ref_logits, ref_loss = _reference_step(ref, input_dict, labels, rope_positions)
        ref_loss.backward()
        out["ref_losses"].append(ref_loss.item())
        if step == 0:
            key = extra["attention_masks"].key
            out["logits"] = _rel(undispatch(pred[0].detach(), key), ref_logits.detach())
            out["grad"] = max(
                _rel(p.grad.full_tensor(), r.grad) for p, r in zip(model.parameters(), ref.parameters())
            )
            out["shard_tokens"] = inputs.shape[1]
            out["sharded"] = any(p.to_local().shape != p.shape for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    out["weights"] = max(
        _rel(p.detach().full_tensor(), r.detach()) for p, r in zip(model.parameters(), ref.parameters())
    )
    return out


def _rank_main(rank: int, world_size: int, alg: str | None, batches: list | None) -> dict:
    from magi_attention_torchtitan import tokenizer_path
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    torch.set_default_dtype(torch.float64)
    cp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    tokenizer = HuggingFaceTokenizer(tokenizer_path=tokenizer_path())
    return {f"{m}-{r}": _case(m, r, cp_mesh, tokenizer, alg, batches) for m, r in CASES}


# magi's own choice at cp 2 and 3; the documents placement forced once, with the dispatch planned in the
# dataloader's worker
@pytest.mark.parametrize(
    ("cp", "alg", "plan_ahead"), [(2, None, False), (3, None, False), (2, "documents", True)]
)
def test_magi_cp_matches_single_process_per_document(cp: int, alg: str | None, plan_ahead: bool) -> None:
    batches = None
    if plan_ahead:
        from magi_attention_torchtitan import tokenizer_path
        from torchtitan.components.tokenizer import HuggingFaceTokenizer

        batches = _planned_batches(cp, alg, HuggingFaceTokenizer(tokenizer_path=tokenizer_path()))
    results = run_distributed(_rank_main, cp, alg, batches)
    for name in (f"{m}-{r}" for m, r in CASES):
        runs = [r[name] for r in results]
        r0 = runs[0]
        print(cp, alg, name, {k: v for k, v in r0.items() if k != "ref_losses"})
        if alg is not None:
            assert all(r["algs"] == {alg} for r in runs), f"{name}: placed by {[r['algs'] for r in runs]}"
        assert all(r["losses"] == r0["losses"] for r in runs), f"{name}: ranks disagree on the loss"
        for got, want in zip(r0["losses"], r0["ref_losses"]):
            assert abs(got - want) <= TOL * abs(want), f"{name}: losses {r0['losses']} vs {r0['ref_losses']}"
        assert r0["logits"] < TOL, f"{name}: logits rel. error {r0['logits']}"
        assert r0["grad"] < TOL, f"{name}: gradient rel. error {r0['grad']}"
        assert r0["weights"] < TOL, f"{name}: weights after {STEPS} steps rel. error {r0['weights']}"
        # the batch really was split: each rank holds about 1/cp of the 200 tokens, and FSDP shards the weights
        assert r0["shard_tokens"] <= -(-BATCH * SEQ_LEN // (16 * cp)) * 16, r0["shard_tokens"]
        assert r0["sharded"]
