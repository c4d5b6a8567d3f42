"""The runtime's internals: no public name here, and their paths may change in any release.

Everything the public modules (`api`, `dispatch`, `dist_attn`, `roll`, `simulate`, `info`) stand on, one
room below them; it imports only `config`, `env`, `key` and `_layout` of the package, never a public call:

- `cache`: the plan built from a key, its per-device tensors, and the per-group LRU cache of both, bounded
  by entries and by estimated bytes.
- `key_route`: a new key's steps on one rank, in order (kernel choice, plan, deterministic restriction, import),
  and what the ranks tell each other about kernels inside the key's agreement.
- `kernels`: which attention kernel the ranks agree on, and the launchers every call goes through.
- `collective_choice`: the group-collective implementation of a key's plans, chosen when the key is built.
- `comm`: the token all-gathers of dispatch / undispatch.
- `cache_budget`: the memory check before planning.
- `mask_input`: user mask arguments normalised into the tuples keys hash.
- `checks`: what stops a bad call on every rank before data moves, and `CommError` when a collective fails.
"""
