"""Integration runs: short training loops of each framework with magi_attention (``python -m
benchmarks.integration_runs.<name>``); ``harness`` holds what they share."""
