"""A new key's route on gloo (one launch of 2 ranks): one host exchange for the key (its parts, the build's
status, what each rank can run and imported) and one for `dispatch`, nothing else; ranks with different
backends still agree; a kernel library that fails to import on one rank raises on every rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import magi_attention._runtime.kernels as kernels
import magi_attention._runtime.key_route as key_route
import magi_group_collective.agreement as agreement
from magi_attention import DistAttnConfig
from magi_attention.api import dispatch, get_kernel_backend, magi_attn_flex_key
from magi_attention.testing import run_distributed

TOTAL, HQ, HKV, D = 64, 2, 1, 8


def _key(docs: list[list[int]], config: DistAttnConfig | None = None):
    return magi_attn_flex_key(docs, docs, [1] * len(docs), TOTAL, TOTAL, HQ, HKV, D, dist.group.WORLD, config)


def _count_exchanges(fn) -> dict[str, int]:
    """The host exchanges (`_HostGroup.gather`) and the c10d all-gathers `fn` makes."""
    counts = {"host": 0, "all_gather": 0, "all_gather_object": 0}
    real = agreement._HostGroup.gather, dist.all_gather, dist.all_gather_object

    def host(self, t):
        counts["host"] += 1
        return real[0](self, t)

    def plain(*a, **k):
        counts["all_gather"] += 1
        return real[1](*a, **k)

    def objects(*a, **k):
        counts["all_gather_object"] += 1
        return real[2](*a, **k)

    agreement._HostGroup.gather, dist.all_gather, dist.all_gather_object = host, plain, objects
    try:
        fn()
    finally:
        agreement._HostGroup.gather, dist.all_gather, dist.all_gather_object = real
    return counts


def _worker(rank: int, world: int) -> None:
    x = torch.randn(TOTAL, 4)
    key_route.clear_agreements()
    # 1. a new key + dispatch: the key's agreement and dispatch's, the first key of its kind included
    for docs in ([[0, 40], [40, 64]], [[0, 8], [8, 64]]):
        counts = _count_exchanges(lambda docs=docs: dispatch(x, _key(docs)))
        assert counts == {"host": 2, "all_gather": 2, "all_gather_object": 0}, counts

    # 2. rank 1 can run one more backend than rank 0: the digests differ, the full lists are exchanged,
    # and both ranks keep the backends they share
    key_route.clear_agreements()
    real_probe = kernels.probe_local
    if rank == 1:

        def probe(requested):
            local = real_probe(requested)
            return dataclasses.replace(local, usable=tuple(sorted({*local.usable, "only_on_rank_1"})))

        kernels.probe_local = probe
    try:
        key = _key([[0, 16], [16, 64]])
    finally:
        kernels.probe_local = real_probe
    backends = [None] * world
    dist.all_gather_object(backends, get_kernel_backend(key, torch.float32)[0])
    assert len(set(backends)) == 1, backends

    # 3. the chosen kernel library fails to import on rank 1: every rank raises at the key build
    key_route.clear_agreements()
    real_import = key_route.import_libraries
    if rank == 1:
        key_route.import_libraries = lambda choice: ImportError("kernel_backend='torch': lib does not import")
    try:
        _key([[0, 24], [24, 64]], DistAttnConfig(kernel_backend="torch"))
        raise AssertionError("the key build did not raise")
    except ImportError as exc:  # the failing rank: its own error
        assert rank == 1 and "does not import" in str(exc), exc
    except ValueError as exc:  # the others: named the rank and the library
        assert rank == 0 and "[1]" in str(exc) and "does not import" in str(exc), exc
    finally:
        key_route.import_libraries = real_import
    # and the group is in step afterwards
    dispatch(x, _key([[0, 24], [24, 64]], DistAttnConfig(kernel_backend="torch")))


def test_key_route_exchanges_once_and_fails_together() -> None:
    run_distributed(_worker, 2, timeout=120)
