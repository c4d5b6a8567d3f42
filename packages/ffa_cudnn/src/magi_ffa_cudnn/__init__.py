"""magi_ffa_cudnn: the FFA API on cuDNN's flex_attention kernels (CuTe DSL; Hopper sm90, Blackwell sm100).

A mask of slices becomes magi_ffa's per-row key intervals, then cuDNN's ``mask_func`` and a mask plan cached
by the mask's value and geometry. The conversion needs only torch (and Triton on CUDA); the attention entry
points need ``nvidia-cudnn-frontend`` and raise an ImportError saying what to install when it is missing.
The package provides cuDNN's launchers and its capability (``CAPABILITY``); the entry points are
``magi_ffa.contract``'s, bound to them (``BACKEND``).
"""

# first: importing env turns the vendor's on-disk kernel cache on, before anything imports the vendor
from magi_ffa._deprecation import deprecated_aliases

from . import env, interface
from .interface import *  # noqa: F403  (the entry points: interface.__all__ is their one list)
from .mask_func import mask_func_from_intervals, visible_from_mask_func

__version__ = env.PACKAGE_VERSION  # the [project] version of pyproject.toml (CI checks that they agree)

__all__ = [*interface.__all__, "mask_func_from_intervals", "visible_from_mask_func"]

# old names, for one release (docs/migration.md)
__getattr__ = deprecated_aliases(__name__, {"clear_plan_cache": "clear_mask_plan_cache"})
