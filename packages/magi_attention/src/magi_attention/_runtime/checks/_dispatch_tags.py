"""A cheap tag that catches tensors dispatched with one key and used with another.

The rule: a tensor dispatched with key A may only be used with A or with a key made from A after dispatch
(`make_flex_key_for_new_mask_after_dispatch`): those share A's token placement. A key of another mask with
the same shapes places tokens differently, and nothing in the shapes shows it.

So `dispatch` and `calc_attn` remember, per output tensor (by identity, through a weak reference: no
tensor is kept alive and nothing is stored on the tensor), the root key of their layout; `calc_attn` and
`undispatch` compare the tags of their inputs with their key's root. Tensors computed from a tagged one
(a projection, a view) carry no tag and are not checked: the tag catches the direct misuse (dispatching
q, k, v and passing them on; undispatching calc_attn's output), at the cost of a dict look-up. Skipped
while torch.compile traces.
"""

from __future__ import annotations

import weakref

import torch

_TAGS: dict[int, tuple[weakref.ref, object]] = {}


def _compiling() -> bool:
    try:
        return torch.compiler.is_compiling()
    except AttributeError:  # pragma: no cover - old torch
        return False


def tag_output(t: torch.Tensor, runtime: object) -> torch.Tensor:
    """Remember that `t` is laid out as `runtime`'s key's root dispatches it."""
    if isinstance(t, torch.Tensor) and not _compiling():
        i = id(t)
        try:
            ref = weakref.ref(t, lambda _r, i=i: _TAGS.pop(i, None))
        except TypeError:  # pragma: no cover - tensor subclasses without weakrefs
            return t
        _TAGS[i] = (ref, runtime.key.root_key)
    return t


def tag_of(t: object) -> object | None:
    entry = _TAGS.get(id(t))
    if entry is None or entry[0]() is not t:
        return None
    return entry[1]


def check_dispatch_tags(runtime: object, **tensors: object) -> None:
    """ValueError when a tensor's tag names another token placement than `runtime`'s key."""
    if not _TAGS or _compiling():
        return
    root = runtime.key.root_key
    for name, t in tensors.items():
        tag = tag_of(t)
        if tag is None or tag is root or tag == root:
            continue
        raise ValueError(
            f"`{name}` was dispatched (or computed by calc_attn) with another key than the one given here: "
            "its tokens are placed for a different mask, so the result would be silently wrong. Use the key "
            "the tensors were dispatched with, or a key made from it with "
            "make_flex_key_for_new_mask_after_dispatch / make_varlen_key_for_new_mask_after_dispatch"
        )
