"""The planner's tools around the planning core: what `magi-attention-plan` (`magi_solver.cli`) and the
gallery use, and the runtime never does.

- `hardware`: GPU profiles (kernel TFLOP/s per mask family, link bandwidths) for the predictions.
- `predict`: one mask's predicted cost at one cp size, magi's plan against ring, all-gather and Ulysses.
- `cli_input`: a command line's mask, model shapes and hardware as the planner's inputs.
- `cli_report`: the command's tables and PNGs.
- `anneal`: a much wider (minutes-long) search over single-chunk swaps, to check how far a placement's
  slowest ranks are from what it reaches (`python -m magi_solver.tools.anneal`).
- `plot`: pictures of masks and plans (matplotlib, the `plot` extra, imported only when drawing).
"""

__all__ = ["anneal", "cli_input", "cli_report", "hardware", "plot", "predict"]
