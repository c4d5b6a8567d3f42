"""The layout is the architecture: lower layers never import upper ones, and no package imports itself in
a circle.

magi_mask (the mask vocabulary and algebra) is the lowest layer and imports none of ours, nor torch; magi_solver
imports no torch; magi_ffa and magi_group_collective import neither each other nor the solver; magi_ffa_fa4
and magi_ffa_cudnn sit on top of magi_ffa (and not on each other); only magi_attention composes them. Inside a package the modules import each other
without cycles, function-level (lazy) imports included: a type two modules share lives a module below both.
A room keeps its side: `magi_attention._runtime` (the runtime's internals) below the public modules, `magi_solver.tools` above the
planning core, the group-collective implementations beside each other below `_select`.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = {
    "magi_mask",
    "magi_solver",
    "magi_ffa",
    "magi_ffa_fa4",
    "magi_ffa_cudnn",
    "magi_group_collective",
    "magi_attention",
}

# package dir -> (import name, first-party packages it may import, third-party top-level names it must not)
RULES = {
    "mask": ("magi_mask", set(), {"torch", "triton"}),
    "solver": ("magi_solver", {"magi_mask"}, {"torch", "triton"}),
    "ffa": ("magi_ffa", {"magi_mask"}, set()),
    "group_collective": ("magi_group_collective", {"magi_mask"}, set()),
    "ffa_fa4": ("magi_ffa_fa4", {"magi_mask", "magi_ffa"}, set()),
    "ffa_cudnn": ("magi_ffa_cudnn", {"magi_mask", "magi_ffa"}, set()),
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


@pytest.mark.parametrize("pkg", ["magi_mask", "magi_solver"])
def test_import_loads_no_torch(pkg: str) -> None:
    code = f"import sys, {pkg}; sys.exit(1 if 'torch' in sys.modules or 'triton' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"importing {pkg} loaded torch"


def _module_name(path: Path, src: Path, own: str) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([own, *parts])


def _internal_imports(path: Path, name: str, own: str, modules: set[str]) -> set[str]:
    """The package's own modules that ``path`` (module ``name``) imports anywhere in it, function bodies
    included; ``from x import y`` counts ``x.y`` when that is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == own)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == own:
                target = node.module
            else:
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            found.update(subs or {target})
    return (found & modules) - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("pkg_dir", sorted(RULES))
def test_no_import_cycle_inside_a_package(pkg_dir: str) -> None:
    own = RULES[pkg_dir][0]
    src = ROOT / "packages" / pkg_dir / "src" / own
    files = {_module_name(p, src, own): p for p in sorted(src.rglob("*.py"))}
    modules = set(files)
    # the package's __init__ imports its modules by design; a module importing the package back is the cycle
    graph = {m: _internal_imports(p, m, own, modules) for m, p in files.items()}
    cycles = _cycles(graph)
    assert not cycles, f"import cycles in {own} (move the shared type down a module): {cycles}"


def test_cycle_check_sees_function_level_imports(tmp_path: Path) -> None:
    graph = {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}
    assert _cycles(graph) == [["p.a", "p.b"]]
    path = tmp_path / "_a.py"
    path.write_text("def f():\n    from ._b import X\n")
    assert _internal_imports(path, "p._a", "p", {"p._a", "p._b"}) == {"p._b"}


# rooms inside a package, with the modules (or subpackages) they may not import: the runtime's internals
# (failure checks included) sit below the public modules they serve; the planner's tools (CLI, predictions,
# plots) sit above the planning core, which never imports them; the group-collective implementations sit
# side by side under the one module that chooses among them
_GRPCOLL_IMPLS = tuple(f"magi_group_collective._{n}" for n in ("a2av", "hierarchical", "native"))
SUBPACKAGE_RULES = [
    (
        "magi_attention",
        lambda m: m.startswith("magi_attention._runtime"),
        tuple(
            f"magi_attention.{n}"
            for n in "api dispatch dist_attn roll simulate info vendors demo testing".split()
        ),
    ),
    (
        "solver",
        lambda m: not m.startswith(("magi_solver.tools", "magi_solver.cli")),
        ("magi_solver.tools", "magi_solver.cli"),
    ),
    (
        "group_collective",
        lambda m: m in _GRPCOLL_IMPLS,
        (*_GRPCOLL_IMPLS, "magi_group_collective._select"),
    ),
]


@pytest.mark.parametrize("rule", range(len(SUBPACKAGE_RULES)))
def test_subpackages_keep_their_side(rule: int) -> None:
    pkg_dir, applies_to, forbidden = SUBPACKAGE_RULES[rule]
    own = RULES[pkg_dir][0]
    src = ROOT / "packages" / pkg_dir / "src" / own
    files = {_module_name(p, src, own): p for p in sorted(src.rglob("*.py"))}

    def inside(m: str) -> bool:
        return any(m == f or m.startswith(f + ".") for f in forbidden)

    assert any(inside(m) for m in files), f"{forbidden} no longer exist: update the rule"
    for name, path in files.items():
        if applies_to(name):
            bad = {m for m in _internal_imports(path, name, own, set(files)) if inside(m)}
            assert not bad, f"{name} imports {sorted(bad)}"


# integrations/<framework>/{src,tests}: of ours, only magi_attention's public API (and their own package),
# the helpers they share included (cu_seqlens check, gradient sum over cp); their tests may also use
# magi_attention.testing (rank launcher, docs-example runner)
INTEGRATION_ALLOWED = {
    "magi_attention",
    "magi_attention.api",
    "magi_attention.config",
    "magi_attention.helpers",
}
INTEGRATION_FILES = sorted(
    p for d in ("src", "tests") for p in (ROOT / "integrations").glob(f"*/{d}/**/*.py")
)


@pytest.mark.parametrize("path", INTEGRATION_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_integrations_use_public_api_only(path: Path) -> None:
    own = {p.name for p in (ROOT / "integrations" / path.relative_to(ROOT).parts[1] / "src").glob("*")}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            if top in own or not (top in OURS or top.startswith("magi_")):
                continue
            allowed = INTEGRATION_ALLOWED | ({"magi_attention.testing"} if "tests" in path.parts else set())
            assert module in allowed, f"{path.relative_to(ROOT)} imports {module}"
