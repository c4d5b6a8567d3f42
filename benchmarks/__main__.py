"""``python -m benchmarks <case> [args]``: see `benchmarks.cli`."""

from benchmarks.cli import main

raise SystemExit(main())
