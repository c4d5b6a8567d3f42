"""Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks (file:// rendezvous, no port)."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback

import torch.distributed as dist


def _worker(fn, rank, world_size, init, results, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
        results.put((rank, None, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0) -> list:
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="magi_mc_") as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, init, results, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes = {}
        try:
            while len(outcomes) < world_size:
                rank, err, value = results.get(timeout=timeout)
                outcomes[rank] = (err, value)
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=5 if len(outcomes) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = [f"--- rank {r} ---\n{e}" for r, (e, _) in sorted(outcomes.items()) if e]
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        errors.append(f"ranks {missing} did not finish within {timeout} s")
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]
