"""The benchmarks: ``python -m benchmarks [<case> [args]]`` (`benchmarks.cli`, from the repository root); shared
helpers in ``common``, the cp baselines in ``baselines``, GPU phases in ``device.sh``, results in ``results/``."""
