"""The benchmarks, a package: ``python -m benchmarks`` lists the cases and ``python -m benchmarks <case>
[args]`` runs one from the repository root (the packages installed as docs/development.md says; the registry
and the shared options are `benchmarks.cli`); ``benchmarks.common`` holds the helpers they share and
``benchmarks.baselines`` the context-parallel baselines; ``bash benchmarks/device.sh`` runs them on a GPU
machine phase by phase; committed measurements are indexed in ``benchmarks/results/README.md``."""
