"""Whether a kernel library is installed and this GPU can run it, answered without importing the library.

Importing a vendor's kernels costs seconds (flash-attn-4's dependencies import ``torch._dynamo``; the CuTe DSL
loads its compiler), so a process that asks which backends it could run must not pay for every one of them.
Availability is read from what pip installed (the distribution's metadata and the module's location on
``sys.path``: nothing of the library runs) and from this process's current CUDA device. A library that is
installed but then fails to import is found out when a caller needs it (``BackendCapability.install_check``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Sequence

import torch

__all__ = ["cuda_arch_major", "missing_distributions"]


def missing_distributions(requires: Sequence[tuple[str, str]]) -> list[str]:
    """The distributions of ``requires`` that are not installed, in order.

    Args:
        requires: ``(distribution, module)`` pairs, e.g. ``("flash-attn-4", "flash_attn")``: the
            distribution's metadata must be installed and its top-level module findable on ``sys.path``
            (found, not imported).
    """
    missing = []
    for dist, module in requires:
        try:
            importlib.metadata.distribution(dist)
            found = importlib.util.find_spec(module) is not None
        except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    return missing


def cuda_arch_major() -> int | None:
    """The compute-capability major of the current CUDA device (9 for Hopper), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return _major(torch.cuda.current_device())


@functools.cache
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]
