"""Imports that cost what they use: importing our packages loads neither `torch._dynamo` / `torch._inductor`
nor a vendor's kernels, a key imports only the vendors its agreed choice runs, and a vendor that is installed
but fails to import raises naming it. The vendors are stubs on `sys.path` (with the distribution metadata pip
would write) that fail when imported and log the attempt; each case runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from magi_attention._runtime.compile_break import graph_break

VENDORS = {  # module -> the distribution that installs it
    "flash_attn": "flash-attn-4",
    "cutlass": "nvidia-cutlass-dsl",
    "cudnn": "nvidia-cudnn-frontend",
    "quack": "quack-kernels",
}
HEAVY = ("torch._dynamo", "torch._inductor", *VENDORS)


def _stub_vendors(root: Path) -> Path:
    """Vendor packages that log their import to `root/imported.log` and then fail (half with ImportError,
    half with RuntimeError: a vendor may raise anything while it imports), with dist-info metadata."""
    log = root / "imported.log"
    for i, (module, dist) in enumerate(VENDORS.items()):
        pkg = root / module
        pkg.mkdir()
        error = "ImportError" if i % 2 else "RuntimeError"
        (pkg / "__init__.py").write_text(
            f"open({str(log)!r}, 'a').write({module!r} + '\\n')\n"
            f"raise {error}('stub {module}: this vendor is broken here')\n"
        )
        info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "top_level.txt").write_text(module + "\n")
    return log


def _run(tmp_path: Path, code: str) -> dict:
    """Run `code` (which prints one JSON line last) in a fresh interpreter with the stubs first on sys.path,
    after `import sys, json, torch` and `heavy()`: the compiler and vendor modules loaded."""
    log = _stub_vendors(tmp_path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    env["MAGI_ATTENTION_KERNEL_BACKEND"] = ""
    out = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["imported"] = log.read_text().split() if log.exists() else []
    return result


_PRELUDE = f"""import sys, json, torch
def heavy():
    return sorted(m for m in sys.modules if m.split('.')[0] in {list(VENDORS)!r}
                  or m.startswith(('torch._dynamo', 'torch._inductor')))
"""


def test_importing_our_packages_loads_no_compiler_and_no_vendor(tmp_path: Path) -> None:
    """After `import torch, magi_attention` and every one of our packages: no torch._dynamo, torch._inductor
    or vendor module, and no vendor import was even tried; the probes still see the stubs as installed."""
    res = _run(
        tmp_path,
        """
        import magi_attention
        first = heavy()
        import magi_mask, magi_ffa, magi_ffa_fa4, magi_ffa_cudnn, magi_solver, magi_group_collective
        from magi_attention._runtime.kernels import backend_missing
        missing = {name: backend_missing(name) for name in ("fa4", "cudnn")}
        print(json.dumps({"first": first, "all": heavy(), **missing}))
    """,
    )
    assert res["first"] == [] and res["all"] == [], res
    assert res["imported"] == [], res
    if not torch.cuda.is_available():  # installed (the metadata is read), but this machine has no GPU
        assert res["fa4"] == "no CUDA GPU" and res["cudnn"] == "no CUDA GPU", res


def test_keys_of_other_backends_import_no_vendor(tmp_path: Path) -> None:
    """Keys with kernel_backend torch, triton and auto (on the CPU: the torch path) import no vendor, and
    calc_attn on them runs."""
    res = _run(
        tmp_path,
        """
        from magi_attention import DistAttnConfig
        from magi_attention.api import calc_attn, dispatch, magi_attn_flex_key, undispatch
        chosen = {}
        for backend in ("torch", "triton", "auto"):
            key = magi_attn_flex_key([[0, 32]], [[0, 32]], "causal", 32, 32, 2, 1, 16, None,
                                     DistAttnConfig(kernel_backend=backend))
            q, k, v = (torch.randn(32, h, 16) for h in (2, 1, 1))
            out, _ = calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
            assert undispatch(out, key).isfinite().all()
            from magi_attention._runtime.cache import RUNTIME_CACHE
            chosen[backend] = str(RUNTIME_CACHE.get(key).kernel_choice.backend)
        print(json.dumps({"heavy": heavy(), "chosen": chosen}))
    """,
    )
    assert res["imported"] == [] and res["heavy"] == [], res
    assert res["chosen"]["torch"] == "torch" and res["chosen"]["triton"] == "triton", res


@pytest.mark.parametrize(("backend", "vendor"), [("fa4", "flash-attn-4"), ("cudnn", "nvidia-cudnn-frontend")])
def test_an_explicit_backend_whose_vendor_fails_to_import_raises_naming_it(
    tmp_path: Path, backend: str, vendor: str
) -> None:
    """The probe finds the vendor installed and (patched here) a Hopper GPU, so the explicit choice is agreed;
    the key then imports that vendor alone, which fails: ImportError naming it, before any data moves."""
    res = _run(
        tmp_path,
        f"""
        import magi_ffa.contract
        magi_ffa.contract.cuda_arch_major = lambda: 9  # this GPU claims sm90: only the import can fail
        from magi_attention import DistAttnConfig
        from magi_attention.api import magi_attn_flex_key
        try:
            magi_attn_flex_key([[0, 64]], [[0, 64]], "causal", 64, 64, 2, 1, 16, None,
                               DistAttnConfig(kernel_backend={backend!r}))
            print(json.dumps({{"error": None}}))
        except ImportError as e:
            print(json.dumps({{"error": str(e)}}))
    """,
    )
    assert res["error"] is not None and vendor in res["error"] and "does not import" in res["error"], res
    assert f"kernel_backend={backend!r}" in res["error"], res
    # the vendor of the chosen backend was tried, the other backend's was not
    other = "cudnn" if backend == "fa4" else "flash_attn"
    assert res["imported"] and other not in res["imported"], res


# -- the graph break of the public calls ------------------------------------------------------------------
def test_graph_break_breaks_the_compiled_graph_exactly_at_the_call() -> None:
    """A compiled function calling a `graph_break` function compiles into two graphs (before and after the
    call), counts one graph break, never traces into it, and matches eager."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    traced = []

    @graph_break
    def opaque(x: torch.Tensor) -> torch.Tensor:
        traced.append(torch.compiler.is_compiling())
        return x.sum() * 3 + x.numel()

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        return opaque(x * 2) + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend=backend)
    for _ in range(3):
        x = torch.randn(5)
        torch.testing.assert_close(compiled(x), f(x))
    assert len(graphs) == 2, graphs  # the graph before the call and the one after it, compiled once each
    assert sum(counters["graph_break"].values()) == 1, dict(counters["graph_break"])
    assert traced and not any(traced)  # always run eagerly, never traced
    torch._dynamo.reset()
