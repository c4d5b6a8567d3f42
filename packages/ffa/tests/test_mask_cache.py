"""``magi_ffa.mask_cache.MaskValueCache``: one entry per mask value, what ``build`` receives, bad slices."""

from __future__ import annotations

import pytest
import torch

from magi_ffa.mask_cache import MaskValueCache

QR, KR, TM = [[0, 4], [4, 8]], [[0, 4], [0, 8]], [0, 1]


def _tables(device: str = "cpu"):
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (QR, KR, TM))


def test_one_build_per_mask_value_and_lru_capacity() -> None:
    cache: MaskValueCache[int] = MaskValueCache(2)
    builds = []

    def build(qr, kr, tm):
        builds.append(qr.clone())
        return len(builds)

    a = cache.get(_tables(), total_q=8, total_k=8, device=torch.device("cpu"), build=build)
    b = cache.get(_tables(), total_q=8, total_k=8, device=torch.device("cpu"), build=build)  # new tensors
    assert a == b == 1 and len(builds) == 1
    other = (torch.tensor([[0, 8]]), torch.tensor([[0, 8]]), torch.tensor([0]))
    assert cache.get(other, total_q=8, total_k=8, device=torch.device("cpu"), build=build) == 2
    third = (torch.tensor([[0, 8]]), torch.tensor([[0, 4]]), torch.tensor([0]))
    assert cache.get(third, total_q=8, total_k=8, device=torch.device("cpu"), build=build) == 3
    assert len(cache) == 2  # the first mask was the least recently used
    assert cache.get(_tables(), total_q=8, total_k=8, device=torch.device("cpu"), build=build) == 4


@pytest.mark.parametrize("host_tables", [False, True])
def test_build_receives_tables_on_the_device_or_the_host(host_tables: bool) -> None:
    """``host_tables=True``: the CPU tables the value key was read from (no copy to the device and back)."""
    seen = {}

    def build(qr, kr, tm):
        seen["devices"] = {t.device.type for t in (qr, kr, tm)}
        seen["values"] = [t.tolist() for t in (qr, kr, tm)] if host_tables else None
        return 0

    cache: MaskValueCache[int] = MaskValueCache(4)
    cache.get(
        _tables(), total_q=8, total_k=8, device=torch.device("meta"), build=build, host_tables=host_tables
    )
    assert seen["devices"] == ({"cpu"} if host_tables else {"meta"})
    if host_tables:
        assert seen["values"] == [QR, KR, TM]


def test_bad_slices_raise_before_build() -> None:
    cache: MaskValueCache[int] = MaskValueCache(4)
    bad = (torch.tensor([[0, 9]]), torch.tensor([[0, 8]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="q_ranges"):
        cache.get(
            bad, total_q=8, total_k=8, device=torch.device("cpu"), build=lambda *t: pytest.fail("built")
        )
