"""Environment variables: one env module per package, strict booleans and checked values, every variable on
docs/flags.md, and the runtime flags (deterministic mode, hierarchical comm, native group collective)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import magi_ffa.env as ffa_env
import magi_ffa_fa4.env as fa4_env
import magi_group_collective.env as gc_env
from magi_attention import env as ma_env
from magi_attention.testing import run_distributed

ROOT = Path(__file__).resolve().parents[3]
ENV_MODULES = {
    "ffa/src/magi_ffa/env.py",
    "ffa_fa4/src/magi_ffa_fa4/env.py",
    "ffa_cudnn/src/magi_ffa_cudnn/env.py",
    "solver/src/magi_solver/env.py",
    "group_collective/src/magi_group_collective/env.py",
    "magi_attention/src/magi_attention/env.py",
}

BOOLS = [
    (ffa_env.poison, "MAGI_FFA_POISON", False),
    (ffa_env.triton_interpret, "TRITON_INTERPRET", False),
    (fa4_env.poison, "MAGI_FFA_FA4_POISON", False),
    (fa4_env.r2p, "MAGI_FFA_FA4_R2P", True),
    (fa4_env.varlen, "MAGI_FFA_FA4_VARLEN", True),
    (gc_env.debug, "MAGI_GROUP_COLLECTIVE_DEBUG", False),
    (ma_env.sanity_check_enabled, "MAGI_ATTENTION_SANITY_CHECK", False),
    (ma_env.deterministic_mode, "MAGI_ATTENTION_DETERMINISTIC_MODE", False),
    (ma_env.hierarchical_comm, "MAGI_ATTENTION_HIERARCHICAL_COMM", True),
    (ma_env.native_grpcoll, "MAGI_ATTENTION_NATIVE_GRPCOLL", False),
    (ma_env.mask_mod_compile, "MAGI_ATTENTION_MASK_MOD_COMPILE", True),
    (ma_env.triton_interpret, "TRITON_INTERPRET", False),
]


@pytest.mark.parametrize(("fn", "name", "default"), BOOLS, ids=[f"{b[0].__module__}.{b[1]}" for b in BOOLS])
def test_booleans_are_strict(monkeypatch, fn, name, default) -> None:
    monkeypatch.delenv(name, raising=False)
    assert fn() is default
    for raw, want in (
        ("1", True),
        ("0", False),
        ("true", True),
        ("FALSE", False),
        ("True", True),
        ("", default),
    ):
        monkeypatch.setenv(name, raw)
        assert fn() is want, (name, raw)
    for raw in ("yes", "on", "2", "enable"):
        monkeypatch.setenv(name, raw)
        with pytest.raises(ValueError, match=name):
            fn()


VALUED = [
    (ffa_env.backend, "MAGI_FFA_BACKEND", "Torch", "torch", "cuda"),
    (lambda: ffa_env.tiles("fwd"), "MAGI_FFA_TILES_FWD", "32,16,4,1", (32, 16, 4, 1), "32,16"),
    (
        lambda: ffa_env.tiles("bwd"),
        "MAGI_FFA_TILES_BWD",
        "64,128,128,64,8,3",
        (64, 128, 128, 64, 8, 3),
        "24,16,16,16,4,1",
    ),
    (fa4_env.plan_cache_size, "MAGI_FFA_FA4_PLAN_CACHE", "8", 8, "0"),
    (ffa_env.mask_cache_size, "MAGI_FFA_MASK_CACHE", "16", 16, "0"),
    (ffa_env.mask_cache_bytes, "MAGI_FFA_MASK_CACHE_MB", "2", 2 << 20, "-1"),
    (gc_env.impl, "MAGI_GROUP_COLLECTIVE_IMPL", "A2AV", "a2av", "deepep"),
    (gc_env.kernels, "MAGI_GROUP_COLLECTIVE_KERNELS", "triton", "triton", "cuda"),
    (ma_env.kernel_backend_override, "MAGI_ATTENTION_KERNEL_BACKEND", "sdpa", "torch", "flash"),
    (ma_env.runtime_dict_size, "MAGI_ATTENTION_DIST_ATTN_RUNTIME_DICT_SIZE", "5", 5, "-1"),
]


@pytest.mark.parametrize(("fn", "name", "good", "want", "bad"), VALUED, ids=[v[1] for v in VALUED])
def test_valued_variables_are_checked(monkeypatch, fn, name, good, want, bad) -> None:
    monkeypatch.setenv(name, good)
    assert fn() == want
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        fn()


def _src_files():
    for pkg in sorted((ROOT / "packages").iterdir()):
        yield from sorted((pkg / "src").rglob("*.py"))


def test_environment_is_read_only_in_env_modules() -> None:
    """Only the env modules read os.environ (testing.py only *sets* OMP_NUM_THREADS for its children)."""
    offenders = []
    for path in _src_files():
        rel = str(path.relative_to(ROOT / "packages"))
        if rel in ENV_MODULES:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv\(", line) and 'setdefault("OMP_NUM_THREADS"' not in line:
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "environment read outside the env modules:\n" + "\n".join(offenders)


def test_every_variable_is_documented() -> None:
    doc = (ROOT / "docs" / "flags.md").read_text()
    names = set()
    for rel in ENV_MODULES:
        text = (ROOT / "packages" / rel).read_text()
        names |= set(re.findall(r"\b(MAGI_[A-Z0-9_]+[A-Z0-9]|TRITON_INTERPRET)\b", text))
    names.discard("MAGI_FFA_TILES_")
    missing = sorted(n for n in names if n not in doc)
    assert not missing, f"docs/flags.md does not list {missing}"
    for upstream in (
        "MAGI_ATTENTION_SANITY_CHECK",
        "MAGI_ATTENTION_KERNEL_BACKEND",
        "MAGI_ATTENTION_NATIVE_GRPCOLL",
        "MAGI_ATTENTION_DETERMINISTIC_MODE",
        "MAGI_ATTENTION_HIERARCHICAL_COMM",
    ):
        assert upstream in names and upstream in doc


def test_deterministic_mode_reaches_every_kernel_call(monkeypatch) -> None:
    from types import SimpleNamespace

    from magi_attention._runtime.cache import KernelSlices
    from magi_attention._runtime.kernels import AttnKernel
    from magi_attention.dist_attn import _bwd_call, _fwd_call

    seen = []

    def fwd(*args, **kw):
        seen.append(("fwd", kw.get("deterministic", False)))
        return args[0], args[0][:, :, 0]

    def bwd(*args, **kw):
        seen.append(("bwd", kw.get("deterministic", False)))
        return args[1], args[2], args[3]

    impl = SimpleNamespace(fwd_checked=fwd, bwd_checked=bwd)  # the contract's entries on checked slices
    kernel = AttnKernel("torch", "torch", impl, impl)
    x = torch.zeros(4, 1, 8)
    r = torch.tensor([[0, 4]], dtype=torch.int32)
    sl = KernelSlices(r, r, torch.zeros(1, dtype=torch.int32), 1)
    from magi_attention.config import DistAttnConfig

    for flag in ("0", "1"):
        monkeypatch.setenv("MAGI_ATTENTION_DETERMINISTIC_MODE", flag)
        # the variable is read when a config is built; the calls take the key's config value
        det = DistAttnConfig().deterministic
        _fwd_call(kernel, x, x, x, sl, None, None, 1.0, 0.0, deterministic=det)
        _bwd_call(kernel, x, x, x, x, x, x[:, :, 0], sl, None, None, None, 1.0, 0.0, deterministic=det)
    assert seen == [("fwd", False), ("bwd", False), ("fwd", True), ("bwd", True)]


def _runtime_flags_worker(rank: int, world_size: int) -> None:
    import os

    from torch.distributed.device_mesh import init_device_mesh

    from magi_attention._runtime.cache import RUNTIME_CACHE
    from magi_attention.api import calc_attn, clear_cache, dispatch, magi_attn_varlen_key, undispatch
    from magi_attention.config import DispatchConfig, DistAttnConfig, OverlapConfig
    from magi_ffa.testing import make_attn_mask, ref_attn
    from magi_group_collective import GroupCollectiveImpl

    total, hq, d = 64, 2, 8
    cfg = DistAttnConfig(dispatch_config=DispatchConfig(chunk_size=4), overlap_config=OverlapConfig(degree=1))
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("inter", "intra"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, hq, d, dtype=torch.float64, generator=gen) for _ in range(3))
    ref, _ = ref_attn(q, k, v, make_attn_mask([[0, 30], [30, 64]], [[0, 30], [30, 64]], [1, 1], total, total))
    for flag, want in (("0", GroupCollectiveImpl.A2AV), ("1", GroupCollectiveImpl.HIERARCHICAL)):
        os.environ["MAGI_ATTENTION_HIERARCHICAL_COMM"] = flag
        clear_cache()
        key = magi_attn_varlen_key(
            [0, 30, 64], [0, 30, 64], hq, hq, d, mesh, causal=True, dist_attn_config=cfg
        )
        out, _ = calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
        plans = RUNTIME_CACHE.get(key).device_meta(torch.device("cpu")).cast_plans
        assert plans and all(p.impl == want for p in plans), (flag, [p.impl for p in plans])
        assert torch.allclose(undispatch(out, key), ref, rtol=1e-10, atol=1e-12)
    del os.environ["MAGI_ATTENTION_HIERARCHICAL_COMM"]
    # native on CPU / gloo: a clear error on every rank, naming the setting that chose it, before any
    # group-collective data moves; an explicit config wins over the environment variable
    from magi_attention.config import GrpCollConfig
    from magi_group_collective import NativeUnavailableError

    group = dist.group.WORLD
    os.environ["MAGI_ATTENTION_NATIVE_GRPCOLL"] = "1"
    for config_native, setting in ((None, "MAGI_ATTENTION_NATIVE_GRPCOLL=1"),
                                   (True, "DistAttnConfig.grpcoll_config.native=True")):  # fmt: skip
        clear_cache()
        c = DistAttnConfig(
            dispatch_config=cfg.dispatch_config,
            overlap_config=cfg.overlap_config,
            grpcoll_config=GrpCollConfig(native=config_native),
        )
        key = magi_attn_varlen_key(
            [0, 30, 64], [0, 30, 64], hq, hq, d, group, causal=True, dist_attn_config=c
        )
        with pytest.raises(NativeUnavailableError, match="not a CUDA device") as err:
            calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
        assert setting in str(err.value) and "impl='a2av'" in str(err.value), str(err.value)
    # explicit native=False beats MAGI_ATTENTION_NATIVE_GRPCOLL=1: a2av, correct result
    clear_cache()
    c = DistAttnConfig(
        dispatch_config=cfg.dispatch_config,
        overlap_config=cfg.overlap_config,
        grpcoll_config=GrpCollConfig(native=False),
    )
    key = magi_attn_varlen_key([0, 30, 64], [0, 30, 64], hq, hq, d, group, causal=True, dist_attn_config=c)
    out, _ = calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
    plans = RUNTIME_CACHE.get(key).device_meta(torch.device("cpu")).cast_plans
    assert plans and all(p.impl == GroupCollectiveImpl.A2AV for p in plans)
    assert torch.allclose(undispatch(out, key), ref, rtol=1e-10, atol=1e-12)
    del os.environ["MAGI_ATTENTION_NATIVE_GRPCOLL"]
    # MAGI_GROUP_COLLECTIVE_IMPL=native (the package's own setting) on a flat group is named as such
    os.environ["MAGI_GROUP_COLLECTIVE_IMPL"] = "native"
    try:
        clear_cache()
        key = magi_attn_varlen_key(
            [0, 30, 64], [0, 30, 64], hq, hq, d, group, causal=True, dist_attn_config=cfg
        )
        with pytest.raises(NativeUnavailableError, match="selected by MAGI_GROUP_COLLECTIVE_IMPL"):
            calc_attn(dispatch(q, key), dispatch(k, key), dispatch(v, key), key)
    finally:
        del os.environ["MAGI_GROUP_COLLECTIVE_IMPL"]
        clear_cache()


def test_hierarchical_comm_and_native_grpcoll_flags() -> None:
    run_distributed(_runtime_flags_worker, 4, timeout=300)


@pytest.mark.parametrize(
    ("config_native", "env_native", "mesh", "hier_env", "want"),
    [
        # explicit config wins over MAGI_ATTENTION_NATIVE_GRPCOLL
        (True, "0", False, "1", "native"),
        (True, "", True, "1", "native"),
        (False, "1", False, "1", "a2av"),
        (False, "1", True, "1", "hierarchical"),
        (False, "1", True, "0", "a2av"),
        # None: the environment variable decides
        (None, "1", False, "1", "native"),
        (None, "1", True, "0", "native"),
        (None, "0", True, "1", "hierarchical"),
        (None, "", True, "0", "a2av"),
        (None, "", False, "1", "a2av"),  # flat group, nothing set: MAGI_GROUP_COLLECTIVE_IMPL unset, a2av
    ],
)
def test_collective_impl_resolution(monkeypatch, config_native, env_native, mesh, hier_env, want) -> None:
    """The documented table (docs/packages/group_collective.md, "Choosing the implementation")."""
    from magi_attention._runtime.collective_choice import choose_collective
    from magi_attention.config import GrpCollConfig

    monkeypatch.setenv("MAGI_ATTENTION_NATIVE_GRPCOLL", env_native)
    monkeypatch.setenv("MAGI_ATTENTION_HIERARCHICAL_COMM", hier_env)
    monkeypatch.delenv("MAGI_GROUP_COLLECTIVE_IMPL", raising=False)
    got = choose_collective(GrpCollConfig(native=config_native), mesh)
    assert got.impl.value == want


@pytest.mark.parametrize(
    ("config_native", "mesh", "package_env", "want", "setting"),
    [
        # a flat group with native=None leaves the choice to magi-group-collective's own variable
        (None, False, "native", "native", "MAGI_GROUP_COLLECTIVE_IMPL=native"),
        (None, False, "a2av", "a2av", "MAGI_GROUP_COLLECTIVE_IMPL=a2av"),
        # an explicit config, or a 2-D mesh, is not overridden by it
        (False, False, "native", "a2av", "DistAttnConfig.grpcoll_config.native=False"),
        (None, True, "native", "hierarchical", "MAGI_ATTENTION_HIERARCHICAL_COMM=1"),
    ],
)
def test_collective_choice_below_the_runtime_settings(
    monkeypatch, config_native, mesh, package_env, want, setting
) -> None:
    from magi_attention._runtime.collective_choice import choose_collective
    from magi_attention.config import GrpCollConfig

    monkeypatch.delenv("MAGI_ATTENTION_NATIVE_GRPCOLL", raising=False)
    monkeypatch.delenv("MAGI_ATTENTION_HIERARCHICAL_COMM", raising=False)
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_IMPL", package_env)
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_NATIVE_BUFFER_MB", "8")
    got = choose_collective(GrpCollConfig(native=config_native), mesh)
    assert (got.impl.value, got.setting) == (want, setting)
    assert got.native_buffer_mb == (8 if want == "native" else None)


def test_collective_choice_checks_the_group_shape_when_the_key_is_built(monkeypatch) -> None:
    """Hierarchical chosen for a flat group raises when the key is built (naming the setting), not later."""
    from magi_attention._runtime.collective_choice import choose_collective
    from magi_attention.config import GrpCollConfig

    monkeypatch.delenv("MAGI_ATTENTION_NATIVE_GRPCOLL", raising=False)
    monkeypatch.setenv("MAGI_GROUP_COLLECTIVE_IMPL", "hierarchical")
    with pytest.raises(ValueError, match="selected by MAGI_GROUP_COLLECTIVE_IMPL=hierarchical"):
        choose_collective(GrpCollConfig(native=None), False)


def test_grpcoll_config_validation() -> None:
    from magi_attention import DistAttnConfig, GrpCollConfig

    assert DistAttnConfig().grpcoll_config == GrpCollConfig(native=None)
    native = DistAttnConfig(grpcoll_config=GrpCollConfig(native=True))
    assert native != DistAttnConfig() and hash(native) is not None  # part of the (hashable) runtime key
    with pytest.raises(TypeError, match=r"GrpCollConfig\.native"):
        GrpCollConfig(native="yes")
    with pytest.raises(TypeError, match="grpcoll_config"):
        DistAttnConfig(grpcoll_config={"native": True})
