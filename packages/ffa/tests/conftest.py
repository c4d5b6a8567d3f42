"""Make this folder's helper module importable under pytest's importlib mode (unique name: no clash)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
