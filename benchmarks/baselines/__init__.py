"""The cp case's baselines: ``same_kernel`` (Ulysses, zigzag ring, all-gather K/V on magi_ffa's kernel) and
``user`` (what a user would pick today, each with its best local kernel)."""
