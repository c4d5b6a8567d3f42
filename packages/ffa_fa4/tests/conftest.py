"""Triton's interpreter only where no CUDA device is present, set before any Triton kernel module is imported
(on a GPU machine the kernels run compiled; an explicit TRITON_INTERPRET wins)."""

from magi_ffa.testing import interpret_triton_without_cuda

interpret_triton_without_cuda()
