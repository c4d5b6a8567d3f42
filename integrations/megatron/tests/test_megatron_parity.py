"""Megatron-core GPTModel with MagiCoreAttention at cp 2 (CPU gloo, float64) equals the same model at cp 1.

Megatron runs with tensor/pipeline/context parallel size 1 on every rank; the magi cp group splits the
sequence. Reference: the same weights and batch through the same code with a one-rank cp group (magi at
cp size 1, one attention kernel over the whole mask). Compared: the token-mean loss and the parameter
gradients summed over the cp ranks, for a packed batch (per-document RoPE positions) and for one causal
sequence (global positions); then three Adam steps. A second launch forces the documents placement on
the cp 2 side (`DispatchConfig(alg="documents")`: these packs are too small for the planner to choose it)
and checks every key used it.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from magi_attention.config import DispatchConfig, DistAttnConfig
from magi_attention.testing import moved_to_next_rank, solved_elsewhere, token_ids_on_rank
from magi_attention.testing import run_distributed as run_ranks

TOL = 1e-6
VOCAB = 97
HQ, HKV, DIM = 4, 2, 32


def build_model():
    from magi_attention_megatron import magi_gpt_layer_spec, use_magi_rotary
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=DIM, num_attention_heads=HQ, num_query_groups=HKV, ffn_hidden_size=64,
        use_cpu_initialization=True, params_dtype=torch.float64, add_bias_linear=False, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPTModel(
        config=config, transformer_layer_spec=magi_gpt_layer_spec(), vocab_size=VOCAB,
        max_sequence_length=512, position_embedding_type="rope",
    )  # fmt: skip
    use_magi_rotary(model)
    return model


def make_batch(seed: int, doc_lens):
    gen = torch.Generator().manual_seed(seed)
    cu = [0, *torch.tensor(doc_lens).cumsum(0).tolist()]
    stream = torch.randint(0, VOCAB, (cu[-1] + 1,), generator=gen)
    tokens, labels = stream[:-1][None], stream[1:][None]
    loss_mask = torch.ones(1, cu[-1], dtype=torch.float64)
    loss_mask[0, torch.tensor(cu[1:]) - 1] = 0  # no target across a document end (eod_mask_loss)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}, cu


def step(model, batch, cu, group, config=None, algs=None, prepared=None):
    """One forward/backward; `config` is the cp side's `DistAttnConfig`; `algs` (a set) collects the
    algorithm that placed the batch's key; `prepared`: the batch's dispatch solved ahead (checked to be the
    key's placement)."""
    from magi_attention_megatron import get_batch_on_this_cp_rank_magi, magi_loss

    from magi_attention import get_dispatch_choice
    from magi_attention.api import get_position_ids

    local = get_batch_on_this_cp_rank_magi(
        batch, group, num_heads_q=HQ, num_heads_kv=HKV, head_dim=DIM // HQ, cu_seqlens=cu,
        dist_attn_config=config, prepared=prepared,
    )  # fmt: skip
    if prepared is not None:
        assert get_position_ids(local["magi_key"]).tolist() == token_ids_on_rank(prepared, dist.get_rank())
    if algs is not None:
        algs.add(get_dispatch_choice(local["magi_key"]).algorithm)
    per_token = model(
        input_ids=local["tokens"],
        position_ids=local["position_ids"],
        attention_mask=None,
        labels=local["labels"],
    )
    loss = magi_loss(per_token, local)
    loss.backward()
    return loss


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


TRAIN_DOC_LENS = [[20, 40, 9], [64, 5], [3, 3, 50, 10]]


def _config(alg: str | None) -> DistAttnConfig | None:
    return None if alg is None else DistAttnConfig(dispatch_config=DispatchConfig(alg=alg))


def _solved_ahead(cp: int, alg: str | None) -> dict:
    """The second training step's dispatch solved in another process (as a data-loader worker would), moved
    one rank on (a placement no solve makes, so the key shows whether it adopted it)."""
    from magi_attention.api import prepare_varlen_dispatch

    cu = make_batch(seed=101, doc_lens=TRAIN_DOC_LENS[1])[1]
    solved = solved_elsewhere(prepare_varlen_dispatch, cu, cu, cp, True, dist_attn_config=_config(alg))
    return {1: moved_to_next_rank(solved)}


def _rank_main(rank: int, world_size: int, alg: str | None, ahead: dict) -> dict:
    warnings.simplefilter("ignore")
    from magi_attention_megatron import all_reduce_gradients
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank takes part in new_group
    world = dist.group.WORLD
    config = _config(alg)
    algs: set = set()  # the algorithms of the cp side's keys
    report = {}
    cases = {"packed": ([33, 1, 18, 52], True), "one_sequence": ([80], False)}
    for name, (doc_lens, packed) in cases.items():
        model = build_model()
        ref = build_model()  # same seed: same weights (deepcopy cannot copy process groups)
        batch, cu = make_batch(seed=len(name), doc_lens=doc_lens)
        cu_arg = cu if packed else None
        loss = step(model, batch, cu_arg, world, config, algs)
        all_reduce_gradients(model, world)
        if rank == 0:
            ref_loss = step(ref, batch, cu_arg, singles[0])
            report[name] = {
                "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                "grad": max(rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())),
                "values": (loss.item(), ref_loss.item()),
            }
    # a dispatch solved for another cp size is refused on every rank, before any collective
    from magi_attention_megatron import get_batch_on_this_cp_rank_magi

    from magi_attention.api import prepare_varlen_dispatch

    batch, cu = make_batch(seed=7, doc_lens=[10, 20])
    wrong = prepare_varlen_dispatch(cu, cu, world_size + 1, True)
    with pytest.raises(ValueError, match=f"cp size {world_size + 1}, but the cp group has {world_size}"):
        get_batch_on_this_cp_rank_magi(
            batch, world, num_heads_q=HQ, num_heads_kv=HKV, head_dim=DIM // HQ, cu_seqlens=cu, prepared=wrong
        )
    # training: 3 Adam steps on different packs
    model = build_model()
    ref = build_model()
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    losses, ref_losses = [], []
    for s in range(3):
        batch, cu = make_batch(seed=100 + s, doc_lens=TRAIN_DOC_LENS[s])
        losses.append(step(model, batch, cu, world, config, algs, ahead.get(s)).item())
        all_reduce_gradients(model, world)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref_losses.append(step(ref, batch, cu, singles[0]).item())
            ref_opt.step()
            ref_opt.zero_grad()
    if rank == 0:
        report["train"] = {
            "losses": losses, "ref_losses": ref_losses,
            "weights": max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())),
        }  # fmt: skip
        report["algs"] = algs
    parallel_state.destroy_model_parallel()
    return report


@pytest.mark.parametrize("alg", [None, "documents"], ids=["auto", "documents"])
def test_megatron_cp2_matches_cp1(alg: str | None) -> None:
    report = run_ranks(_rank_main, 2, alg, _solved_ahead(2, alg))[0]
    print(report)
    if alg is not None:
        assert report["algs"] == {alg}, report["algs"]
    for name in ("packed", "one_sequence"):
        assert report[name]["loss"] < TOL, report[name]
        assert report[name]["grad"] < TOL, report[name]
    train = report["train"]
    for a, b in zip(train["losses"], train["ref_losses"]):
        assert abs(a - b) / abs(b) < TOL, train
    assert train["weights"] < TOL, train
