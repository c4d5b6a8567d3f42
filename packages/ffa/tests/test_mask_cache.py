"""``magi_ffa.mask_cache``: one entry per mask (checked slices + every backend's launch data), found by the
tables' identity and version, else by value; bounded in entries and bytes; cleared; thread-safe; and the
public functions check a known mask no more (no host copy, no re-check, no rebuild of launch data)."""

from __future__ import annotations

import threading

import pytest
import torch

import magi_ffa
from magi_ffa import mask_cache
from magi_ffa._ops import _torch_backward, _torch_forward
from magi_ffa.contract import BackendCapability, FFABackend, Launchers, register_backend
from magi_ffa.mask_cache import MaskValueCache, clear_mask_caches

QR, KR, TM = [[0, 4], [4, 8]], [[0, 4], [0, 8]], [1, 0]


def _tables(dtype=torch.int32):
    return tuple(torch.tensor(x, dtype=dtype) for x in (QR, KR, TM))


class _Counts:
    def __init__(self) -> None:
        self.prepare = 0
        self.host = 0


@pytest.fixture
def counted(monkeypatch):
    """A torch-path backend whose ``prepare`` counts its calls, and a count of the cache's host copies."""
    counts = _Counts()

    def prepare(q, k, checked):
        counts.prepare += 1
        return checked.slices

    real_host = mask_cache.host_tables

    def host(*a):
        counts.host += 1
        return real_host(*a)

    monkeypatch.setattr(mask_cache, "host_tables", host)
    cap = BackendCapability(
        name="counted_torch", title="counted", package="tests", dtypes=(torch.float32,),
        head_dim_ok=lambda d: True, head_dim_rule="any", device="any", accumulates=True,
    )  # fmt: skip
    be = register_backend(FFABackend(cap, Launchers(_torch_forward, _torch_backward, prepare)))
    clear_mask_caches()
    yield be, counts
    clear_mask_caches()


def _qkv(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 2, 16, generator=g).requires_grad_() for _ in range(3)]


def _step(be, tables):
    q, k, v = _qkv()
    out, lse = be.flex_flash_attn_func(q, k, v, *tables)
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_repeated_calls_check_and_prepare_once(counted, dtype) -> None:
    """Forward + backward of a new mask: one host copy, one check, one build; again with the same tensors:
    none (the ops find the entry by identity); fresh tensors of the same values: one host copy, no build."""
    be, counts = counted
    tables = _tables(dtype)
    ref = _step(be, tables)
    assert (counts.host, counts.prepare) == (1, 1)
    for _ in range(3):
        again = _step(be, tables)
    assert (counts.host, counts.prepare) == (1, 1)
    fresh = _step(be, _tables(dtype))
    assert (counts.host, counts.prepare) == (2, 1)
    _step(be, (*_tables(dtype)[:2], ["causal", "full"]))  # a list: read by value, same mask
    assert counts.prepare == 1
    for a, b in zip((ref[0], *ref[1]), (again[0], *again[1], fresh[0], *fresh[1])):
        torch.testing.assert_close(a, b)


def test_table_changed_in_place_is_checked_again(counted) -> None:
    be, counts = counted
    qr, kr, tm = _tables()
    _step(be, (qr, kr, tm))
    tm.fill_(0)  # now both slices are FULL: the version counter moved
    out, grads = _step(be, (qr, kr, tm))
    assert counts.host == 2 and counts.prepare == 2
    want, want_grads = _step(magi_ffa.contract.get_backend("torch"), (QR, KR, [0, 0]))
    torch.testing.assert_close(out, want)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b)
    qr[1, 0] = 9  # out of range: the changed table is refused, as a new one would be
    with pytest.raises(ValueError, match="q_ranges"):
        _step(be, (qr, kr, tm))


def test_clear_mask_caches_drops_every_entry_and_launch_data(counted) -> None:
    be, counts = counted
    tables = _tables()
    _step(be, tables)
    checked = mask_cache.MASKS.lookup(tables, total_q=8, total_k=8)
    assert len(mask_cache.MASKS) == 1 and checked.prepared
    magi_ffa.clear_mask_caches()
    assert len(mask_cache.MASKS) == 0 and mask_cache.MASKS.nbytes == 0 and not checked.prepared
    _step(be, tables)
    assert counts.prepare == 2 and counts.host == 2


def test_entry_bound_evicts_the_least_recently_used() -> None:
    cache = MaskValueCache(2)
    masks = [([[0, 8]], [[0, n]], [0]) for n in (2, 4, 6)]
    a = cache.lookup(masks[0], total_q=8, total_k=8)
    cache.lookup(masks[1], total_q=8, total_k=8)
    assert cache.lookup(masks[0], total_q=8, total_k=8) is a  # now the most recent
    cache.lookup(masks[2], total_q=8, total_k=8)
    assert len(cache) == 2 and cache.lookup(masks[0], total_q=8, total_k=8) is a
    assert cache.lookup(masks[1], total_q=8, total_k=8) is not None and len(cache) == 2


def test_byte_bound_counts_launch_data_and_drops_old_entries() -> None:
    cache = MaskValueCache(100, max_bytes=10_000)
    entries = []
    for n in range(1, 5):
        c = cache.lookup(([[0, 8]], [[0, n]], [0]), total_q=8, total_k=8)
        data = cache.prepared(c, ("b",), lambda: (torch.zeros(1000, dtype=torch.int32),))
        entries.append((c, data))
        assert cache.nbytes <= 10_000 or len(cache) == 1
    assert len(cache) == 2  # 4000 bytes of data each (+ the tables): two fit
    assert not entries[0][0].prepared  # the evicted entries' data is freed
    shared = cache.prepared(entries[-1][0], ("c",), lambda: entries[-1][1])  # the same tensor in two slots
    assert shared is entries[-1][1] and cache.nbytes < 10_000  # a storage is counted once
    big = cache.lookup(([[0, 8]], [[0, 7]], [0]), total_q=8, total_k=8)
    cache.prepared(big, ("b",), lambda: torch.zeros(20_000, dtype=torch.uint8))
    assert len(cache) == 1 and big.prepared  # the entry in use stays, alone, even over the budget


def test_backend_limit_drops_only_that_backends_data() -> None:
    cache = MaskValueCache(10)
    cache.limit("fa", 1)
    a = cache.lookup(([[0, 8]], [[0, 2]], [0]), total_q=8, total_k=8)
    b = cache.lookup(([[0, 8]], [[0, 4]], [0]), total_q=8, total_k=8)
    cache.prepared(a, ("fa", 1), lambda: 1)
    cache.prepared(a, ("cu", 1), lambda: 2)
    cache.prepared(b, ("fa", 1), lambda: 3)
    assert list(a.prepared) == [("cu", 1)] and list(b.prepared) == [("fa", 1)] and len(cache) == 2
    cache.drop("fa")
    assert not b.prepared and a.prepared


def test_bad_tables_raise_and_store_nothing() -> None:
    cache = MaskValueCache(4)
    with pytest.raises(ValueError, match="q_ranges"):
        cache.lookup(
            (torch.tensor([[0, 9]]), torch.tensor([[0, 8]]), torch.tensor([0])), total_q=8, total_k=8
        )
    with pytest.raises(ValueError, match="same number of slices"):
        cache.lookup(([[0, 8]], [[0, 8], [0, 4]], None), total_q=8, total_k=8)
    with pytest.raises(ValueError, match="capacity"):
        MaskValueCache(0)
    assert len(cache) == 0


def test_threads_share_one_entry_and_one_build() -> None:
    cache = MaskValueCache(8)
    builds: list[int] = []
    errors: list[BaseException] = []
    results: set[int] = set()

    def work(seed: int) -> None:
        try:
            for i in range(50):
                n = 1 + (seed + i) % 3
                c = cache.lookup((torch.tensor([[0, 8]]), torch.tensor([[0, n]]), None), total_q=8, total_k=8)
                results.add(id(cache.prepared(c, ("b",), lambda n=n: builds.append(n) or object())))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(builds) == [1, 2, 3] and len(results) == 3 and len(cache) == 3


def test_compiled_call_takes_new_masks_without_recompiling(counted) -> None:
    """``torch.compile(fullgraph=True)``: new mask values in tables of one shape run the one graph; the op
    checks each new mask (its values are correct)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    be, _ = counted
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def f(q, k, v, qr, kr, tm):
        o, l = be.flex_flash_attn_func(q, k, v, qr, kr, tm)
        return o.sum() + l.sum()

    cf = torch.compile(f, fullgraph=True, backend=counter)
    for n in (3, 5, 8):
        tables = tuple(
            torch.tensor(x, dtype=torch.int32) for x in ([[0, 4], [4, 8]], [[0, n], [0, 8]], [1, 0])
        )
        xs = _qkv()
        got = torch.autograd.grad(cf(*xs, *tables), xs)
        ys = _qkv()
        want = torch.autograd.grad(f(*ys, *tables), ys)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1
