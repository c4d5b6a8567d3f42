"""The Triton kernels compiled ahead of time for sm_90a (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas
bundled in the triton wheel), without a GPU: catches what only the GPU compiler rejects and the interpreter
lets through (tensor-descriptor use, constexpr rules, layouts of the one-launch backward). Each kernel is
compiled with the shipped sm90 tiles in a fresh process (TRITON_INTERPRET=1 swaps the jit functions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

_AOT = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from magi_ffa import _tiles
from magi_ffa._triton_bwd import ffa_bwd_kernel
from magi_ffa._triton_fwd import ffa_fwd_kernel

kind, d, programs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
INTS = {"SLICES", "BLK_PTR", "BLK_IDX", "BLK_ORDER", "QB_PTR", "QB_IDX", "QB_ORDER", "KB_PTR", "KB_IDX", "KB_ORDER"}
BF16 = {"Q", "K", "V", "DO", "O", "DQ", "DK", "DV"}
SCALARS = {"GROUP", "HQ", "HK", "NUM_KB", "NUM_QB"}
flags = dict(SOFTCAP=False, ACCUM=False, UPCAST=False, IEEE=False)
if kind == "fwd":
    fn, t = ffa_fwd_kernel, _tiles._FWD["sm90"]["16bit"][d]
    const = dict(HEAD_DIM=d, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_SINK=False, RET_MAX=False,
                 MAX_ONLY=False, USE_TMA=True, **flags)
else:
    fn, t = ffa_bwd_kernel, _tiles._BWD["sm90"]["16bit"][d]
    const = dict(HEAD_DIM=d, BLOCK_M1=t.block_m1, BLOCK_N1=t.block_n1, BLOCK_M2=t.block_m2,
                 BLOCK_N2=t.block_n2, HEAD_MAJOR=t.head_major, PROGRAMS=programs, **flags)
sig = {}
for n in fn.arg_names:
    if n in const:
        sig[n] = "constexpr"
    elif n.isupper() and n not in SCALARS:
        sig[n] = "*i32" if n in INTS else "*bf16" if n in BF16 else "*fp32"
    else:
        sig[n] = "fp32" if n in ("sm_scale", "softcap") else "i32"
k = compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 64),
            options=dict(num_warps=t.num_warps, num_stages=t.num_stages))
assert len(k.asm["cubin"]) > 0
print("compiled", kind, d, programs)
"""


# bwd programs: 0 = both kinds in one launch, 1 = K/V programs only, 2 = q programs only (split backward)
@pytest.mark.parametrize(
    "kind,d,programs", [("fwd", 128, 0), ("bwd", 128, 0), ("bwd", 128, 1), ("bwd", 128, 2), ("bwd", 256, 0)]
)
def test_kernel_compiles_for_sm90(kind: str, d: int, programs: int) -> None:
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("the triton wheel has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _AOT, kind, str(d), str(programs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
