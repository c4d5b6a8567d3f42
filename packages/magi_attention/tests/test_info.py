"""python -m magi_attention.info on the CPU: 80 columns, --json is one JSON document, the CPU --check passes
(exit 0) and a wrong backend fails it (exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from magi_attention import info


def test_text_report_fits_80_columns_and_checks_pass(capsys) -> None:
    code = info.main(["--check", "--bench"])
    text = capsys.readouterr().out
    assert code == 0, text
    # only a path or value longer than the width stands beyond it, whole and alone on its line
    wide = [line for line in text.splitlines() if len(line) > 80 and " " in line.strip()]
    assert not wide, wide
    for needle in ("Kernel backends:", "torch  runs here", "Compiled-kernel caches:", "All checks passed."):
        assert needle in text
    if not torch.cuda.is_available():
        assert "not run: needs a CUDA GPU" in text


def test_json_is_one_document(capsys) -> None:
    code = info.main(["--json", "--check"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)  # nothing else on stdout
    assert report["backends"]["torch"]["runs"] and report["check"]["passed"]
    checked = {(r["backend"], r["mask"]) for r in report["check"]["rows"]}
    assert {("torch", "causal"), ("torch", "docs"), ("torch", "window")} <= checked
    assert all(r["ratio"] is not None and r["ratio"] < 10 for r in report["check"]["rows"])
    assert {c["name"] for c in report["caches"]} >= {"fa4", "cudnn", "triton"}
    if not torch.cuda.is_available():
        assert not report["backends"]["fa4"]["runs"] and report["backends"]["fa4"]["why_not"]


def test_a_wrong_backend_fails_the_check(monkeypatch, capsys) -> None:
    right = info.kernel_fns

    def wrong(backend):
        fwd, bwd = right(backend)

        def bad_fwd(*args, **kw):
            out, lse = fwd(*args, **kw)
            return out * 1.01, lse  # 1% off: far beyond bf16 / fp32 rounding

        return bad_fwd, bwd

    # --check looks both up in its own module
    monkeypatch.setattr(info.check, "kernel_fns", wrong)
    monkeypatch.setattr(info.check, "BACKENDS", ("torch",))
    code = info.main(["--check"])
    text = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in text and "SOME CHECKS FAILED." in text and "out: max error" in text


def test_module_entry_point_runs() -> None:
    """``python -m magi_attention.info --json`` in a fresh process (the documented command)."""
    out = subprocess.run(
        [sys.executable, "-m", "magi_attention.info", "--json"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["python"]


def test_bad_arguments_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        info.main(["--rounds", "0"])
    assert exc.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_passes_on_every_backend_that_runs() -> None:
    """On a GPU: every backend that runs here passes the bf16 check (FA4 and cuDNN where installed), run as
    users run it (``python -m magi_attention.info --check``, a fresh process: no state of other tests)."""
    proc = subprocess.run(
        [sys.executable, "-m", "magi_attention.info", "--json", "--check"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    failed = [
        f"{r['backend']} {r['mask']} ratio {r['ratio']}: {(r['error'] or '')[:400]}"
        for r in report["check"]["rows"] if not r["passed"]
    ]  # fmt: skip
    assert proc.returncode == 0 and not failed, "\n".join(failed) or proc.stderr[-2000:]
    ran = {r["backend"] for r in report["check"]["rows"]}
    assert {"triton", "torch"} <= ran


def test_a_package_imported_from_the_source_tree_shows_its_version(monkeypatch) -> None:
    """A clone on PYTHONPATH has no distribution metadata: the module's version, marked, not "not installed"."""

    def missing(dist: str) -> str:
        raise info.report.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(info.report.metadata, "version", missing)
    import magi_solver

    assert info.report._version("magi-solver") == f"{magi_solver.__version__} (source)"
    assert info.report._version("magi-no-such-package") is None
    assert info.report._version("numpy") is None


def test_a_long_path_stands_whole_on_its_own_line() -> None:
    path = "/root/.cache/magi_attention/" + "a_rather_long_directory_name_" * 3 + "fa4_compiled_kernels"
    lines = info.text._wrap("fa4    ", f"12.5 MiB, {path} (MAGI_ATTENTION_CACHE_DIR)")
    assert path in lines, lines  # the path is a line by itself, not split
    assert all(len(line) <= 80 for line in lines if line != path), lines
    assert " ".join(" ".join(lines).split()) == f"fa4 12.5 MiB, {path} (MAGI_ATTENTION_CACHE_DIR)"
    short = info.text._wrap("root   ", "1.0 KiB, /tmp/x (default)")
    assert short == ["  root   1.0 KiB, /tmp/x (default)"]
    assert info.text._fit(path) == path and info.text._fit("x " * 50).endswith("...")


def test_bench_builds_calc_attn_keys_at_cp_1() -> None:
    """``--bench``'s ``calc_attn`` rows: the key of a standard mask for one process (no process group) and
    the backends ``calc_attn`` reports for it (the ``pick`` column)."""
    from magi_attention.vendors import standard_masks

    q = torch.zeros(256, 4, 32)
    k = torch.zeros(256, 2, 32)
    for mask in standard_masks(256, window=64):
        key = info.bench._key(mask, q, k, "torch")
        assert info.bench._pick(key) == ["torch", "torch"]
