"""Every parameter of every public function is described in its docstring (and the docs stay in sync)."""

from __future__ import annotations

import inspect

import pytest

import magi_attention
from magi_attention import api

PUBLIC = [getattr(api, name) for name in api.__all__ if inspect.isfunction(getattr(api, name))]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_docstring_names_every_parameter(fn) -> None:
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{fn.__name__} has no docstring"
    missing = [p for p in inspect.signature(fn).parameters if p not in doc]
    assert not missing, f"{fn.__name__}: parameters {missing} are not described in its docstring"


def test_package_reexports_the_api() -> None:
    for name in api.__all__:
        assert getattr(magi_attention, name) is getattr(api, name)
