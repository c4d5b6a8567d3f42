"""The benchmarks, a package: run each from the repository root as ``python -m benchmarks.<name>`` (the
packages installed as docs/development.md says); ``benchmarks.common`` holds the helpers they share and
``benchmarks.baselines`` the context-parallel baselines; ``bash benchmarks/device.sh`` runs them on a GPU
machine phase by phase; committed measurements are indexed in ``benchmarks/results/README.md``."""
