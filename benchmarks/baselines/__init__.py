"""Library of the context-parallel baselines that ``benchmarks/cp_bench.py`` measures magi-attention against
(imported by the benchmark and by ``tests/test_cp_baselines.py``; nothing here is a script).

- ``baselines.same_kernel``: Ulysses, zigzag ring and all-gather K/V on magi_ffa's own kernel, so a comparison
  isolates the distribution scheme.
- ``baselines.user``: what a user would pick today, each with its best local kernel (Ulysses + FA4, PyTorch's
  ``context_parallel``, ...); CUDA-only kernels are imported on first use.

``from baselines.same_kernel import CPBaseline`` from a script in ``benchmarks/`` (a script's folder is on the
module path) or from the tests (pytest.ini's ``pythonpath``); no ``sys.path`` edit anywhere.
"""
