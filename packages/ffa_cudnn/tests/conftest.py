"""Interpreter mode must be set before any Triton kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
