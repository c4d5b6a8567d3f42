"""Make this folder's helper module importable under pytest's importlib mode (unique name: no clash), and
turn Triton's interpreter on only where no CUDA device is present (before any Triton kernel module loads)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from magi_ffa.testing import interpret_triton_without_cuda

interpret_triton_without_cuda()
