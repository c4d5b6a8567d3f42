"""Helpers shared by magi_attention's tests and the demo: run a function on N local ranks.

`run_distributed(fn, world_size, *args)` starts `world_size` processes joined in one group (file://
rendezvous in a fresh temp dir, never a fixed port), runs `fn(rank, world_size, *args)` on each, and
raises with every failing rank's traceback. A rank that hangs (a collective that one rank never joined)
is killed after `timeout` seconds and reported, so a test fails instead of hanging CI.

Forking is ~50x cheaper than spawning; it is safe because callers export OMP_NUM_THREADS=1 before Python
starts (scripts/dev.sh does), so the parent holds no OpenMP thread pool.

`solved_elsewhere(fn, *args)` runs a dispatch solve (`prepare_varlen_dispatch`, ...) in a freshly spawned
process, as a data-loader worker would, so neither this process nor ranks forked from it learn the answer;
`moved_to_next_rank(prepared)` turns it into a valid placement no solve makes, and
`token_ids_on_rank(prepared, rank)` gives the tokens a key that took it holds, so a test sees whether a key
took what it was handed.

`failure_checks` turns the always-on failure checks off inside a block and `failure_check_calls` gives each
of them as a call of its own, so their cost can be measured (`python -m benchmarks checks-overhead`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .env import child_process_env


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, init: str, backend: str, results: Any, args: tuple
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)
        # Plain pickle bytes: the queue's own pickler would pass tensors as shared-memory handles,
        # which die with this process before the parent reads them.
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, None, value))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 600.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` local ranks; return each rank's result.

    gloo ranks are forked; NCCL ranks are spawned (CUDA cannot be forked), so `fn` must then be a
    module-level function of an importable module.
    """
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="magi_dist_") as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, init, backend, results, args), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str | None, Any]] = {}
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
    failures = [f"--- rank {r} ---\n{err}" for r, (err, _) in sorted(outcomes.items()) if err]
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        failures.append(f"ranks {missing} did not finish within {timeout} s (hung in a collective?)")
    if failures:
        raise AssertionError(f"distributed run (world_size={world_size}) failed:\n" + "\n".join(failures))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def solved_elsewhere(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` in a freshly spawned process (`fn` importable by name, e.g.
    `magi_attention.api.prepare_varlen_dispatch`): the planner cache of this process, and of ranks it forks
    later, does not learn what it solved (a process keeps the first answer it has for a mask)."""
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def moved_to_next_rank(prepared: Any) -> Any:
    """A `PreparedDispatch` with each rank's chunks (and their areas) moved to the next rank: a valid
    placement of the same request that no solve makes. A key built after adopting it holds rank r's tokens
    of `prepared` on rank r + 1."""
    import dataclasses

    plan = prepared.plan
    moved = dataclasses.replace(
        plan,
        partitions=plan.partitions[-1:] + plan.partitions[:-1],
        rank_areas=plan.rank_areas[-1:] + plan.rank_areas[:-1],
    )
    return dataclasses.replace(prepared, plan=moved)


def token_ids_on_rank(prepared: Any, rank: int) -> list[int]:
    """Global token ids of `rank`'s tokens under `prepared`'s placement, as `get_position_ids` of a key that
    took it reports them (a padding token repeats the last real token's id)."""
    last = int(prepared.request[1]) - 1  # the request's unpadded token count
    return [min(int(x), last) for x in prepared.plan.position_ids(rank)]


def run_docs_example(
    page: str | os.PathLike[str], nproc: int, workdir: str | os.PathLike[str], *, timeout: float = 540.0
) -> subprocess.CompletedProcess:
    """Run a docs page's complete example as written: its one ```python block that initialises a process group,
    launched with `torchrun --standalone --nproc-per-node nproc` on CPU ranks (gloo) in `workdir`.

    Args:
        page: the markdown page.
        nproc: ranks to launch.
        workdir: where the script is written and run.
        timeout: seconds before the run is killed.

    Returns:
        The finished process (stdout and stderr captured as text); raises AssertionError if the page does not
        hold exactly one such block. A run that fails only by gloo's rare abort at process teardown is run
        once more (its stderr says so).
    """
    blocks = re.findall(r"```python\n(.*?)```", Path(page).read_text(), flags=re.S)
    runnable = [b for b in blocks if "init_process_group" in b]
    assert len(runnable) == 1, (
        f"{page} should hold exactly one complete runnable example, found {len(runnable)}"
    )
    script = Path(workdir) / "docs_example.py"
    script.write_text(runnable[0])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
    ]
    env = child_process_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=workdir)
    if proc.returncode != 0 and _GLOO_TEARDOWN_ABORT in proc.stderr:
        # Rarely (once in dozens of runs on 2 CPU cores, never reproduced on demand) a rank aborts in gloo's
        # C++ teardown after the script has finished and destroyed its process group: a std::thread left
        # joinable at exit. The example itself ran; one fresh run tells a flaky teardown from a real failure.
        first = proc
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=workdir)
        proc.stderr = f"[first run aborted in teardown, rerun once]\n{first.stderr[-2000:]}\n{proc.stderr}"
    return proc


_GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


@contextmanager
def failure_checks(
    *, call_agreement: bool = True, key_fingerprint: bool = True, table_check: bool = True
) -> Iterator[None]:
    """Turn failure checks (docs/failure_modes.md) off inside the block, to measure what they cost; never
    for training, where a bad call would then hang or corrupt results instead of raising.

    - ``call_agreement=False``: every public call runs its local checks only, without the status
      agreement across the cp group.
    - ``key_fingerprint=False``: a new key is planned without comparing it with the other ranks' keys.
    - ``table_check=False``: a plan built on a device does not gather and compare every rank's
      group-collective tables.

    Every rank must enter the block with the same arguments (the checks are collective). Not thread-safe:
    it swaps module attributes for the block's duration.
    """
    import magi_group_collective._plan as grpcoll_plan

    from . import api, dispatch, dist_attn, roll
    from ._runtime.checks import _calc_attn, _call_agreement

    def local_call(cp_group, call, check, *, same=None, extra=None):
        check()
        return [list(extra()) if extra is not None else [] for _ in range(cp_group.size)]

    def local_checked(cp_group, call, check, *, same=None, extra=None):
        checked = check()
        return checked, [list(extra(checked)) if extra is not None else [] for _ in range(cp_group.size)]

    swaps = []
    if not call_agreement:
        for module in (_call_agreement, _calc_attn, api, dispatch, dist_attn, roll):
            for name, local in (("agree_on_call", local_call), ("agree_on_checked", local_checked)):
                if hasattr(module, name):
                    swaps.append((module, name, local))
    if not key_fingerprint:
        swaps.append((api, "agree_on_key", lambda *args, **kwargs: None))
    if not table_check:
        swaps.append((grpcoll_plan, "_gather_tables", lambda *args, **kwargs: None))
    saved = [(module, name, getattr(module, name)) for module, name, _ in swaps]
    try:
        for module, name, value in swaps:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def failure_check_calls(
    key: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    """Each always-on failure check of `calc_attn` on ``key`` as a call of its own, to time it alone:

    - ``"key_fingerprint"``: the new-key exchange (one all-gather of the key's parts; collective).
    - ``"call_agreement"``: `calc_attn`'s forward status agreement (collective; nothing on cp 1).
    - ``"local_checks"``: the checks that need no communication (dtype, scalars, dispatch tags of q, k, v).
    - ``"device_plan"``: the key's plan built again on q's device (collective: it runs the table check
      unless `failure_checks` turned it off).

    ``q``, ``k``, ``v``: local shards from `dispatch` with ``key`` (``[shard_seqlen, heads, head_dim]``).
    """
    from ._runtime.cache import RUNTIME_CACHE
    from ._runtime.checks import agree_on_call, agree_on_key, check_dispatch_tags, check_dtype, check_scalars

    runtime = RUNTIME_CACHE.get(key)
    same = {
        "q.dtype": q.dtype,
        "softmax_scale": key.head_dim**-0.5,
        "softcap": 0.0,
        "return_max_logits": False,
    }

    def local_checks() -> None:
        check_dtype(q)
        check_scalars(None, 0.0, key.head_dim)
        check_dispatch_tags(runtime, q=q, k=k, v=v)

    def device_plan() -> object:
        runtime._device_meta.clear()
        return runtime.device_meta(q.device)

    return {
        "key_fingerprint": lambda: agree_on_key(key, False),
        "call_agreement": lambda: agree_on_call(
            key.cp_group, "calc_attn (forward)", lambda: None, same=lambda: same, extra=lambda: [0]
        ),
        "local_checks": local_checks,
        "device_plan": device_plan,
    }
