"""Every test suite's conftest sets Triton's interpreter through the one rule (only without CUDA), never
unconditionally: `python -m pytest -m gpu` on a GPU machine must run the kernels compiled."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFTESTS = sorted(
    p
    for pattern in ("packages/*/tests/conftest.py", "integrations/*/tests/conftest.py", "tests/conftest.py")
    for p in ROOT.glob(pattern)
)


def test_no_conftest_forces_the_interpreter():
    offenders = []
    for path in CONFTESTS:
        text = path.read_text()
        if re.search(r"""environ(\.setdefault\(|\[)\s*["']TRITON_INTERPRET""", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, (
        f"set TRITON_INTERPRET via magi_ffa.testing.interpret_triton_without_cuda: {offenders}"
    )


def test_kernel_suites_use_the_rule():
    # the suites whose tests run magi_ffa's Triton kernels on CPU tensors
    for name in ("ffa", "ffa_fa4", "ffa_cudnn", "magi_attention"):
        text = (ROOT / "packages" / name / "tests" / "conftest.py").read_text()
        assert "interpret_triton_without_cuda()" in text, name
