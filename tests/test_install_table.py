"""The install table: scripts/install.py's rows, docs/install.md, the hints the code prints, and the finder of
the install commands that CI runs (scripts/ci/install_commands.py)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


install = _load("_magi_install", ROOT / "scripts" / "install.py")
finder = _load("_magi_install_commands", ROOT / "scripts" / "ci" / "install_commands.py")


def _projects() -> set[str]:
    return {
        str(p.parent.relative_to(ROOT))
        for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("integrations/*/pyproject.toml")]
    }


def _available(row: str) -> bool:
    return all((ROOT / folder / "pyproject.toml").is_file() for folder in install.projects([row]))


def test_every_project_has_a_row() -> None:
    """A new package or integration needs a row (one line in scripts/install.py's ROWS)."""
    covered = {folder for row in install.ROWS for folder in install.projects([row])}
    assert _projects() <= covered, sorted(_projects() - covered)


def test_docs_show_every_available_row_and_only_those() -> None:
    """docs/install.md has a runnable command for every row whose packages this checkout has (CI then
    installs or resolves it) and none for a row whose package is missing."""
    documented = set()
    for cmd in finder.commands_in((ROOT / "docs" / "install.md").read_text(), "docs/install.md"):
        if cmd.is_install_script and cmd.mode != "network":
            documented |= set(install.parse_args(cmd.argv[2:]).rows)
    available = {row for row in install.ROWS if _available(row)}
    assert documented == available, (sorted(available - documented), sorted(documented - available))
    table = (ROOT / "docs" / "install.md").read_text()
    for row in available:
        assert f"| `{row}` |" in table, f"docs/install.md's table has no line for the row {row!r}"


def test_rows_expand_and_merge_extras() -> None:
    fa4 = install.projects(["fa4"])
    assert list(fa4)[:5] == list(install.RUNTIME)  # the runtime first, then the backend
    assert fa4["packages/magi_attention"] == {"fa4"} and "packages/ffa_fa4" in fa4
    both = install.projects(["plot", "native"])
    assert both["packages/solver"] == {"plot"} and both["packages/group_collective"] == {"native"}
    with pytest.raises(install.InstallError, match="no row 'nope'"):
        install.projects(["nope"])


def test_print_names_our_packages_by_path_or_wheel(tmp_path: Path) -> None:
    """--print: our packages by path (or by wheel file with --wheels, picked by exact version), never by
    name, so pip never looks them up on an index."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install.py"), "--print", "planner"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    argv = r.stdout.split()
    assert argv[1:4] == ["-m", "pip", "install"]
    assert argv[4:] == [str(ROOT / "packages" / "mask"), str(ROOT / "packages" / "solver")]
    (tmp_path / "magi_mask-0.1.0-py3-none-any.whl").touch()
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install.py"), "--print", "--wheels", str(tmp_path), "planner"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert r.returncode == 2 and "no wheel of magi-solver 0.1.0" in r.stderr
    (tmp_path / "magi_solver-0.1.0-py3-none-any.whl").touch()
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install.py"), "--print", "--wheels", str(tmp_path), "plot"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert shlex.split(r.stdout)[4:] == [
        str(tmp_path / "magi_mask-0.1.0-py3-none-any.whl"),
        str(tmp_path / "magi_solver-0.1.0-py3-none-any.whl") + "[plot]",
    ]


HINT = re.compile(r"scripts/install\.py (\w+)")
SOURCES = ["packages/*/src/**/*.py", "integrations/*/src/**/*.py", "scripts/*.py"]


def test_hints_name_a_row() -> None:
    """Every `scripts/install.py ROW` that code prints or docs show names a row that exists."""
    seen = 0
    files = [p for pattern in SOURCES for p in ROOT.glob(pattern)] + finder.doc_files(ROOT)
    for path in files:
        for row in HINT.findall(path.read_text()):
            if row not in ("ROW",):
                assert row in install.ROWS, f"{path.relative_to(ROOT)} names the install row {row!r}"
                seen += 1
    assert seen >= 5  # the hints of magi-solver, magi-group-collective, magi-attention and magi-ffa-fa4


OUR_NAME = re.compile(r"pip install[^\n`]*?(?<![\w./-])[\"']?magi-[\w-]+")


def test_no_install_of_our_names_from_an_index() -> None:
    """No doc, README or printed hint tells a user to `pip install magi-...` by name (the index's
    `magi-attention` is someone else's): the install table's warning is the one place that names it."""
    files = [p for pattern in SOURCES for p in ROOT.glob(pattern)] + finder.doc_files(ROOT)
    bad = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if OUR_NAME.search(line) and "does not install this project" not in line:
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------- the finder CI uses
def test_finder_reads_blocks_markers_and_continuations() -> None:
    text = "\n".join([
        "```bash",
        "pip install foo  # a comment",
        "echo pip install not-this",
        "python scripts/install.py planner \\",
        "    --wheels dist",
        "```",
        "<!-- install: resolve -->",
        "```bash",
        "python -m pip install bar",
        "```",
        "```python",
        "pip install not-shell",
        "```",
        "<!-- install: network -->",
        "```console",
        "$ pip install baz --index-url https://example.invalid/simple",
        "```",
        "```bash",
        "pip install after-a-marked-block",
        "```",
    ])  # fmt: skip
    found = finder.commands_in(text, "x.md")
    assert [(c.mode, c.argv[-1]) for c in found] == [
        ("run", "foo"),
        ("run", "dist"),
        ("resolve", "bar"),
        ("network", "https://example.invalid/simple"),
        ("run", "after-a-marked-block"),
    ]
    assert (
        found[1].is_install_script and found[1].command == "python scripts/install.py planner --wheels dist"
    )
    assert [c.where for c in found] == ["x.md:2", "x.md:5", "x.md:9", "x.md:16", "x.md:19"]


@pytest.mark.parametrize(
    "text, message",
    [
        pytest.param(
            "<!-- install: maybe -->\n```bash\npip install x\n```", "unknown install marker", id="unknown"
        ),
        pytest.param(
            "<!-- install: resolve -->\ntext\n```bash\npip install x\n```", "right before", id="stray"
        ),
    ],
)
def test_finder_rejects_bad_markers(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        finder.commands_in(text, "x.md")


def test_every_doc_command_is_found() -> None:
    """The finder sees the install table's commands and every page's install lines (CI runs these)."""
    found = finder.find_commands(ROOT)
    where = {c.where.split(":")[0] for c in found}
    assert {"docs/install.md", "docs/packages/ffa_fa4.md", "docs/integrations/transformers.md"} <= where
    assert all(c.mode in finder.MODES for c in found)
    # the CUDA-only rows are resolved, never installed on a CPU
    assert all(c.mode == "resolve" for c in found if c.is_install_script and {"fa4", "cudnn"} & set(c.argv))


def test_shell_join_keeps_globs_and_quotes_extras() -> None:
    assert finder._shell_join(["pip", "install", "dist/magi_ffa-*.whl", "./packages/solver[plot]"]) == (
        "pip install dist/magi_ffa-*.whl './packages/solver[plot]'"
    )


def test_a_row_whose_torch_minimum_the_installed_torch_misses_is_refused() -> None:
    """The installed torch is kept (pinned); a project needing a newer one is named instead of pip's
    'no matching distribution for torch==...'."""
    metas = [{"name": "a", "dependencies": ["numpy"]}, {"name": "b", "dependencies": ["torch>=2.12", "x"]}]
    assert install.torch_too_old(metas, "2.11.0+cu130") == "b needs torch>=2.12"
    assert install.torch_too_old(metas, "2.12.0") is None
    assert install.torch_too_old(metas, "2.13.0+cpu") is None
    assert install.torch_too_old(metas, "2.12.0rc1") is None
    assert install.torch_too_old([{"name": "c", "dependencies": ["torch"]}], "1.0") is None
    titan = [install._pyproject(f, ["torchtitan"]) for f in install.projects(["torchtitan"])]
    assert install.torch_too_old(titan, "2.11.0+cu130") == "magi-attention-torchtitan needs torch>=2.12"
