"""Each batch's dispatch solved ahead in a dataloader worker (`plan_in_dataloader`, `plan_batch_ahead`) and adopted
by `dispatch_batch(..., prepared=...)`: the worker's solve is the key's own placement, the key takes the
placement it is given, with it the batch's tensors are those without it, a dispatch solved for another batch of
the same size is not used, one for another cp size or token count is refused, and `MagiTrainer` with
`plan_in_dataloader` plans in its dataloader's workers and hands each batch's dispatch to `dispatch_batch`.

That a key takes the dispatch it is given is seen by giving it a valid placement no solve makes (the solved
one with each rank's chunks moved to the next rank) and finding this placement in the key. Each kind of
dispatch is given in a launch of its own: a process keeps the first answer its planner has for a mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from magi_attention.testing import moved_to_next_rank, run_distributed, token_ids_on_rank

SEQ_LEN, BATCH, STEPS = 100, 2, 3
HEADS_Q, HEADS_KV, HEAD_DIM = 2, 1, 8
# the single-process checks plan at cp 2 (seed 7), the ranks at cp 3 (seed 11): no mask the ranks plan is in
# the planner's cache they inherit from this process
LOCAL_CP, RANKS, RANKS_SEED = 2, 3, 11


def _tokenizer():
    from magi_attention_torchtitan import tokenizer_path
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=tokenizer_path())


def _loader(num_workers: int, seed: int = 7):
    from magi_attention_torchtitan import SyntheticDocumentsDataLoader

    config = SyntheticDocumentsDataLoader.Config(
        seed=seed, min_doc_len=3, max_doc_len=60, num_workers=num_workers
    )
    return config.build(
        dp_world_size=1, dp_rank=0, tokenizer=_tokenizer(), seq_len=SEQ_LEN, local_batch_size=BATCH
    )


def _dist_attn_config():
    from magi_attention_torchtitan import MagiAttentionConfig

    return MagiAttentionConfig(chunk_size=16).dist_attn_config()


def _planned_batches(cp_size: int, count: int = STEPS, seed: int = 7) -> list:
    """`count` batches of a one-worker dataloader that plans them for `cp_size` ranks."""
    from magi_attention_torchtitan import plan_in_dataloader

    loader = _loader(num_workers=1, seed=seed)
    plan_in_dataloader(loader, cp_size=cp_size, dist_attn_config=_dist_attn_config())
    return [batch for _, batch in zip(range(count), loader)]


def test_batches_from_a_worker_carry_the_dispatch_their_key_will_solve() -> None:
    """The worker's prepared dispatch equals `plan_batch_ahead` here (the same request, the config's chunk
    size, the cp size asked for), and the batches are otherwise those of the dataloader without planning."""
    from magi_attention_torchtitan import MAGI_PREPARED, document_cu_seqlens, plan_batch_ahead

    from magi_attention.api import prepare_varlen_dispatch

    planned = _planned_batches(LOCAL_CP)
    plain = [batch for _, batch in zip(range(STEPS), _loader(num_workers=0))]
    config = _dist_attn_config()
    for (input_dict, labels), (plain_dict, plain_labels) in zip(planned, plain):
        assert sorted(input_dict) == ["input", MAGI_PREPARED, "positions"]
        assert torch.equal(labels, plain_labels)
        for name in ("input", "positions"):
            assert torch.equal(input_dict[name], plain_dict[name])
        prepared = input_dict[MAGI_PREPARED]
        positions = input_dict["positions"]
        assert prepared == plan_batch_ahead(
            positions, BATCH, SEQ_LEN, cp_size=LOCAL_CP, dist_attn_config=config
        )
        cu = list(document_cu_seqlens(positions, BATCH, SEQ_LEN))
        assert prepared == prepare_varlen_dispatch(cu, cu, LOCAL_CP, causal=True, dist_attn_config=config)
        assert (prepared.plan.cp_size, prepared.plan.chunk_size) == (LOCAL_CP, 16)
    # each batch its own documents, so its own dispatch
    assert len({batch[0][MAGI_PREPARED].request for batch in planned}) == STEPS


def test_plan_in_dataloader_needs_a_dataloader_with_workers() -> None:
    from magi_attention_torchtitan import PlanAheadCollate, plan_in_dataloader

    with pytest.raises(ValueError, match="num_workers >= 1"):
        plan_in_dataloader(_loader(num_workers=0), cp_size=2)
    with pytest.raises(TypeError, match="torch DataLoader"):
        plan_in_dataloader([], cp_size=2)
    loader = _loader(num_workers=1)
    plan_in_dataloader(loader, cp_size=2)
    plan_in_dataloader(loader, cp_size=4)  # a second call replaces the first: one solve per batch
    assert isinstance(loader.collate_fn, PlanAheadCollate) and loader.collate_fn.cp_size == 4
    assert not isinstance(loader.collate_fn.collate_fn, PlanAheadCollate)
    with pytest.raises(TypeError, match="PlanAheadCollate needs batches"):
        PlanAheadCollate(lambda samples: (samples, None), cp_size=2)([torch.zeros(3)])


def test_dispatch_batch_refuses_a_dispatch_solved_for_another_cp_size_or_batch_size() -> None:
    """Without a process group the cp size is 1: a dispatch prepared for cp 2, or for more tokens, is refused
    before any key is built; one for cp 1 is taken and changes nothing."""
    from magi_attention_torchtitan import dispatch_batch, plan_batch_ahead

    ids = torch.arange(10).view(2, 5)
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    kwargs = dict(positions=positions, cp_mesh=None, num_heads_q=2, num_heads_kv=1, head_dim=8)
    with pytest.raises(ValueError, match="solved for cp size 2, but the cp group has 1 ranks"):
        dispatch_batch(ids, ids, **kwargs, prepared=plan_batch_ahead(positions, 2, 5, cp_size=2))
    with pytest.raises(ValueError, match="solved for 20 tokens, but this batch has 10"):
        dispatch_batch(ids, ids, **kwargs, prepared=plan_batch_ahead(None, 2, 10, cp_size=1))
    with pytest.raises(TypeError, match="`prepared` must be a PreparedDispatch"):
        dispatch_batch(ids, ids, **kwargs, prepared="magi")
    plain = dispatch_batch(ids, ids + 100, **kwargs)
    taken = dispatch_batch(ids, ids + 100, **kwargs, prepared=plan_batch_ahead(positions, 2, 5, cp_size=1))
    for name in ("input_ids", "labels", "positions"):
        assert torch.equal(getattr(taken, name), getattr(plain, name)), name


def _rank_main(rank: int, world_size: int, batches: list, given: str, other) -> list[dict]:
    """Each batch dispatched with `given` ("none", "own": its prepared dispatch, "rotated": that moved by one
    rank, "other": another batch's, moved): its tensors and the key's token ids."""
    from magi_attention_torchtitan import MAGI_PREPARED, dispatch_batch, plan_batch_ahead
    from torch.distributed.device_mesh import init_device_mesh

    from magi_attention import api

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    config = _dist_attn_config()
    out = []
    for input_dict, labels in batches:
        prepared = {
            "none": None,
            "own": input_dict[MAGI_PREPARED],
            "rotated": moved_to_next_rank(input_dict[MAGI_PREPARED]),
            "other": other,
        }[given]
        kwargs = dict(
            positions=input_dict["positions"],
            cp_mesh=mesh,
            num_heads_q=HEADS_Q,
            num_heads_kv=HEADS_KV,
            head_dim=HEAD_DIM,
            dist_attn_config=config,
        )
        if given == "none":  # another cp size's dispatch: refused on every rank before the key's collective
            wrong_cp = plan_batch_ahead(
                input_dict["positions"], BATCH, SEQ_LEN, cp_size=world_size + 1, dist_attn_config=config
            )
            with pytest.raises(ValueError, match=f"solved for cp size {world_size + 1}, but the cp group"):
                dispatch_batch(input_dict["input"], labels, **kwargs, prepared=wrong_cp)
        batch = dispatch_batch(input_dict["input"], labels, **kwargs, prepared=prepared)
        out.append(
            {
                "input_ids": batch.input_ids,
                "labels": batch.labels,
                "positions": batch.positions,
                "token_ids": api.get_position_ids(batch.attention_masks.key).tolist(),
            }
        )
    dist.barrier()
    return out


def test_prepared_dispatch_is_the_keys_own_and_is_the_one_it_takes() -> None:
    from magi_attention_torchtitan import MAGI_PREPARED

    # solved in the dataloader's worker process, as in training; the last batch only lends its dispatch
    *batches, spare = _planned_batches(RANKS, STEPS + 1, seed=RANKS_SEED)
    other = moved_to_next_rank(spare[0][MAGI_PREPARED])
    runs = {given: run_distributed(_rank_main, RANKS, batches, given, other) for given in
            ("none", "own", "rotated", "other")}  # fmt: skip
    for step, (input_dict, _) in enumerate(batches):
        prepared = input_dict[MAGI_PREPARED]
        for rank in range(RANKS):
            alone, own, rotated, another = (runs[g][rank][step] for g in ("none", "own", "rotated", "other"))
            where = f"step {step}, rank {rank}"
            # the worker's placement is the one the key solves without it
            assert alone["token_ids"] == token_ids_on_rank(prepared, rank), where
            # the key takes the placement it is given ...
            assert (
                rotated["token_ids"]
                == token_ids_on_rank(moved_to_next_rank(prepared), rank)
                != alone["token_ids"]
            ), where
            # ... so with the worker's, the batch is dispatched as without it
            for name in ("input_ids", "labels", "positions", "token_ids"):
                assert torch.equal(torch.as_tensor(own[name]), torch.as_tensor(alone[name])), (where, name)
                # another batch's dispatch is not used: the key solves its own
                assert torch.equal(torch.as_tensor(another[name]), torch.as_tensor(alone[name])), (
                    where,
                    name,
                )


def test_magi_trainer_plans_in_its_dataloader_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """`MagiTrainer` with `magi.plan_in_dataloader`: its dataloader (built by torchtitan's `Trainer.__init__`,
    replaced here by the part that builds the dataloader: the trainer needs an accelerator) plans each batch in
    its worker for the trainer's cp degree and config, and `post_dataloading_process` hands that dispatch to
    `dispatch_batch` and gives what it gives without planning. Without workers, the flag is refused."""
    from types import SimpleNamespace

    from magi_attention_torchtitan import (
        MAGI_PREPARED,
        MagiAttentionConfig,
        MagiTrainer,
        PlanAheadCollate,
        dispatch_batch,
        plan_batch_ahead,
        prepare_magi_input,
    )
    from magi_attention_torchtitan.config_registry import magi_llama3_tiny
    from torchtitan.trainer import Trainer

    def trainer_init(self, config) -> None:  # the attributes MagiTrainer uses, as torchtitan's sets them
        self.config = config
        self.model_config = config.model_spec.model
        self.parallel_dims = SimpleNamespace(cp=1, get_optional_mesh=lambda *args, **kwargs: None)
        self.ntokens_seen = 0
        self.dataloader = config.dataloader.build(
            dp_world_size=1,
            dp_rank=0,
            tokenizer=_tokenizer(),
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
        )

    monkeypatch.setattr(Trainer, "__init__", trainer_init)
    config = magi_llama3_tiny()
    config.magi = MagiAttentionConfig(chunk_size=16, plan_in_dataloader=True)
    config.dataloader.num_workers = 1
    trainer = MagiTrainer(config)
    collate = trainer.dataloader.collate_fn
    assert isinstance(collate, PlanAheadCollate) and collate.cp_size == 1
    assert collate.dist_attn_config == config.magi.dist_attn_config()

    input_dict, labels = next(iter(trainer.dataloader))
    batch, seq_len = labels.shape
    assert input_dict[MAGI_PREPARED] == plan_batch_ahead(
        input_dict["positions"], batch, seq_len, cp_size=1, dist_attn_config=config.magi.dist_attn_config()
    )
    # at cp 1 a key solves nothing, so what is checked is that the worker's dispatch reaches dispatch_batch
    import magi_attention_torchtitan.trainer as trainer_module

    given = []

    def recording_dispatch_batch(*args, **kwargs):
        given.append(kwargs.get("prepared"))
        return dispatch_batch(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "dispatch_batch", recording_dispatch_batch)
    inputs, local_labels, extra = trainer.post_dataloading_process(dict(input_dict), labels)
    assert given == [input_dict[MAGI_PREPARED]]
    plain = {k: v for k, v in input_dict.items() if k != MAGI_PREPARED}
    want = prepare_magi_input(
        plain, labels, cp_mesh=None, model_config=trainer.model_config, magi_config=config.magi
    )
    assert torch.equal(inputs, want[0]) and torch.equal(local_labels, want[1])
    assert torch.equal(extra["positions"], want[2]["positions"])
    assert trainer.ntokens_seen == local_labels.numel()

    config.dataloader.num_workers = 0
    with pytest.raises(ValueError, match=r"--dataloader\.num_workers 1"):
        MagiTrainer(config)
    config.magi = MagiAttentionConfig(chunk_size=16)  # off: the dataloader is left as torchtitan built it
    assert not isinstance(MagiTrainer(config).dataloader.collate_fn, PlanAheadCollate)
