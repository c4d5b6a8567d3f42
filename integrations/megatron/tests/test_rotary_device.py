"""The RoPE wrapper computes on the batch's device, wherever the wrapped RotaryEmbedding keeps `inv_freq`.

Megatron's `RotaryEmbedding.inv_freq` is a plain attribute: a model built with `use_cpu_initialization=True`
and moved with `.to("cuda")` keeps it on the CPU, and Megatron's own forward (which the wrapper replaces)
moves it when it first runs. A GPU run of the wrapper once met a CPU embedding beside CUDA activations; here
the positions live on the meta device, a second device every machine has.
"""

from __future__ import annotations

import magi_attention_megatron as mm
import torch
from torch import nn


class _Rotary(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # CPU


def test_embedding_follows_the_positions_device(monkeypatch) -> None:
    wrapper = mm.MagiRotaryEmbedding(_Rotary(8))
    monkeypatch.setattr(mm._CURRENT, "position_ids", torch.arange(6))
    cpu = wrapper(6)
    assert cpu.shape == (6, 1, 1, 8) and cpu.device.type == "cpu"
    want = torch.outer(torch.arange(6, dtype=torch.float32), wrapper.rotary.inv_freq)
    torch.testing.assert_close(cpu[:, 0, 0, :4], want)
    monkeypatch.setattr(mm._CURRENT, "position_ids", torch.arange(6, device="meta"))
    assert wrapper(6).device.type == "meta"
