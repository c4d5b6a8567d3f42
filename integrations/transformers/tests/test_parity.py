"""Context-parallel runs of tiny Llama / Qwen2 / Qwen3 / Mistral models equal single-process runs.

One launch of the ranks per cp size holds every case (forking is cheap, re-importing transformers is
not). The reference is the same model (sdpa attention, float64) run on each document separately; the cp
side runs the packed batch through magi-attention. Compared: logits (undispatched), the pack's token-mean
loss, and parameter gradients summed over the cp ranks; then a short training loop (loss per step and
final weights). Sliding-window layers (Qwen2/Qwen3 upper layers, every Mistral layer) use documents longer
than the window, so their own keys are exercised. A third launch forces the documents placement
(`DispatchConfig(alg="documents")`, small chunks: these packs are too small for the planner to choose it)
on every family, the sliding-window keys included, and checks each key really used it.
"""

from __future__ import annotations

import copy
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from magi_attention.config import DispatchConfig, DistAttnConfig, OverlapConfig
from magi_attention.testing import moved_to_next_rank, solved_elsewhere, token_ids_on_rank
from magi_attention.testing import run_distributed as run_ranks

TOL = 1e-6
WINDOW = 6
DOC_LENS = [37, 1, 12, 50, 4, 26]
VOCAB = 61
FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


def make_model(family: str, seed: int = 0):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
    )  # fmt: skip
    if family == "llama":
        config = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":  # layer 0 full, layer 1 sliding
        config = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":  # head_dim given explicitly (not hidden / heads), q/k norms, sliding layer 1
        config = tf.Qwen3Config(
            **common, head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
        cls = tf.Qwen3ForCausalLM
    elif family == "mistral":  # every layer sliding
        config = tf.MistralConfig(**common, sliding_window=WINDOW)
        cls = tf.MistralForCausalLM
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls(config).to(torch.float64)


def packed_batch(seed: int, doc_lens=DOC_LENS):
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in doc_lens:
        cu.append(cu[-1] + n)
    return torch.randint(0, VOCAB, (1, cu[-1]), generator=gen), cu


def reference_step(model, ids, cu, labels=None):
    """Each document alone through the model; loss = token mean over the pack. Returns (logits, loss)."""
    labels = ids if labels is None else labels
    logits, loss_sum, count = [], 0.0, 0
    for s, e in pairwise(cu):
        out = model(input_ids=ids[:, s:e]).logits
        logits.append(out)
        target = labels[0, s + 1 : e]
        loss_sum = loss_sum + F.cross_entropy(out[0, :-1], target, ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    loss = loss_sum / count
    loss.backward()
    return torch.cat(logits, dim=1).detach(), loss.detach()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _rank_main(rank: int, world_size: int, alg: str | None = None, ahead: list | None = None) -> dict:
    from magi_attention_transformers import (
        _core,
        all_reduce_gradients,
        apply_magi_attention,
        causal_lm_loss,
        dispatch_batch,
        undispatch_logits,
    )

    from magi_attention import get_dispatch_choice

    world = dist.group.WORLD
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    ids, cu = packed_batch(seed=1)
    base = _base_config(alg)
    report: dict = {}
    for family in FAMILIES:
        model = make_model(family)
        ref = copy.deepcopy(model)
        group = mesh["cp"] if family == "qwen3" else world  # both forms of the group
        apply_magi_attention(model, group, dist_attn_config=base)
        labels = None
        override = None
        if family == "llama":  # given labels with ignored spans
            labels = ids.clone()
            labels[0, 20:30] = -100
        if family == "qwen2":  # per-batch config override: small chunks, another balancer, 2 stages
            override = DistAttnConfig(
                dispatch_config=DispatchConfig(chunk_size=5, alg=alg or "affinity"),
                overlap_config=OverlapConfig(degree=2),
            )
        batch = dispatch_batch(ids, group, cu_seqlens=cu, labels=labels, dist_attn_config=override)
        local_logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        loss = causal_lm_loss(local_logits, batch)
        loss.backward()
        all_reduce_gradients(model, group)
        logits = undispatch_logits(local_logits.detach(), batch.key)
        wkeys = list(_core._STATES[_core._group_id(group)].window_keys.values())
        # the algorithm of every key the layers used: the batch's and its sliding-window keys
        algs = {get_dispatch_choice(k).algorithm for k in [batch.key, *wkeys]}
        if rank == 0:
            ref_logits, ref_loss = reference_step(ref, ids, cu, labels)
            grads = {
                n: rel(p.grad, q.grad)
                for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
            }
            report[family] = {
                "logits": rel(logits, ref_logits),
                "loss": abs(loss.item() - ref_loss.item()) / abs(float(ref_loss)),
                "grad": max(grads.values()),
                "window_keys": len(wkeys),
                "algs": algs,
                "local_tokens": batch.input_ids.shape[1],
            }
    report["train"] = _train_loop(
        rank, world, base, ahead, apply_magi_attention, dispatch_batch, causal_lm_loss, all_reduce_gradients
    )
    return report


def _base_config(alg: str | None) -> DistAttnConfig | None:
    """alg="documents": every batch forced onto the documents placement, at chunk 8 (the placement would
    pick 32 for this pack: two chunks per rank, nothing to place)"""
    return None if alg is None else DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=8, alg=alg))


TRAIN_DOC_LENS = [[20, 9, 31], [5, 40, 15], [60], [7, 7, 30, 16]]


def _solved_ahead(cp: int, alg: str | None) -> list:
    """Per training step: None on even steps; on odd steps its dispatch solved in another process (as a
    data-loader worker would), then moved one rank on (`moved_to_next_rank`: a placement no solve makes, so
    the key shows whether it adopted it; the results must not change)."""
    from magi_attention.api import prepare_varlen_dispatch

    out = []
    for step, lens in enumerate(TRAIN_DOC_LENS):
        if step % 2 == 0:
            out.append(None)
            continue
        cu = packed_batch(seed=10 + step, doc_lens=lens)[1]
        config = _base_config(alg)
        solved = solved_elsewhere(prepare_varlen_dispatch, cu, cu, cp, True, dist_attn_config=config)
        out.append(moved_to_next_rank(solved))
    return out


def _train_loop(
    rank, group, config, ahead, apply_magi_attention, dispatch_batch, causal_lm_loss, all_reduce_gradients
):
    """Four AdamW steps of Mistral (sliding window) on packed batches of different documents, the odd steps'
    dispatch handed over as solved ahead (`_solved_ahead`)."""
    model = make_model("mistral", seed=3)
    ref = copy.deepcopy(model)
    apply_magi_attention(model, group, dist_attn_config=config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    from magi_attention import get_dispatch_choice
    from magi_attention.api import get_position_ids

    losses, ref_losses, algs = [], [], set()
    for step, prepared in enumerate(ahead):
        ids, cu = packed_batch(seed=10 + step, doc_lens=TRAIN_DOC_LENS[step])
        batch = dispatch_batch(ids, group, cu_seqlens=cu, prepared=prepared)
        if prepared is not None:
            assert get_position_ids(batch.key).tolist() == token_ids_on_rank(prepared, dist.get_rank()), step
        algs.add(get_dispatch_choice(batch.key).algorithm)
        loss = causal_lm_loss(model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits, batch)
        loss.backward()
        all_reduce_gradients(model, group)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        _, ref_loss = reference_step(ref, ids, cu)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss))
    weights = max(rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters()))
    return {"losses": losses, "ref_losses": ref_losses, "weights": weights, "algs": algs}


# the planner's own choice at cp 2 and 3; the documents placement forced once (cp 3: a cut per boundary)
@pytest.mark.parametrize(("cp", "alg"), [(2, None), (3, None), (3, "documents")])
def test_cp_matches_single_process(cp: int, alg: str | None) -> None:
    report = run_ranks(_rank_main, cp, alg, _solved_ahead(cp, alg))[0]
    for family in FAMILIES:
        r = report[family]
        print(f"cp={cp} alg={alg} {family}: {r}")
        if alg is not None:
            assert r["algs"] == {alg}, (family, r)
        assert r["logits"] < TOL, (family, r)
        assert r["loss"] < TOL, (family, r)
        assert r["grad"] < TOL, (family, r)
    # the sliding-window families got their own keys (Qwen2/Qwen3: layer 1; Mistral: every layer)
    assert report["llama"]["window_keys"] == 0
    for family in ("qwen2", "qwen3", "mistral"):
        assert report[family]["window_keys"] == 1, (family, report[family])
    train = report["train"]
    print(f"cp={cp} alg={alg} train: {train}")
    for a, b in zip(train["losses"], train["ref_losses"]):
        assert abs(a - b) / abs(b) < TOL, train
    assert train["weights"] < TOL, train
    if alg is not None:
        assert train["algs"] == {alg}, train
    assert train["losses"][-1] != train["losses"][0]
