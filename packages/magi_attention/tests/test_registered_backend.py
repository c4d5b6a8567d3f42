"""A kernel backend registered by name (`magi_ffa.contract.register_backend`) is one the runtime runs like the
shipped ones: selected by `DistAttnConfig(kernel_backend=<name>)`, checked when the key is built, and run by
`calc_attn`. The backend here is the torch reference under another name; nothing outside this file knows it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from magi_attention import DistAttnConfig, clear_cache, get_kernel_backend
from magi_attention.api import calc_attn, dispatch, magi_attn_flex_key, undispatch
from magi_ffa import contract
from magi_ffa.contract import FFABackend, Launchers, get_backend, register_backend
from magi_ffa.testing import make_attn_mask, ref_attn

NAME = "toy_reference"


@pytest.fixture
def toy(monkeypatch):
    """The torch reference registered as `toy_reference` (float32 / float64 only), counting its launches."""
    monkeypatch.delenv("MAGI_ATTENTION_KERNEL_BACKEND", raising=False)
    ref = get_backend("torch")
    calls = []

    def forward(*args, **kw):
        calls.append("fwd")
        return ref.launchers.forward(*args, **kw)

    def backward(*args, **kw):
        calls.append("bwd")
        return ref.launchers.backward(*args, **kw)

    cap = dataclasses.replace(ref.capability, name=NAME, title="Toy", package=__name__,
                              dtypes=(torch.float32, torch.float64))  # fmt: skip
    register_backend(FFABackend(cap, Launchers(forward, backward, ref.launchers.prepare)))
    clear_cache()
    yield calls
    clear_cache()
    contract._REGISTRY.pop(NAME)


def test_a_registered_backend_runs_calc_attn_by_name(toy) -> None:
    total, hq, hk, d = 40, 2, 1, 16
    qr, kr, tm = [[0, 24], [8, 40], [20, 40]], [[0, 24], [0, 30], [4, 36]], [1, 3, 2]
    key = magi_attn_flex_key(qr, kr, tm, total, total, hq, hk, d, None, DistAttnConfig(kernel_backend=NAME))
    assert get_kernel_backend(key, torch.float32) == (NAME, f"kernel_backend={NAME!r} (explicit)")
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(total, h, d, generator=gen) for h in (hq, hk, hk, hq))
    leaves = [dispatch(t, key).requires_grad_() for t in (q, k, v)]
    out, _ = calc_attn(*leaves, key)
    out.backward(dispatch(do, key))
    assert toy == ["fwd", "bwd"]  # the toy's launchers ran the call
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = ref_attn(*ref_leaves, make_attn_mask(qr, kr, tm, total, total))
    (ref * do.double()).sum().backward()
    got = [undispatch(out.detach(), key)] + [undispatch(x.grad, key) for x in leaves]
    for g, w in zip(got, [ref.detach()] + [x.grad for x in ref_leaves], strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
    # its capability is asked like any other's: an explicit choice takes no dtype it lacks
    with pytest.raises(ValueError, match=rf"kernel_backend={NAME!r} cannot take this call: Toy takes"):
        calc_attn(*(x.detach().half() for x in leaves), key)


def test_an_unknown_name_raises_when_the_key_is_built(toy) -> None:
    config = DistAttnConfig(kernel_backend="toy_missing")  # any name: checked when a key is built
    with pytest.raises(
        ValueError, match=r"kernel_backend='toy_missing' cannot run on every rank.*no kernel backend named"
    ):
        magi_attn_flex_key([[0, 8]], [[0, 8]], "full", 8, 8, 1, 1, 16, None, config)
    with pytest.raises(TypeError, match="kernel_backend"):
        DistAttnConfig(kernel_backend=3)
