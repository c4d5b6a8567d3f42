"""magi_attention: distributed attention (context parallelism) with slice masks.

The product is four modules: `magi_attention.api` (keys, `dispatch`, `calc_attn`, `roll` and the helpers
that build masks: the calls a training loop makes), `magi_attention.dispatch` (tokens to ranks and back),
`magi_attention.dist_attn` (the attention of one cp group) and `magi_attention.config` (the frozen settings
a key holds). This package hands on `api.__all__` and `config.__all__`; `key`, `helpers`, `mask_mod`,
`roll`, `simulate`, `info`, `vendors`, `testing`, `env` and `demo` are public modules of their own, and
`magi_attention._runtime` holds the runtime's internals (no public name; its paths may change).
"""

from . import api, config
from .api import *  # noqa: F403  (the names of api.__all__)
from .config import *  # noqa: F403  (the names of config.__all__)

__version__ = "0.1.0"  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [*api.__all__, *config.__all__]
