"""Single-process checks of the batch preparation and argument errors (no process group)."""

from __future__ import annotations

import pytest
import torch
from magi_attention_transformers import (
    ATTN_IMPLEMENTATION,
    _core,
    apply_magi_attention,
    causal_lm_loss,
    dispatch_batch,
    undispatch_logits,
)
from test_parity import make_model


@pytest.fixture(autouse=True)
def _fresh_state():
    _core._STATES.clear()
    yield
    _core._STATES.clear()


def test_dispatch_batch_needs_apply_first() -> None:
    with pytest.raises(RuntimeError, match="apply_magi_attention"):
        dispatch_batch(torch.zeros(1, 8, dtype=torch.long), None)


def test_labels_positions_single_process() -> None:
    model = make_model("llama")
    apply_magi_attention(model, None)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert model.config.use_cache is False
    ids = torch.arange(10, 20)[None]
    labels = ids.clone()
    labels[0, 2] = -100
    batch = dispatch_batch(ids, None, cu_seqlens=torch.tensor([0, 4, 5, 10]), labels=labels)
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 4]]
    assert batch.labels.tolist() == [[11, -100, 13, -100, -100, 16, 17, 18, 19, -100]]
    assert batch.num_label_tokens == 6
    assert batch.input_ids.tolist() == ids.tolist()
    # no cu_seqlens: one document
    one = dispatch_batch(ids, None)
    assert one.position_ids.tolist() == [list(range(10))]
    assert one.labels.tolist() == [[*range(11, 20), -100]]
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    assert undispatch_logits(logits, batch.key).shape == (1, 10, model.config.vocab_size)
    loss = causal_lm_loss(logits, batch)
    valid = batch.labels[0] != -100
    expected = torch.nn.functional.cross_entropy(logits[0][valid], batch.labels[0][valid])
    torch.testing.assert_close(loss, expected)


def test_argument_errors() -> None:
    model = make_model("llama")
    apply_magi_attention(model, None)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="cu_seqlens"):
        dispatch_batch(ids, None, cu_seqlens=[0, 5, 7])
    with pytest.raises(ValueError, match="packed sequence"):
        dispatch_batch(torch.zeros(2, 8, dtype=torch.long), None)
    with pytest.raises(TypeError, match="ProcessGroup"):
        dispatch_batch(ids, "world")
    from magi_attention.api import prepare_varlen_dispatch

    # a dispatch solved for another cp size or another batch length is refused, naming what differs
    with pytest.raises(ValueError, match="cp size 2, but the cp group has 1"):
        dispatch_batch(ids, None, prepared=prepare_varlen_dispatch([0, 8], [0, 8], 2, causal=True))
    with pytest.raises(ValueError, match="solved for 6 tokens, but this batch has 8"):
        dispatch_batch(ids, None, prepared=prepare_varlen_dispatch([0, 6], [0, 6], 1, causal=True))
    with pytest.raises(TypeError, match="PreparedDispatch"):
        dispatch_batch(ids, None, prepared="solved")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        apply_magi_attention(torch.nn.Linear(2, 2), None)
