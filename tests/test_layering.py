"""The layout is the architecture: lower layers never import upper ones.

magi_solver imports no torch; magi_ffa and magi_group_collective import neither each other nor the
solver; magi_ffa_fa4 stays beside magi_ffa; only magi_attention composes them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {"magi_solver", "magi_ffa", "magi_ffa_fa4", "magi_group_collective", "magi_attention"}

# package dir -> (import name, first-party packages it may import, third-party top-level names it must not)
RULES = {
    "solver": ("magi_solver", set(), {"torch", "triton"}),
    "ffa": ("magi_ffa", set(), set()),
    "group_collective": ("magi_group_collective", set(), set()),
    "ffa_fa4": ("magi_ffa_fa4", set(), set()),
    "magi_attention": ("magi_attention", OURS - {"magi_attention"}, set()),
}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("pkg_dir", sorted(RULES))
def test_import_direction(pkg_dir: str) -> None:
    own, allowed, forbidden = RULES[pkg_dir]
    src = ROOT / "packages" / pkg_dir / "src" / own
    for path in sorted(src.rglob("*.py")):
        imported = _imported_top_levels(path)
        bad_first_party = (imported & OURS) - allowed - {own}
        assert not bad_first_party, f"{path.relative_to(ROOT)} imports {sorted(bad_first_party)}"
        bad_third_party = imported & forbidden
        assert not bad_third_party, f"{path.relative_to(ROOT)} imports {sorted(bad_third_party)}"


def test_solver_import_loads_no_torch() -> None:
    code = "import sys, magi_solver; sys.exit(1 if 'torch' in sys.modules or 'triton' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "importing magi_solver loaded torch"
