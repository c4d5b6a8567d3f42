"""Library of the context-parallel baselines that ``benchmarks/cp_bench.py`` measures magi-attention against
(imported by the benchmark and by ``tests/test_cp_baselines.py``; nothing here is a script).

- ``benchmarks.baselines.same_kernel``: Ulysses, zigzag ring and all-gather K/V on magi_ffa's own kernel, so a comparison
  isolates the distribution scheme.
- ``benchmarks.baselines.user``: what a user would pick today, each with its best local kernel (Ulysses + FA4, PyTorch's
  ``context_parallel``, ...); CUDA-only kernels are imported on first use.

``from benchmarks.baselines.same_kernel import CPBaseline`` from the repository root (``python -m
benchmarks.cp_bench``; the tests have the root on pytest.ini's ``pythonpath``); no path edit anywhere.
"""
