"""Test helpers: random consistent tables for all ranks, plain-torch references, a rank launcher.

The references take every rank's tensors (index = rank, e.g. from an all-gather) and compute what rank
``r`` must end with by direct indexing, with no use of the library's routing code.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import random
import sys
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

from ._tables import CastTables, offsets


@dataclass(frozen=True, slots=True)
class RankCastTables:
    """One rank's GroupCast tables as plain lists (the public call's arguments)."""

    input_split_sizes: list[int]
    output_split_sizes: list[int]
    dst_indices: list[list[int]]
    src_index: list[int]

    def args(self) -> tuple:
        return (self.input_split_sizes, self.output_split_sizes, self.dst_indices, self.src_index)

    def transpose_args(self) -> tuple:
        """GroupReduce arguments moving data back: (in sizes, out sizes, dst_index, src_indices)."""
        return (self.output_split_sizes, self.input_split_sizes, self.src_index, self.dst_indices)


def random_cast_tables(
    world_size: int, seed: int, max_pieces: int = 5, max_size: int = 4
) -> list[RankCastTables]:
    """Consistent GroupCast tables for every rank (index = rank), identical on every rank for one seed.

    Covers empty destination sets, zero-size pieces, multicast to every rank, self-sends, and (with a
    ~1/4 chance per rank) ranks that send nothing and ranks that receive nothing. A source's pieces
    arrive in its order but interleaved randomly with other sources' pieces.
    """
    rng = random.Random(seed)
    silent = {r for r in range(world_size) if rng.random() < 0.25}  # send nothing
    deaf = {r for r in range(world_size) if rng.random() < 0.25}  # receive nothing
    hearing = [r for r in range(world_size) if r not in deaf]
    ins, dsts = [], []
    for s in range(world_size):
        n = 0 if s in silent else rng.randint(1, max_pieces)
        sizes = [rng.choice([0, *range(1, max_size + 1)]) for _ in range(n)]
        d = []
        for _ in range(n):
            kind = rng.random()
            if kind < 0.15 or not hearing:
                d.append([])
            elif kind < 0.35:
                d.append(list(hearing))  # multicast to every rank that receives
            else:
                k = rng.randint(1, len(hearing))
                d.append(sorted(rng.sample(hearing, k), key=lambda _: rng.random()))
        ins.append(sizes)
        dsts.append(d)
    out = []
    for r in range(world_size):
        queues = [[ins[s][i] for i in range(len(ins[s])) if r in dsts[s][i]] for s in range(world_size)]
        order = [s for s in range(world_size) for _ in queues[s]]
        rng.shuffle(order)  # interleave sources; each source's own order is kept by popping in order
        pos = [0] * world_size
        out_sizes, src = [], []
        for s in order:
            out_sizes.append(queues[s][pos[s]])
            src.append(s)
            pos[s] += 1
        out.append(RankCastTables(ins[r], out_sizes, dsts[r], src))
    return out


def _matches(tables: list[RankCastTables], r: int) -> list[tuple[int, int, int]]:
    """(output piece j of rank r, source s, input piece i of s) triples, by the matching rule."""
    sent = {s: [i for i, d in enumerate(t.dst_indices) if r in d] for s, t in enumerate(tables)}
    pos = dict.fromkeys(sent, 0)
    triples = []
    for j, s in enumerate(tables[r].src_index):
        triples.append((j, s, sent[s][pos[s]]))
        pos[s] += 1
    return triples


def reference_cast(tables: list[RankCastTables], inputs: list[torch.Tensor], r: int) -> torch.Tensor:
    """What rank ``r``'s GroupCast output must be, from every rank's input."""
    t = tables[r]
    out = inputs[r].new_empty((sum(t.output_split_sizes), *inputs[r].shape[1:]))
    o_off = offsets(t.output_split_sizes)
    for j, s, i in _matches(tables, r):
        i_off = offsets(tables[s].input_split_sizes)[i]
        n = t.output_split_sizes[j]
        out[o_off[j] : o_off[j] + n] = inputs[s][i_off : i_off + n]
    return out


def reference_reduce(
    tables: list[RankCastTables],
    inputs: list[torch.Tensor],
    output: torch.Tensor,
    r: int,
    reduce_op: str = "sum",
    input_lses: list[torch.Tensor] | None = None,
    output_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What rank ``r`` must hold after GroupReduce with the *transposed* tables of ``tables``.

    ``inputs[s]`` is rank s's reduce input (laid out like its cast output); ``output`` is rank r's
    output before the call. Computed in fp64. Returns (output, output_lse or None).
    """
    out = output.to(torch.float64).clone()
    lse = None if output_lse is None else output_lse.to(torch.float64).clone()
    in_off = offsets(tables[r].input_split_sizes)  # reduce output pieces = cast input pieces of r
    for i, size in enumerate(tables[r].input_split_sizes):
        contribs = []
        for s in tables[r].dst_indices[i]:
            j = next(j for j, s2, i2 in _matches(tables, s) if s2 == r and i2 == i)
            j_off = offsets(tables[s].output_split_sizes)[j]
            x = inputs[s][j_off : j_off + size].to(torch.float64)
            xl = None if input_lses is None else input_lses[s][j_off : j_off + size].to(torch.float64)
            contribs.append((x, xl))
        if not contribs:
            continue
        rows = slice(in_off[i], in_off[i] + size)
        if reduce_op == "sum":
            out[rows] += sum(x for x, _ in contribs)
        elif reduce_op == "avg":
            out[rows] += sum(x for x, _ in contribs) / len(contribs)
        else:
            terms = [(out[rows], lse[rows]), *contribs]
            all_l = torch.stack([l for _, l in terms])  # [k, n, H]
            new_l = torch.logsumexp(all_l, 0)
            safe = torch.where(torch.isinf(new_l), torch.zeros_like(new_l), new_l)
            acc = torch.zeros_like(out[rows])
            for x, l in terms:
                w = torch.exp(l - safe).view(*l.shape, *([1] * (x.dim() - 2)))
                acc += torch.where(w > 0, x * w, torch.zeros_like(x))
            empty = torch.isinf(new_l).view(*new_l.shape, *([1] * (out.dim() - 2)))
            out[rows] = torch.where(empty, out[rows], acc)
            lse[rows] = new_l
    return out, lse


def cast_tables_of(t: RankCastTables, world_size: int) -> CastTables:
    """Validated :class:`CastTables` of one rank."""
    return CastTables.build(*t.args(), world_size)


# ---------------------------------------------------------------------------------------------------
# Rank launcher: one launch of ``world_size`` processes runs a whole battery of checks.


def _child(
    rank: int, world_size: int, init_file: str, path: str, fn_name: str, args: tuple, result: str
) -> None:
    import torch.distributed as dist

    try:
        spec = importlib.util.spec_from_file_location(f"_gc_worker_{os.getpid()}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses in the file look their module up
        spec.loader.exec_module(module)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=90),
        )
        try:
            value = getattr(module, fn_name)(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        payload = ("ok", value)
    except BaseException as exc:  # reported to the parent with the traceback
        payload = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(result, "wb") as f:
        pickle.dump(payload, f)


def run_ranks(world_size: int, path: str, fn_name: str, *args, timeout: float = 180.0) -> list:
    """Run ``fn_name(rank, world_size, *args)`` from the file ``path`` on ``world_size`` gloo ranks.

    Ranks are forked from a clean forkserver (fast, and safe even if the parent ran threaded torch ops),
    initialised with a ``file://`` store in a fresh temp dir. Returns the per-rank return values; raises
    AssertionError with every failing rank's traceback.
    """
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "magi_group_collective"])
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        results = [os.path.join(tmp, f"r{r}.pkl") for r in range(world_size)]
        procs = [
            ctx.Process(target=_child, args=(r, world_size, init, path, fn_name, args, results[r]))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        values, errors = [], []
        for r in range(world_size):
            if not os.path.exists(results[r]):
                errors.append(f"rank {r}: no result ({'hung' if r in hung else 'died'})")
                values.append(None)
                continue
            with open(results[r], "rb") as f:
                status, value = pickle.load(f)
            (values if status == "ok" else errors).append(value)
        if errors:
            raise AssertionError("\n".join(errors))
        return values
