"""Input checks that every rank agrees on, so one rank's bad input never leaves the others hanging.

By default each rank validates its own arguments before the first collective; since keys and shapes are
usually computed the same way on every rank, bad input then fails on every rank. When only some ranks
could be wrong (data-dependent shapes), set `MAGI_ATTENTION_SANITY_CHECK=1`: the ranks then exchange one
row (a tiny all-gather of an error flag, the call site and the values every rank must pass alike: dtypes,
softmax_scale, softcap; it syncs the host, hence off by default) and all raise together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .env import sanity_check_enabled


def device_of(x: object) -> torch.device:
    """Device for the sanity flag: the tensor's, or the CPU when the argument is not a tensor."""
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


_MAX_VALUES = 6
_DTYPES = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip


def dtype_code(dtype: torch.dtype) -> int:
    """A small int per dtype, the same on every rank (for the sanity exchange)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def tensor_values(x: object, name: str) -> dict[str, float]:
    """What every rank must pass alike for a token tensor: its dtype and the size of one token (dim 0 aside)."""
    if not isinstance(x, torch.Tensor) or x.ndim < 1:
        return {}
    return {f"{name}.dtype": dtype_code(x.dtype), f"{name}.shape[1:]": float(x[:1].numel())}


def validate_on_all_ranks(
    check: Callable[[], None],
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    site: str = "",
    values: Callable[[], dict[str, float]] | None = None,
) -> None:
    """Run `check` (which raises ValueError/TypeError); in sanity mode make every rank raise if any rank does,
    and (with `values`, called after a passing check) if the ranks passed different values, naming them.

    The sanity exchange is one all-gather of a fixed-size row (flag, call site, up to 6 values), so ranks at
    different call sites are told so instead of crossing collectives."""
    if group is None or not sanity_check_enabled():
        check()
        return
    error: Exception | None = None
    row = [0.0] * (3 + _MAX_VALUES)
    named: dict[str, float] = {}
    try:
        check()
        named = dict(values()) if values is not None else {}
    except (ValueError, TypeError) as exc:
        error = exc
        row[0] = 1.0
    row[1] = float(_site_code(site))
    row[2] = float(len(named))
    row[3 : 3 + len(named)] = [float(v) for v in list(named.values())[:_MAX_VALUES]]
    flag_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(row, dtype=torch.float64, device=flag_device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    rows = [p.tolist() for p in parts]
    if error is not None:
        raise error
    me = dist.get_rank(group)
    failed = [r for r, x in enumerate(rows) if x[0]]
    if failed:
        raise ValueError(
            f"{len(failed)} other rank(s) of the cp group ({failed}) rejected their input (see their error); "
            f"rank {me} stops too instead of waiting in a collective"
        )
    sites = {r: _SITES[int(x[1])] if int(x[1]) < len(_SITES) else "?" for r, x in enumerate(rows)}
    if len(set(sites.values())) > 1:
        raise ValueError(
            f"ranks are in different calls (sanity check): {sites}; every rank must make the same calls"
        )
    problems = []
    for i, name in enumerate(list(named)[:_MAX_VALUES]):
        seen: dict[float, list[int]] = {}
        for r, x in enumerate(rows):
            seen.setdefault(x[3 + i], []).append(r)
        if len(seen) > 1:
            problems.append(
                f"`{name}` differs: " + ", ".join(f"ranks {rs}: {_show(name, v)}" for v, rs in seen.items())
            )
    if problems:
        raise ValueError(
            f"ranks passed different arguments to {site or 'this call'} (sanity check): "
            + "; ".join(problems)
        )


_SITES = ("", "dispatch", "undispatch", "dispatch_kv", "undispatch_kv", "calc_attn", "roll")


def _site_code(site: str) -> int:
    return _SITES.index(site) if site in _SITES else 0


def _show(name: str, value: float) -> str:
    if name.endswith("dtype"):
        i = int(value)
        return str(_DTYPES[i]) if i < len(_DTYPES) else "another dtype"
    return repr(value)
