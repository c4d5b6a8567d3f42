"""pytest plugin of the per-package CI jobs (`-p magi_ci_guard`, with scripts/ci on PYTHONPATH).

- Writes the ids of the collected tests to $MAGI_CI_NODEIDS (`.ci/run` checks that the jobs together ran
  every test of the whole suite).
- At the end, fails the session unless every first-party module that was imported ($MAGI_CI_FIRST_PARTY,
  top-level names) came from the venv's site-packages, i.e. from the installed wheels and not from a source
  tree. (It notes when the package under test, $MAGI_CI_OWN, was imported only in child processes, as the
  integrations' rank workers do; their interpreter is the same venv's, with the same sys.path.)
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    path = os.environ.get("MAGI_CI_NODEIDS")
    if path:
        Path(path).write_text("".join(f"{item.nodeid}\n" for item in session.items))


def _origins() -> tuple[list[str], list[str]]:
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    first_party = set(os.environ.get("MAGI_CI_FIRST_PARTY", "").split())
    inside, outside = [], []
    for name, module in sorted(sys.modules.items()):
        if name.split(".")[0] not in first_party:
            continue
        file = getattr(module, "__file__", None)
        if file is None:  # namespace package: look at its path entries
            paths = [Path(p) for p in getattr(module, "__path__", [])]
        else:
            paths = [Path(file)]
        for p in paths:
            ok = any(s in p.resolve().parents for s in site)
            (inside if ok else outside).append(f"{name}: {p}")
    return inside, outside


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "MAGI_CI_FIRST_PARTY" not in os.environ:
        return
    inside, outside = _origins()
    own = set(os.environ.get("MAGI_CI_OWN", "").split())
    missing = sorted(n for n in own if n not in sys.modules)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter else print
    if not outside:
        write(f"magi_ci_guard: {len(inside)} first-party modules imported, all from site-packages")
    for name in missing:
        write(f"magi_ci_guard: note: {name} was not imported in this process (only in child processes?)")
    if outside:
        for line in outside:
            write(f"magi_ci_guard: imported from outside the venv's site-packages: {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
