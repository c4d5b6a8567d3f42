"""Kernel backend selection: config and environment, agreement across ranks, clear errors, dtype refinement,
and the dynamic overlap's choice on the runtime's cost model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from magi_attention import DispatchConfig, DistAttnConfig, OverlapConfig, OverlapMode
from magi_attention._runtime.cache import RUNTIME_CACHE
from magi_attention._runtime.kernels import KernelChoice, RankBackends, resolve
from magi_attention._runtime.key_route import clear_agreements
from magi_attention.api import calc_attn, clear_cache, dispatch, magi_attn_flex_key, undispatch
from magi_attention.config import KernelBackend
from magi_attention.env import kernel_backend_override
from magi_attention.testing import run_distributed
from magi_ffa.testing import make_attn_mask, ref_attn

B = KernelBackend
GPU_FA4 = RankBackends("h200", ("fa4", "torch", "triton"))
GPU_NO_FA4 = RankBackends("h200", ("torch", "triton"), "flash-attn-4 does not import")
CPU = RankBackends("cpu", ("torch",), "no CUDA GPU")


def test_config_values_and_errors() -> None:
    assert DistAttnConfig().kernel_backend == B.AUTO
    assert DistAttnConfig(kernel_backend="fa4").kernel_backend is B.FA4
    # any name: a backend registered with magi_ffa.contract.register_backend, checked when a key is built
    assert DistAttnConfig(kernel_backend="cuda").kernel_backend == "cuda"
    with pytest.raises(
        ValueError, match=r"kernel_backend='cuda' cannot run on every rank.*no kernel backend named"
    ):
        magi_attn_flex_key(
            [[0, 8]], [[0, 8]], "full", 8, 8, 1, 1, 16, None, DistAttnConfig(kernel_backend="cuda")
        )
    with pytest.raises(TypeError, match="kernel_backend"):
        DistAttnConfig(kernel_backend=None)
    assert OverlapConfig().mode == OverlapMode.DYNAMIC and OverlapConfig().degree is None
    assert OverlapConfig(degree=2).mode == OverlapMode.STATIC
    assert OverlapConfig(degree=0).mode == OverlapMode.STATIC
    with pytest.raises(ValueError, match="static"):
        OverlapConfig(mode="static")
    with pytest.raises(TypeError, match="cost_profile"):
        OverlapConfig(cost_profile=3)
    assert DistAttnConfig().high_precision_grad_reduce is True
    with pytest.raises(TypeError, match="high_precision_grad_reduce"):
        DistAttnConfig(high_precision_grad_reduce="no")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", None),
        ("auto", B.AUTO),
        ("FA4", B.FA4),
        ("ffa", B.TRITON),
        ("triton", B.TRITON),
        ("sdpa", B.TORCH),
    ],
)
def test_environment_override(monkeypatch, raw, expected) -> None:
    monkeypatch.setenv("MAGI_ATTENTION_KERNEL_BACKEND", raw)
    assert kernel_backend_override() == expected


def test_environment_override_rejects_unknown(monkeypatch) -> None:
    monkeypatch.setenv("MAGI_ATTENTION_KERNEL_BACKEND", "flash")
    with pytest.raises(ValueError, match="MAGI_ATTENTION_KERNEL_BACKEND"):
        kernel_backend_override()


@pytest.mark.parametrize(
    ("requested", "ranks", "head_dim", "expected"),
    [
        (B.AUTO, [GPU_FA4, GPU_FA4], 128, B.FA4),
        (B.AUTO, [GPU_FA4, GPU_NO_FA4], 128, B.TRITON),  # one rank without FA4: nobody uses it
        (B.AUTO, [GPU_FA4, GPU_FA4], 256, B.TRITON),  # head_dim FA4 lacks here
        (B.AUTO, [GPU_FA4, GPU_FA4], 20, B.TORCH),  # neither kernel takes head_dim 20
        (B.AUTO, [CPU, CPU], 64, B.TORCH),
        (B.TORCH, [GPU_FA4], 128, B.TORCH),
        (B.TRITON, [GPU_FA4, GPU_NO_FA4], 64, B.TRITON),
    ],
)
def test_resolution(requested, ranks, head_dim, expected) -> None:
    assert resolve(requested, head_dim, ranks).backend == expected


def test_explicit_choice_names_the_ranks_that_cannot() -> None:
    with pytest.raises(ValueError, match=r"kernel_backend='fa4'.*rank 1: flash-attn-4 does not import"):
        resolve(B.FA4, 128, [GPU_FA4, GPU_NO_FA4])
    with pytest.raises(ValueError, match="needs head_dim a multiple of 8 and at most 128, got 256"):
        resolve(B.FA4, 256, [GPU_FA4])
    with pytest.raises(ValueError, match=r"kernel_backend='triton'.*rank 0: no CUDA GPU"):
        resolve(B.TRITON, 64, [CPU])
    with pytest.raises(ValueError, match="power of two"):
        resolve(B.TRITON, 96, [GPU_FA4])


def test_dtype_refinement() -> None:
    candidates = ("fa4", "torch", "triton")
    auto_fa4 = KernelChoice(B.FA4, B.AUTO, "h200", candidates)
    assert auto_fa4.backend_for(torch.bfloat16, 128) == B.FA4
    assert auto_fa4.backend_for(torch.float32, 128) == B.TRITON
    assert auto_fa4.backend_for(torch.float64, 128) == B.TORCH
    explicit = KernelChoice(B.FA4, B.FA4, "h200", candidates)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        explicit.backend_for(torch.float32, 128)
    with pytest.raises(ValueError, match="triton"):
        KernelChoice(B.TRITON, B.TRITON, "h200", candidates).backend_for(torch.float64, 64)


def _explicit_fa4_worker(rank: int, world_size: int, backend: str = "fa4") -> str:
    clear_agreements()
    config = DistAttnConfig(kernel_backend=backend)
    try:
        magi_attn_flex_key([[0, 64]], [[0, 64]], "causal", 64, 64, 2, 1, 16, dist.group.WORLD, config)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("backend", ["fa4", "cudnn"])
def test_explicit_fa4_without_it_raises_on_every_rank(backend: str) -> None:
    """Here neither FA4 nor cuDNN's flex_attention runs: every rank raises, naming the ranks and the reason."""
    messages = run_distributed(_explicit_fa4_worker, 2, backend, timeout=120)
    assert all(f"kernel_backend='{backend}' cannot run on every rank" in m for m in messages), messages
    assert all("rank 0:" in m and "rank 1:" in m for m in messages), messages


def _backend_worker(rank: int, world_size: int, env_backend: str) -> tuple[str, float, int]:
    import os

    os.environ["MAGI_ATTENTION_KERNEL_BACKEND"] = env_backend
    clear_agreements()
    total, hq, hkv, d = 48, 2, 1, 16
    qr, kr, tm = [[0, 20], [10, 48], [30, 48]], [[0, 20], [0, 40], [5, 30]], [1, 3, 2]
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=8), overlap_config=OverlapConfig(degree=1)
    )
    key = magi_attn_flex_key(qr, kr, tm, total, total, hq, hkv, d, dist.group.WORLD, config)
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(total, h, d, generator=gen, dtype=torch.float32) for h in (hq, hkv, hkv, hq))
    ins = [dispatch(t, key).requires_grad_() for t in (q, k, v)]
    out, _ = calc_attn(*ins, key)
    out.backward(dispatch(do, key))
    got = undispatch(ins[0].grad, key)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attn(qd, kd, vd, make_attn_mask(qr, kr, tm, total, total))
    (ref * do.double()).sum().backward()
    err = max(
        ((undispatch(out.detach(), key).double() - ref.detach()).norm() / ref.norm()).item(),
        ((got.double() - qd.grad).norm() / qd.grad.norm()).item(),
    )
    backend = RUNTIME_CACHE.get(key).kernel(torch.float32).backend.value
    clear_cache()
    return backend, err, 0


@pytest.mark.parametrize(("env_backend", "expected"), [("ffa", "triton"), ("", "torch")])
def test_env_selects_the_kernel_of_every_call(env_backend: str, expected: str) -> None:
    """MAGI_ATTENTION_KERNEL_BACKEND=ffa runs the Triton kernels (interpreter here); unset on CPU = torch."""
    for backend, err, _ in run_distributed(_backend_worker, 2, env_backend, timeout=300):
        assert backend == expected
        assert err < 1e-4, err


def _dynamic_worker(rank: int, world_size: int, profile: str) -> int:
    total = 4096
    config = DistAttnConfig(
        dispatch_config=DispatchConfig(chunk_size=256), overlap_config=OverlapConfig(cost_profile=profile)
    )
    key = magi_attn_flex_key(
        [[0, total]], [[0, total]], "full", total, total, 64, 8, 128, dist.group.WORLD, config
    )
    degree = RUNTIME_CACHE.get(key).plan.overlap_degree
    clear_cache()
    return degree


def test_dynamic_overlap_picks_degree_zero_where_cheapest() -> None:
    """Full mask at cp 2 on H200 + FA4 constants: stages would only add launches and merges."""
    assert run_distributed(_dynamic_worker, 2, "h200/fa4", timeout=120) == [0, 0]
