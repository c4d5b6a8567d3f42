"""What every rank of a cp group can run, and whether it imported the chosen kernel libraries: told to the
others inside the key's own agreement, not in exchanges of their own.

A new key's kernel choice needs every rank's usable backends (`kernels.resolve`). Each rank builds the key
assuming the others can run what it can (the common case: the same software on every rank) and sends, in the
key's agreement (`checks._key_agreement`), a word of two integers: a digest of what it can run (GPU kind,
usable backends, why not the requested one; 0 when the choice of this kind is agreed already) and a flag when
the chosen kernel libraries failed to import here (`KeyWord`). Equal digests: the choice each rank made is
the one every rank made. Different digests (ranks with different software): every rank exchanges the full
lists (`gather_rank_backends`) and chooses again from them. A failed import makes every rank raise before
any data moves (`agree_imports`: the failing rank its ImportError, the others an AgreementError naming it).

Choices are cached per (group, requested backend, head_dim, deterministic mode); imports per backends.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import NamedTuple

from magi_group_collective.agreement import agree, host_group_of

from ..env import kernel_backend_override
from ..key import CpGroup, DistAttnRuntimeKey
from . import kernels
from .kernels import AUTO, KernelChoice, RankBackends, ffa_backend

__all__ = [
    "KeyWord", "agree_imports", "agreed_choice", "choice_key", "clear_agreements", "digest", "every_rank",
    "gather_rank_backends", "import_libraries", "imported", "note_imported", "probe_local", "remember",
    "requested_backend",
]  # fmt: skip


class KeyWord(NamedTuple):
    """This rank's part of the key agreement about kernels (the `extra` integers of its row)."""

    digest: int
    """A 63-bit digest of this rank's `RankBackends` (never 0), or 0 when the choice was agreed before."""
    import_failed: int
    """1 when the chosen backends' kernel libraries failed to import on this rank."""


def requested_backend(configured: str) -> str:
    """The config's backend, with `auto` overridden by MAGI_ATTENTION_KERNEL_BACKEND."""
    override = kernel_backend_override()
    return str(override if configured == AUTO and override is not None else configured)


def choice_key(key: DistAttnRuntimeKey) -> tuple:
    """What a kernel choice is cached by: group, requested backend, head_dim, deterministic mode."""
    group, requested = key.cp_group, requested_backend(key.config.kernel_backend)
    return (group.name, group.ranks, requested, key.head_dim, bool(key.config.deterministic))


def digest(local: RankBackends) -> int:
    """A 63-bit digest of `local`, never 0 (the same value in every process)."""
    data = json.dumps([local.gpu_kind, list(local.usable), local.missing]).encode()
    return (int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1) or 1


_AGREED: dict[tuple, KernelChoice] = {}
"""Choices every rank of a group made alike (by `choice_key`)."""


def agreed_choice(key: DistAttnRuntimeKey) -> KernelChoice | None:
    """The key's kernel choice if one of its kind was agreed before (None: not yet)."""
    return _AGREED.get(choice_key(key))


def remember(key: DistAttnRuntimeKey, choice: KernelChoice) -> None:
    """Keep `choice` as agreed for keys of `key`'s kind."""
    _AGREED[choice_key(key)] = choice


def gather_rank_backends(cp_group: CpGroup, local: RankBackends) -> list[RankBackends]:
    """Every rank's backends (collective on the host; only when the digests differed, or a key is rebuilt
    without an agreement of its own): the sorted names travel as bytes, so ranks that registered other
    backends still meet in one exchange."""
    group = cp_group.group
    if group is None or cp_group.size == 1:
        return [local]
    mine = json.dumps([local.gpu_kind, list(local.usable), local.missing]).encode()
    parts = host_group_of(group).gather_bytes(mine)
    return [RankBackends(kind, tuple(usable), why) for kind, usable, why in map(json.loads, parts)]


_IMPORTED: set[tuple[str, ...]] = set()
"""Backends whose kernel libraries imported on every rank (recorded after the ranks agreed on it)."""


def _libraries(choice: KernelChoice) -> tuple[str, ...]:
    return tuple(sorted({str(choice.backend), str(choice.backward or choice.backend)}))


def imported(choice: KernelChoice) -> bool:
    """The choice's kernel libraries imported before, on every rank (nothing to import or agree)."""
    return _libraries(choice) in _IMPORTED


def note_imported(choice: KernelChoice) -> None:
    """Record that every rank imported the choice's kernel libraries (after the ranks agreed on it)."""
    _IMPORTED.add(_libraries(choice))


def import_libraries(choice: KernelChoice) -> ImportError | None:
    """Import the kernel libraries of the choice's forward and backward backends, and only those (the probes
    read what is installed without importing it); the error, naming the library, when one fails (None when
    all import). Local: the caller tells the other ranks (`KeyWord.import_failed`, `agree_imports`)."""
    for name in _libraries(choice):
        cap = ffa_backend(name).capability
        if cap.install_check is None:
            continue
        try:
            cap.install_check()
        except Exception as exc:  # a vendor may raise anything while it imports (OSError, RuntimeError)
            vendors = " and ".join(dist for dist, _ in cap.requires) or cap.package
            error = ImportError(
                f"kernel_backend={name!r}: {vendors} is installed but does not import on this rank "
                f"({type(exc).__name__}: {exc})"
            )
            error.__cause__ = exc
            return error
    return None


def agree_imports(cp_group: CpGroup, error: ImportError | None) -> None:
    """Raise on every rank when the kernel libraries failed to import on one (its ImportError there, an
    AgreementError naming it and the library on the others); one exchange, on a group of several ranks."""
    if cp_group.group is not None and cp_group.size > 1:
        agree(cp_group.group, "magi_attention key: import the kernel libraries", error=error)
    elif error is not None:
        raise error


def probe_local(requested: str) -> RankBackends:
    """What this process can run (`kernels.probe_local`, looked up at call time so tests can replace it)."""
    return kernels.probe_local(requested)


def clear_agreements() -> None:
    """Forget every agreed choice and import (the next key of each kind exchanges again)."""
    _AGREED.clear()
    _IMPORTED.clear()


def every_rank(words: Sequence[Sequence[int]]) -> tuple[bool, bool]:
    """From every rank's `KeyWord` in the key agreement: (the digests are all equal, some import failed)."""
    digests = {tuple(w[:1]) for w in words}
    return len(digests) == 1, any(len(w) > 1 and w[1] for w in words)
