"""The runtime's internals (no public API here; their paths may change in any release).

What the public modules (`api`, `dispatch`, `dist_attn`, `roll`, ...) stand on: the dispatch layout, the
plans and their cache, the kernel choice and launchers, the collective choice and the failure checks.
"""
