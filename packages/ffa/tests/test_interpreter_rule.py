"""The conftest rule: Triton's interpreter only where no CUDA device is present; an explicit setting wins."""

import pytest
import torch

from magi_ffa.testing import interpret_triton_without_cuda


@pytest.mark.parametrize(
    ("preset", "cuda", "expected_env", "expected_on"),
    [
        (None, False, "1", True),  # CPU machine, nothing set: the interpreter
        (None, True, None, False),  # GPU machine, nothing set: compiled kernels
        ("", True, "", False),  # empty counts as unset
        ("0", False, "0", False),  # an explicit 0 wins even without a GPU
        ("1", True, "1", True),  # an explicit 1 wins even with a GPU
    ],
)
def test_interpreter_only_without_cuda(monkeypatch, preset, cuda, expected_env, expected_on):
    if preset is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", preset)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert interpret_triton_without_cuda() is expected_on
    import os

    assert os.environ.get("TRITON_INTERPRET") == expected_env
