"""The public signatures of the three FFA packages' entry points, snapshotted: the one FFA contract binds
each backend's `flex_flash_attn_func` / `ffa_fwd` / `ffa_bwd`, and `inspect.signature` must keep showing every
parameter (name, kind, default) of each; `deterministic` is in every backend's `flex_flash_attn_func`. Runs on
the CPU without FA4 or cuDNN installed (their interface modules import without them)."""

from __future__ import annotations

import inspect

import pytest

P, K = "positional", "keyword"

_QKV = [("q", P, None), ("k", P, None), ("v", P, None)]
_TABLES = [("q_ranges", P, None), ("k_ranges", P, None), ("attn_type_map", P, "None")]
_SCALARS = [("softmax_scale", K, "None"), ("softcap", K, "0.0"), ("deterministic", K, "False")]
_ACC = [("out", K, "None"), ("lse", K, "None")]
_BACKEND = [("backend", K, "None")]
_FWD_TAIL = [("sink", K, "None"), ("return_max_logits", K, "False")]
_BWD_HEAD = [("do", P, None), *_QKV, ("out", P, None), ("lse", P, None)]
_GRADS = [("dq", K, "None"), ("dk", K, "None"), ("dv", K, "None")]
_BWD_TAIL = [("dlse", K, "None"), ("sink", K, "None")]

FLEX = [*_QKV, *_TABLES, *_SCALARS, *_ACC, *_FWD_TAIL]
EXPECTED = {
    ("magi_ffa", "flex_flash_attn_func"): FLEX,
    ("magi_ffa", "ffa_fwd"): [*_QKV, *_TABLES, *_SCALARS, *_ACC, *_BACKEND, *_FWD_TAIL],
    ("magi_ffa", "ffa_bwd"): [*_BWD_HEAD, *_TABLES, *_SCALARS, *_GRADS, *_BACKEND, *_BWD_TAIL],
    ("magi_ffa_fa4", "flex_flash_attn_func"): FLEX,
    ("magi_ffa_fa4", "ffa_fwd"): [*_QKV, *_TABLES, *_SCALARS, *_ACC, *_FWD_TAIL],
    ("magi_ffa_fa4", "ffa_bwd"): [*_BWD_HEAD, *_TABLES, *_SCALARS, *_GRADS, *_BWD_TAIL],
    ("magi_ffa_cudnn", "flex_flash_attn_func"): FLEX,
    ("magi_ffa_cudnn", "ffa_fwd"): [*_QKV, *_TABLES, *_SCALARS, *_ACC, *_FWD_TAIL],
    ("magi_ffa_cudnn", "ffa_bwd"): [*_BWD_HEAD, *_TABLES, *_SCALARS, *_GRADS, *_BWD_TAIL],
}


def _shape(fn) -> list[tuple[str, str, str | None]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        kind = K if p.kind == inspect.Parameter.KEYWORD_ONLY else P
        assert p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD), p
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append((p.name, kind, default))
    return out


@pytest.mark.parametrize(("module", "name"), sorted(EXPECTED))
def test_public_signature(module: str, name: str) -> None:
    mod = pytest.importorskip(module)
    assert _shape(getattr(mod, name)) == EXPECTED[(module, name)]
