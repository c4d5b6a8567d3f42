"""What this machine runs: the versions (Python, torch, Triton, CUDA, the driver, the vendor packages,
ours), the GPUs, per kernel backend whether it runs here and why not, the ``auto`` table in use, the
variables in effect and the compiled-kernel caches with their sizes (``collect``, the plain report)."""

from __future__ import annotations

import importlib
import importlib.util
import platform
import shutil
import subprocess
from importlib import metadata, resources

import torch

__all__ = ["BACKENDS", "DISTRIBUTIONS", "backend_status", "collect"]

BACKENDS = ("fa4", "cudnn", "triton", "torch")
DISTRIBUTIONS = (
    "torch",
    "triton",
    "numpy",
    "flash-attn-4",
    "nvidia-cudnn-frontend",
    "nvidia-cutlass-dsl",
    "magi-attention",
    "magi-solver",
    "magi-ffa",
    "magi-ffa-fa4",
    "magi-ffa-cudnn",
    "magi-group-collective",
    "magi-mask",
)


def _version(dist: str) -> str | None:
    """The installed distribution's version; for our packages imported from a source tree without being
    installed (a clone on ``PYTHONPATH``) the module's ``__version__`` marked ``(source)``; else None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    module = dist.replace("-", "_")
    if not dist.startswith("magi-") or importlib.util.find_spec(module) is None:
        return None
    return f"{importlib.import_module(module).__version__} (source)"


def _driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), None without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(
            {"index": i, "name": p.name, "capability": f"sm{p.major}{p.minor}",
             "memory_gib": round(p.total_memory / 2**30, 1)}
        )  # fmt: skip
    return out


def backend_status() -> dict[str, str]:
    """Backend -> "" when it runs here, else why not (the runtime's own probes, ``_runtime.kernels``)."""
    from .._runtime.kernels import backend_missing

    return {name: backend_missing(name) for name in BACKENDS}


def _auto_table() -> dict:
    from magi_solver.kernel_choice import load_kernel_table

    from .._runtime.kernels import local_gpu_kind

    kind = local_gpu_kind()
    table = load_kernel_table(kind)
    if table is None:
        return {"gpu_kind": kind, "path": None, "rows": 0,
                "note": f"no table for {kind!r}: auto uses the capability rule"}  # fmt: skip
    # an H100 reads the H200's table (`kernel_choice.SAME_ARCHITECTURE`): the file is the table's own kind's
    path = resources.files("magi_solver").joinpath("kernel_tables", f"{table.gpu_kind}.json")
    return {"gpu_kind": kind, "path": str(path), "rows": len(table.rows), "source": table.source}


def _caches() -> list[dict]:
    from magi_ffa import env as ffa_env
    from magi_ffa.compile_cache import cache_report, dir_size

    root, how = ffa_env.cache_dir()
    out = [{"name": "root", "enabled": True, "directory": root, "how": how, "bytes": dir_size(root)}]
    for s in cache_report():
        size = dir_size(s.directory) if s.directory else 0
        out.append(
            {"name": s.name, "enabled": s.enabled, "directory": s.directory, "how": s.how, "bytes": size}
        )
    return out


def collect() -> dict:
    """Everything the plain report shows, as a JSON-able dict."""
    from .. import env

    status = backend_status()  # imports our backend packages: their compile caches are decided here
    return {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch_cuda": torch.version.cuda,
        "driver": _driver(),
        "versions": {d: _version(d) for d in DISTRIBUTIONS},
        "gpus": _gpus(),
        "backends": {b: {"runs": not why, "why_not": why} for b, why in status.items()},
        "auto_table": _auto_table(),
        "variables": env.variables_in_effect(),
        "caches": _caches(),
    }
