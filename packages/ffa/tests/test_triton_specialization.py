"""The Triton kernels' compiled variants do not follow a mask's counts: a stream of new masks and token counts
launches each kernel with one specialisation.

Triton compiles one variant per *specialisation* of a launch: every constexpr value, and for each other int
argument whether it is 1 and whether it is divisible by 16 (unless the kernel marks it ``do_not_specialize``),
for each pointer whether it is 16-byte aligned. The launches are recorded (the kernels do not run) and their
specialisations computed by that rule; a training loop hands the kernels new block counts and token counts
every step, so those must not be specialised.
"""

from __future__ import annotations

import inspect
import itertools
import random

import pytest
import torch

from magi_ffa import _triton_bwd, _triton_fwd, _triton_merge, testing
from magi_ffa.validation import host_slices


def _dns(kernel) -> set[str]:
    """The kernel's ``do_not_specialize`` names (a JITFunction or the interpreter's stand-in)."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:
        names = getattr(kernel, "kwargs", {}).get("do_not_specialize", ())
    params = list(inspect.signature(kernel.fn).parameters)
    return {params[n] if isinstance(n, int) else n for n in names}


def specialization(kernel, kwargs: dict) -> tuple:
    """Triton 3.6's specialisation of one launch (``triton.runtime.jit``'s binder), as a hashable tuple."""
    dns = _dns(kernel)
    out = []
    for name, p in inspect.signature(kernel.fn).parameters.items():
        value = kwargs[name]
        if "constexpr" in str(p.annotation):
            out.append((name, value))
        elif isinstance(value, torch.Tensor):
            out.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or value is None:
            out.append((name, value))
        elif isinstance(value, int):
            width = "i32" if -(2**31) <= value < 2**31 else "i64"
            out.append((name, width) if name in dns else (name, width, value == 1, value % 16 == 0))
        elif isinstance(value, float):
            out.append((name, "fp32"))
        else:
            raise AssertionError(f"{name}: unexpected argument {value!r}")
    return tuple(out)


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](**kwargs)`` records the launch's specialisation."""

    def __init__(self, kernel, seen: set):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(**kwargs):
            options = {"num_warps", "num_stages"}
            self.seen.add(specialization(self.kernel, {k: v for k, v in kwargs.items() if k not in options}))

        return launch


def _mask(rng: random.Random, total_q: int, total_k: int):
    """Random overlapping slices; with as many keys as queries also packed documents or a sliding window."""
    kind = rng.choice(["random", "docs", "window"]) if total_q == total_k else "random"
    if kind == "random":
        return testing.random_overlapping_slices(rng, total_q, total_k, rng.randint(1, 12))
    if kind == "docs":
        cuts = sorted({0, total_q, *(rng.randrange(1, total_q) for _ in range(rng.randint(1, 5)))})
        docs = [[a, b] for a, b in itertools.pairwise(cuts)]
        return docs, docs, [rng.choice([0, 1])] * len(docs)
    w = rng.randint(1, total_q - 1)
    return [[0, w], [w, total_q]], [[0, w], [1, total_k]], [1, 3]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # the launches only: no kernel runs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_new_masks_and_counts_launch_one_variant(monkeypatch, dtype, device) -> None:
    fwd, bwd, merge = set(), set(), set()
    monkeypatch.setattr(_triton_fwd, "ffa_fwd_kernel", _Recorder(_triton_fwd.ffa_fwd_kernel, fwd))
    monkeypatch.setattr(_triton_bwd, "ffa_bwd_kernel", _Recorder(_triton_bwd.ffa_bwd_kernel, bwd))
    monkeypatch.setattr(
        _triton_merge, "merge_out_lse_kernel", _Recorder(_triton_merge.merge_out_lse_kernel, merge)
    )
    rng = random.Random(0)
    hq, hk, d = 4, 2, 64
    counts = set()
    for _ in range(20):
        tq = rng.randint(130, 256)  # counts with every class: odd, even, multiples of 16
        tk = tq if rng.random() < 0.5 else rng.randint(130, 256)
        counts.add((tq % 16 == 0, tk % 16 == 0))
        qr, kr, tm = _mask(rng, tq, tk)
        t = [torch.tensor(x, dtype=torch.int32) for x in (qr, kr, tm)]
        slices = host_slices(*t, tq, tk)
        q = torch.randn(tq, hq, d, dtype=dtype, device=device)
        k = torch.randn(tk, hk, d, dtype=dtype, device=device)
        v = torch.randn(tk, hk, d, dtype=dtype, device=device)
        _triton_fwd.triton_fwd(q, k, v, slices, 0.125, 0.0)
        # accumulate mode with an lse given as a transposed [heads, rows] view: its strides follow tq
        out = torch.zeros(tq, hq, d, device=device)
        lse_t = torch.full((hq, tq), float("-inf"), device=device)
        _triton_fwd.triton_fwd(q, k, v, slices, 0.125, 0.0, out=out, lse=lse_t.t())
        lse, delta = torch.randn(tq, hq, device=device), torch.randn(tq, hq, device=device)
        _triton_bwd.triton_bwd(q, q, k, v, lse, delta, slices, 0.125, 0.0)
        new_out, new_lse = torch.zeros(tq, hq, d, device=device), torch.zeros(hq, tq, device=device)
        _triton_merge.triton_merge_(out, lse_t.t(), new_out, new_lse.t())
    assert len(counts) >= 3, "the stream must cover token counts of several classes"
    # forward: one variant per mode (a fresh result, an accumulator); backward and merge: one
    assert len(fwd) == 2, fwd
    assert len(bwd) == 1, bwd
    assert len(merge) == 1, merge


def test_specialization_rule_sees_counts_that_are_specialised() -> None:
    """The rule itself: an int that is not marked keeps its ``== 1`` / ``% 16`` classes (so the test above
    fails if a count loses its ``do_not_specialize`` mark)."""
    kernel = _triton_fwd.ffa_fwd_kernel
    params = inspect.signature(kernel.fn).parameters
    base = {n: (1 if "constexpr" in str(p.annotation) else 32) for n, p in params.items()}
    assert "total_q" in _dns(kernel) and "GROUP" not in _dns(kernel)
    one, two = dict(base, GROUP=1), dict(base, GROUP=2)
    assert specialization(kernel, one) != specialization(kernel, two)
    assert specialization(kernel, dict(base, total_q=1)) == specialization(kernel, dict(base, total_q=17))
