"""Small signatures where the contract and the planner are built: no function or method of the FFA contract,
the planner's door (`magi_solver.plan` and the modules it is split into) or the predictions' pricing takes more
than 8 parameters (`self` and `*args` / `**kwargs` counted), so a new argument joins a frozen input object
instead of a longer positional list. Exempt, because their flat signatures are promised or required:

* the public API: module-level names in the module's `__all__`, the public methods of a class in `__all__`
  (its API too), and the public templates that `tests/test_ffa_signatures.py` freezes (`flex_flash_attn_func`,
  `ffa_fwd`, `ffa_bwd`, defined inside `public_functions`);
* the `torch.library` op definitions and their fake / autograd registrations.

Read from the source with `ast` (no import, no torch); and no source module of a package grows past 800 lines,
and at most 5 pass 500.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_PARAMETERS = 8
MAX_MODULE_LINES = 800
LONG_MODULE_LINES = 500
MAX_LONG_MODULES = 5
CHECKED = [
    "packages/ffa/src/magi_ffa/contract.py",
    "packages/solver/src/magi_solver/plan.py",
    "packages/solver/src/magi_solver/_plan_types.py",
    "packages/solver/src/magi_solver/_assemble.py",
    "packages/solver/src/magi_solver/tools/predict.py",
]
# decorators (their last attribute) that define or register a torch.library op
_OP_DECORATORS = {"custom_op", "register_fake", "register_autograd", "register_kernel"}


def _frozen_templates() -> set[str]:
    """The entry-point names `tests/test_ffa_signatures.py` snapshots."""
    spec = importlib.util.spec_from_file_location(
        "_ffa_signatures", ROOT / "tests" / "test_ffa_signatures.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name for _, name in module.EXPECTED}


def parameter_count(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every parameter of `fn`: positional-only, ordinary, keyword-only, `*args` and `**kwargs`."""
    a = fn.args
    return (
        len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    )


def _decorator_name(d: ast.expr) -> str:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""


def _module_all(tree: ast.Module) -> set[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


def _registered_by_call(tree: ast.Module) -> set[str]:
    """Functions handed to `op.register_autograd(f, setup_context=g)` (and the like) by a call."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _decorator_name(node.func) in _OP_DECORATORS:
            args = [*node.args, *(k.value for k in node.keywords)]
            out |= {a.id for a in args if isinstance(a, ast.Name)}
    return out


def too_long(source: str, templates: set[str]) -> list[tuple[str, int, int]]:
    """`(qualified name, line, parameters)` of every function or method over the limit and not exempt."""
    tree = ast.parse(source)
    public, registered = _module_all(tree), _registered_by_call(tree)
    out: list[tuple[str, int, int]] = []

    def visit(body: list[ast.stmt], prefix: str, exempt_public: bool) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.", node.name in public and not prefix)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{node.name}"
                exempt = (
                    (not prefix and node.name in public)
                    or (exempt_public and not node.name.startswith("_"))
                    or node.name in templates
                    or node.name in registered
                    or any(_decorator_name(d) in _OP_DECORATORS for d in node.decorator_list)
                )
                if not exempt and parameter_count(node) > MAX_PARAMETERS:
                    out.append((name, node.lineno, parameter_count(node)))
                visit(node.body, f"{name}.", False)

    visit(tree.body, "", False)
    return out


@pytest.mark.parametrize("path", CHECKED)
def test_no_long_parameter_list(path: str) -> None:
    found = too_long((ROOT / path).read_text(), _frozen_templates())
    assert not found, f"{path}: more than {MAX_PARAMETERS} parameters (use a small frozen input): {found}"


def test_the_count_sees_every_kind_of_parameter() -> None:
    source = """
__all__ = ["Api", "api"]
def api(a, b, c, d, e, f, g, h, i): ...
def wide(a, /, b, c, *args, d, e, f=0, g, **kwargs): ...
def narrow(a, b, c, d, e, f, g, h): ...
class Api:
    def method(self, a, b, c, d, e, f, g, h): ...
    def _inner(self, a, b, c, d, e, f, g, h): ...
class Hidden:
    def method(self, a, b, c, d, e, f, g, h): ...
@torch.library.custom_op("x::y", mutates_args=())
def _op(a, b, c, d, e, f, g, h, i): ...
@_op.register_fake
def _fake(a, b, c, d, e, f, g, h, i): ...
def _backward(a, b, c, d, e, f, g, h, i): ...
_op.register_autograd(_backward)
def public_functions():
    def ffa_fwd(a, b, c, d, e, f, g, h, i): ...
    def helper(a, b, c, d, e, f, g, h, i): ...
"""
    found = too_long(source, {"ffa_fwd"})
    assert found == [
        ("wide", 4, 9),
        ("Api._inner", 8, 9),
        ("Hidden.method", 10, 9),
        ("public_functions.helper", 19, 9),
    ]


def test_no_source_module_over_800_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(ROOT.glob("packages/*/src/**/*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"split along their seams: {long}"


def test_few_source_modules_over_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted(ROOT.glob("packages/*/src/**/*.py"))
        if (n := len(p.read_text().splitlines())) > LONG_MODULE_LINES
    }
    assert len(long) <= MAX_LONG_MODULES, (
        f"{len(long)} source modules over {LONG_MODULE_LINES} lines (at most {MAX_LONG_MODULES}): split one "
        f"along its seams: {long}"
    )
