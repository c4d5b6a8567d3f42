"""The context-parallel baselines ``benchmarks/cp_bench.py`` measures magi-attention against (a library, no
script): ``same_kernel`` (Ulysses, zigzag ring, all-gather K/V on magi_ffa's kernel) and ``user`` (what a user
would pick today, each with its best local kernel)."""
