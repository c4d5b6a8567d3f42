"""Each batch's dispatch solved ahead in a dataloader worker (`plan_in_dataloader`, `plan_batch_ahead`) and adopted
by `dispatch_batch(..., prepared=...)`: the worker's solve is the key's own placement, the key built on it does
not solve and gives the tensors it gives without it, a dispatch solved for another batch of the same size is
not used (the key solves its own, with the same result), one for another cp size or token count is refused,
and `MagiTrainer` with `plan_in_dataloader` on plans in its dataloader's workers and dispatches those batches.

Solves are counted by wrapping `magi_solver.choice._choose`, the function every cache miss of the planner runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from magi_attention.testing import run_distributed

SEQ_LEN, BATCH, STEPS, CP = 100, 2, 3, 3
HEADS_Q, HEADS_KV, HEAD_DIM = 2, 1, 8


def _tokenizer():
    from magi_attention_torchtitan import tokenizer_path
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(tokenizer_path=tokenizer_path())


def _loader(num_workers: int, seq_len: int = SEQ_LEN):
    from magi_attention_torchtitan import SyntheticDocumentsDataLoader

    config = SyntheticDocumentsDataLoader.Config(
        seed=7, min_doc_len=3, max_doc_len=60, num_workers=num_workers
    )
    return config.build(
        dp_world_size=1, dp_rank=0, tokenizer=_tokenizer(), seq_len=seq_len, local_batch_size=BATCH
    )


def _dist_attn_config():
    from magi_attention_torchtitan import MagiAttentionConfig

    return MagiAttentionConfig(chunk_size=16).dist_attn_config()


def _planned_batches(cp_size: int) -> list:
    """STEPS batches of a one-worker dataloader that plans them for `cp_size` ranks."""
    from magi_attention_torchtitan import plan_in_dataloader

    loader = _loader(num_workers=1)
    plan_in_dataloader(loader, cp_size=cp_size, dist_attn_config=_dist_attn_config())
    return [batch for _, batch in zip(range(STEPS), loader)]


class _SolveCounter:
    """Counts the planner's solves (cache misses) in this process, from now on (for a forked rank: the patch
    ends with the process)."""

    def __init__(self) -> None:
        import magi_solver.choice as choice

        self.calls = 0
        solve = choice._choose

        def counting(*args, **kwargs):
            self.calls += 1
            return solve(*args, **kwargs)

        choice._choose = counting


def test_batches_from_a_worker_carry_the_dispatch_their_key_will_solve() -> None:
    """The worker's prepared dispatch equals `plan_batch_ahead` here (the same request, the config's chunk
    size, the cp size asked for), and the batches are otherwise those of the dataloader without planning."""
    from magi_attention_torchtitan import MAGI_PREPARED, document_cu_seqlens, plan_batch_ahead

    from magi_attention.api import prepare_varlen_dispatch

    planned = _planned_batches(CP)
    plain = [batch for _, batch in zip(range(STEPS), _loader(num_workers=0))]
    config = _dist_attn_config()
    for (input_dict, labels), (plain_dict, plain_labels) in zip(planned, plain):
        assert sorted(input_dict) == ["input", MAGI_PREPARED, "positions"]
        assert torch.equal(labels, plain_labels)
        for name in ("input", "positions"):
            assert torch.equal(input_dict[name], plain_dict[name])
        prepared = input_dict[MAGI_PREPARED]
        positions = input_dict["positions"]
        assert prepared == plan_batch_ahead(positions, BATCH, SEQ_LEN, cp_size=CP, dist_attn_config=config)
        cu = list(document_cu_seqlens(positions, BATCH, SEQ_LEN))
        assert prepared == prepare_varlen_dispatch(cu, cu, CP, causal=True, dist_attn_config=config)
        assert (prepared.plan.cp_size, prepared.plan.chunk_size) == (CP, 16)
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
    with pytest.raises(ValueError, match="solved for 20 tokens, but this batch packs 10"):
        dispatch_batch(ids, ids, **kwargs, prepared=plan_batch_ahead(None, 2, 10, cp_size=1))
    with pytest.raises(TypeError, match="prepared must be a PreparedDispatch"):
        dispatch_batch(ids, ids, **kwargs, prepared="magi")
    plain = dispatch_batch(ids, ids + 100, **kwargs)
    taken = dispatch_batch(ids, ids + 100, **kwargs, prepared=plan_batch_ahead(positions, 2, 5, cp_size=1))
    for name in ("input_ids", "labels", "positions"):
        assert torch.equal(getattr(taken, name), getattr(plain, name)), name


def _rank_main(rank: int, world_size: int, batches: list) -> list[str]:
    from magi_attention_torchtitan import MAGI_PREPARED, dispatch_batch, plan_batch_ahead
    from torch.distributed.device_mesh import init_device_mesh

    from magi_attention import api
    from magi_solver.choice import clear_dispatch_cache

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    config = _dist_attn_config()
    counter = _SolveCounter()
    checked = []

    def fresh(input_dict, labels, prepared=None):
        """The batch dispatched from empty caches (magi's keys and the planner's solves): `(batch, solves)`."""
        api.clear_cache(mesh)
        clear_dispatch_cache()
        counter.calls = 0
        batch = dispatch_batch(
            input_dict["input"],
            labels,
            positions=input_dict["positions"],
            cp_mesh=mesh,
            num_heads_q=HEADS_Q,
            num_heads_kv=HEADS_KV,
            head_dim=HEAD_DIM,
            dist_attn_config=config,
            prepared=prepared,
        )
        return batch, counter.calls

    def same(a, b) -> bool:
        keys = (a.attention_masks.key, b.attention_masks.key)
        ids = [api.get_position_ids(k) for k in keys]
        return torch.equal(*ids) and all(
            torch.equal(getattr(a, n), getattr(b, n)) for n in ("input_ids", "labels", "positions")
        )

    for step, (input_dict, labels) in enumerate(batches):
        prepared = input_dict[MAGI_PREPARED]
        own, own_solves = fresh(input_dict, labels)
        assert own_solves >= 1, "the key found a dispatch it should have solved"
        # the worker's placement is the key's own: this rank holds the prepared plan's chunks, in order
        plan, total = prepared.plan, BATCH * SEQ_LEN
        chunks = [
            min(c * plan.chunk_size + i, total - 1)  # padding reuses the last valid token id
            for c in plan.partitions[rank]
            for i in range(plan.chunk_size)
        ]
        assert api.get_position_ids(own.attention_masks.key).tolist() == chunks, f"step {step}"
        # adopted: no solve, the same tensors and placement
        adopted, adopted_solves = fresh(input_dict, labels, prepared)
        assert adopted_solves == 0, f"step {step}: the key solved a dispatch it was given"
        assert same(adopted, own), f"step {step}: the adopted dispatch changed the batch"
        assert api.get_dispatch_choice(adopted.attention_masks.key) == api.get_dispatch_choice(
            own.attention_masks.key
        )
        # another batch's dispatch of the same size: not used (solved anew), the same tensors
        other = batches[(step + 1) % len(batches)][0][MAGI_PREPARED]
        mismatched, mismatched_solves = fresh(input_dict, labels, other)
        assert mismatched_solves >= 1, f"step {step}: another batch's dispatch answered this batch's key"
        assert same(mismatched, own), f"step {step}: another batch's dispatch changed the batch"
        # another cp size: refused on every rank before the key's collective
        wrong_cp = plan_batch_ahead(
            input_dict["positions"], BATCH, SEQ_LEN, cp_size=world_size + 1, dist_attn_config=config
        )
        try:
            fresh(input_dict, labels, wrong_cp)
        except ValueError as exc:
            assert f"solved for cp size {world_size + 1}" in str(exc), exc
        else:
            raise AssertionError("a dispatch solved for another cp size was taken")
        checked.append(f"step {step}: {len(chunks)} tokens, {plan.alg}")
    dist.barrier()
    return checked


def test_prepared_dispatch_is_the_keys_own_and_is_adopted_without_a_solve() -> None:
    batches = _planned_batches(CP)  # solved in the dataloader's worker process, as in training
    results = run_distributed(_rank_main, CP, batches)
    assert all(len(r) == STEPS for r in results), results


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
