"""magi_ffa.compile_cache: the vendors' kernel caches are turned on by default, a user's setting wins, the
directory follows MAGI_ATTENTION_CACHE_DIR / XDG_CACHE_HOME and our sources' hash."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from magi_ffa import compile_cache, env

_VARS = (
    "MAGI_ATTENTION_CACHE_DIR",
    "MAGI_ATTENTION_COMPILE_CACHE",
    "XDG_CACHE_HOME",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in _VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "flash_attn.cute.cache_utils", raising=False)
    return monkeypatch


def test_cache_dir_sources(clean_env, tmp_path):
    assert env.cache_dir() == (os.path.expanduser("~/.cache/magi_attention"), "default")
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_dir() == (str(tmp_path / "xdg" / "magi_attention"), "XDG_CACHE_HOME")
    clean_env.setenv("MAGI_ATTENTION_CACHE_DIR", str(tmp_path / "mine"))
    assert env.cache_dir() == (str(tmp_path / "mine"), "MAGI_ATTENTION_CACHE_DIR")


def test_default_turns_the_cache_on_under_the_root(clean_env, tmp_path):
    clean_env.setenv("MAGI_ATTENTION_CACHE_DIR", str(tmp_path))
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    state = compile_cache.enable_vendor_cache("fa4", pkg, "9.9")
    tag = compile_cache.source_tag(pkg, "9.9")
    assert state.enabled and state.directory == str(tmp_path / "fa4" / tag)
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == state.directory
    (pkg / "a.py").write_text("x = 2\n")  # a changed patch gets another directory
    assert compile_cache.source_tag(pkg, "9.9") != tag and tag.startswith("9.9-")


def test_user_setting_wins_and_opt_out(clean_env, tmp_path):
    clean_env.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    state = compile_cache.enable_vendor_cache("fa4", tmp_path, "1")
    assert not state.enabled and "user setting" in state.how
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
    clean_env.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")
    clean_env.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "theirs"))
    state = compile_cache.enable_vendor_cache("fa4", tmp_path, "1")
    assert state.enabled and state.directory == str(tmp_path / "theirs")
    clean_env.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR")
    clean_env.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")
    clean_env.setenv("MAGI_ATTENTION_COMPILE_CACHE", "0")
    state = compile_cache.enable_vendor_cache("fa4", tmp_path, "1")
    assert not state.enabled and "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" not in os.environ
    with pytest.raises(ValueError, match="vendor"):
        compile_cache.enable_vendor_cache("nope", tmp_path, "1")


def test_too_late_after_the_vendor_import(clean_env, tmp_path):
    clean_env.setitem(sys.modules, "flash_attn.cute.cache_utils", object())
    state = compile_cache.enable_vendor_cache("fa4", tmp_path, "1")
    assert not state.enabled and "imported before" in state.how


def test_dir_size(tmp_path):
    assert compile_cache.dir_size(tmp_path / "missing") == 0
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.o").write_bytes(b"0" * 100)
    (tmp_path / "y").write_bytes(b"0" * 23)
    assert compile_cache.dir_size(tmp_path) == 123


def test_importing_the_fa4_package_sets_the_variables(tmp_path):
    """In a fresh process (the vendor reads the variables once): importing magi_ffa_fa4 sets them."""
    pytest.importorskip("magi_ffa_fa4")
    code = "import os, magi_ffa_fa4; print(os.environ['FLASH_ATTENTION_CUTE_DSL_CACHE_DIR'])"
    env_ = {k: v for k, v in os.environ.items() if k not in _VARS}
    env_["MAGI_ATTENTION_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env_, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(tmp_path / "fa4" / "0.1.0-"))
