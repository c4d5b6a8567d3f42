"""``python -m benchmarks.<module>`` still runs that module's case (the commands earlier releases documented)."""

from __future__ import annotations

import pytest

from benchmarks.cli import CASES, run_module


@pytest.mark.parametrize(
    ("module", "argv", "case"),
    [
        ("kernel_backends_bench", [], "kernels"),
        ("kernel_backends_bench", ["--layer-step"], "layer-step"),
        ("magi_attention_bench", [], "sim"),
        ("mask_loop_bench", [], "mask-loop"),
    ],
)
def test_module_runs_its_case(module: str, argv: list[str], case: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        run_module(module, [*argv, "--help"])
    assert stop.value.code == 0
    assert f"python -m benchmarks {case} " in capsys.readouterr().out


def test_every_module_of_a_case_has_a_main() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    for case in CASES:
        text = (root / (case.module.replace(".", "/") + ".py")).read_text()
        assert '__name__ == "__main__"' in text, case.module
