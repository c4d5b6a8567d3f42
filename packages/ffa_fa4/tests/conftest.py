"""Triton's interpreter only where no CUDA device is present, set before any Triton kernel module is imported
(on a GPU machine the kernels run compiled; an explicit TRITON_INTERPRET wins)."""

from magi_ffa.testing import interpret_triton_without_cuda

interpret_triton_without_cuda()


import pytest  # noqa: E402  (after the interpreter rule above)

from magi_ffa import clear_mask_caches  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_mask_cache():
    """Launch data lives in the process's one mask cache: a test that fakes the vendor must not hand its
    fake data to the next test of the same mask."""
    clear_mask_caches()
    yield
    clear_mask_caches()
