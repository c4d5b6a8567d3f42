"""The generic backend choice on the capabilities (`magi_ffa.choice`): explicit requests checked with a reason
and the alternatives, `auto` by priority, determinism per slices and head_dim, and a backend registered by
name (the torch reference under another name) chosen like any other."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from magi_ffa import contract
from magi_ffa.choice import choose, registered_backends, usable_backends
from magi_ffa.contract import FFABackend, get_backend, register_backend
from magi_ffa.validation import check_slices


@pytest.fixture
def toy():
    """The torch reference registered as `toy` (priority above every shipped backend); removed afterwards."""
    ref = get_backend("torch")
    cap = dataclasses.replace(ref.capability, name="toy", title="Toy", package="tests", priority=99,
                              dtypes=(torch.float32,), deterministic_head_dim=lambda d: d <= 64)  # fmt: skip
    register_backend(FFABackend(cap, ref.launchers))
    yield "toy"
    contract._REGISTRY.pop("toy")


def test_usable_backends_are_read_without_importing() -> None:
    assert {"torch", "triton"} <= set(registered_backends())
    assert "torch" in usable_backends()  # the reference runs everywhere
    assert usable_backends(["torch"]) == ["torch"]


def test_explicit_requests_are_checked_with_the_reason_and_the_alternatives(toy) -> None:
    cands = ["torch", "toy"]
    kw = dict(dtype=torch.float32, head_dim=32)
    assert choose(cands, requested="toy", **kw) == "toy"
    with pytest.raises(ValueError, match=r"kernel_backend='triton' cannot run on every rank"):
        choose(cands, requested="triton", **kw)
    with pytest.raises(ValueError, match=r"Toy takes float32 inputs, got torch.float64.*'torch'"):
        choose(cands, requested="toy", dtype=torch.float64, head_dim=32)
    with pytest.raises(ValueError, match="no deterministic backward"):
        choose(cands, requested="toy", dtype=torch.float32, head_dim=128, deterministic=True)


def test_auto_takes_the_highest_priority_that_accepts(toy) -> None:
    cands = ["torch", "toy", "triton"]
    assert choose(cands, dtype=torch.float32, head_dim=32, on_gpu=False) == "toy"  # device "any"
    assert choose(cands, dtype=torch.float64, head_dim=32, on_gpu=False) == "torch"  # toy refuses fp64
    assert choose(cands, dtype=torch.float32, head_dim=128, deterministic=True, on_gpu=False) == "torch"
    # with a GPU, Triton (20) comes after the toy (99) but before the reference (0)
    assert choose(["torch", "triton"], dtype=torch.float16, head_dim=64, on_gpu=True) == "triton"
    assert choose(["torch", "triton"], dtype=torch.float16, head_dim=64, on_gpu=False) == "torch"
    assert choose(["torch", "triton"], dtype=torch.float16, head_dim=48, on_gpu=True) == "torch"  # not pow2


def test_the_slices_decide_determinism_where_they_are_known(toy) -> None:
    cap = get_backend("toy").capability
    checked = check_slices([[0, 8]], [[0, 8]], [1], 8, 8)
    assert cap.deterministic_at(checked, 32) and not cap.deterministic_at(checked, 128)
    never = dataclasses.replace(cap, deterministic=lambda c: False)
    # a verdict is kept per slices and backend name (equal masks share one mask-cache entry: another mask)
    fresh = check_slices([[0, 4]], [[0, 4]], [1], 8, 8)
    assert not never.deterministic_at(fresh, 32) and never.deterministic_at(None, 32)
    assert fresh.prepared[("toy", "deterministic")] is False
