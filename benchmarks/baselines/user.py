"""Context-parallel baselines a user would pick today, each with its best local kernel (for the cp case).
What it measures and how to run it: docs/benchmarks/cases.md (baselines/user)."""

import contextlib
import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.baselines import same_kernel
from magi_attention.vendors import SliceMask, VendorUnavailable, fa4_local

Ranges = Sequence[Sequence[int]]

KERNEL_MODULES = {"fa4": "flash_attn.cute", "ffa_fa4": "magi_ffa_fa4", "ffa_cudnn": "magi_ffa_cudnn"}
"""Where the CUDA-only kernels are imported from (by name, on first use); tests point these at CPU stand-ins
with the same call signatures, without shadowing the real packages for anyone else."""


Unavailable = VendorUnavailable
"""This system cannot run this case on this machine; the message says why (the same on every rank)."""

Mask = SliceMask
"""A benchmark mask (``magi_attention.vendors.SliceMask``: slices, ``dense_causal``, ``varlen``)."""


@dataclass(slots=True, kw_only=True)
class UserCase:
    """One system set up on one case, on this rank."""

    step: Callable[[], torch.Tensor]
    """Forward: this rank's output ``[local_tokens, num_heads_q, head_dim]``, autograd to ``inputs`` (the leaf q,
    k, v shards); ``dout`` its gradient; ``token_index`` the global token of each row (None: compared another
    way); ``kernel`` the local kernel's label; ``close()`` undoes the setup (torch_cp's context), once."""
    inputs: tuple[torch.Tensor, ...]
    dout: torch.Tensor
    token_index: torch.Tensor | None
    kernel: str
    close: Callable[[], None] = field(default=lambda: None)


# -- Ulysses: sequence shards <-> head shards (autograd-aware all-to-all) ------------------------------------
def _cp_of(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class _Exchange(torch.autograd.Function):
    """Sequence shards <-> head shards by ``same_kernel``'s all-to-all; the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, to_heads: bool, group) -> torch.Tensor:
        ctx.to_heads, ctx.group = to_heads, group
        move = same_kernel._seq_to_heads if to_heads else same_kernel._heads_to_seq
        return move([x.contiguous()], dist.get_world_size(group), group)[0]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        move = same_kernel._heads_to_seq if ctx.to_heads else same_kernel._seq_to_heads
        return move([grad.contiguous()], dist.get_world_size(ctx.group), ctx.group)[0], None, None


def seq_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """``[t, h, d]`` (this rank's contiguous ``t`` tokens, all heads) -> ``[cp * t, h / cp, d]`` (every token,
    this rank's group of heads; block j: tokens [j t, (j + 1) t)). Differentiable."""
    return _Exchange.apply(x, True, group)


def heads_to_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads`: ``[cp * t, w, d]`` -> ``[t, cp * w, d]``. Differentiable."""
    return _Exchange.apply(x, False, group)


def _check_heads(q: torch.Tensor, k: torch.Tensor, cp: int) -> None:
    hq, hkv = q.shape[1], k.shape[1]
    if hq % cp or hkv % cp:
        raise Unavailable(f"heads not divisible by cp: Ulysses shards heads, needs num_heads_q ({hq}) and "
                          f"num_heads_kv ({hkv}) divisible by cp ({cp})")  # fmt: skip


def _ulysses_case(q, k, v, do, group, local_attn: Callable, kernel: str) -> UserCase:
    """Contiguous sequence shards; forward = a2a(q, k, v) -> local_attn on every token, this rank's heads ->
    a2a(out). ``local_attn(qh, kh, vh)`` maps ``[T, h / cp, d]`` tensors to the output ``[T, hq / cp, d]``."""
    cp, rank = _cp_of(group)
    total = q.shape[0]
    _check_heads(q, k, cp)
    if total % cp:
        raise Unavailable(f"sequence not divisible: {total} tokens over cp {cp}")
    t = total // cp
    rows = slice(rank * t, (rank + 1) * t)
    inputs = tuple(x[rows].detach().clone().requires_grad_() for x in (q, k, v))

    def step() -> torch.Tensor:
        qh, kh, vh = (seq_to_heads(x, group) for x in inputs)
        return heads_to_seq(local_attn(qh, kh, vh), group)

    index = torch.arange(rank * t, (rank + 1) * t, device=q.device)
    return UserCase(step=step, inputs=inputs, dout=do[rows].contiguous(), token_index=index, kernel=kernel)


def _import(name: str, what: str):
    name = KERNEL_MODULES.get(name, name)
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # also a broken install (e.g. a CuTe DSL library missing)
        raise Unavailable(f"{what} not importable: {exc}") from None


def _first(out):
    """FA4 returns out or (out, lse, ...) depending on the version and flags."""
    return out[0] if isinstance(out, tuple | list) else out


# -- ulysses_fa4 ----------------------------------------------------------------------------------------------
def build_ulysses_fa4(q, k, v, do, mask: Mask, group=None) -> UserCase:
    """Ulysses + FlashAttention-4 (``flash_attn_func`` for full / causal, ``flash_attn_varlen_func`` for packed
    documents): the native call of ``magi_attention.vendors.fa4_local``."""
    if mask.dense_causal() is None and mask.varlen() is None and mask.window is None:
        fa4_local(mask, q.device, fa=object())  # raises Unavailable saying which masks FA4 takes
    fa = _import("fa4", "flash_attn.cute (FlashAttention-4)")
    local, label = fa4_local(mask, q.device, fa=fa)
    return _ulysses_case(q, k, v, do, group, local, label)


# -- SDPA backend choice ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _sdpa_probe(backend_name: str, device: str, dtype: torch.dtype, head_dim: int, group_size: int) -> str | None:  # fmt: skip
    """None when SDPA runs forward + backward under ``backend_name`` alone on a small case of this dtype and
    head_dim with ``group_size`` q heads per kv head (``enable_gqa=True`` when > 1); else the error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, 2 * group_size, 256, head_dim, device=device, generator=gen).to(dtype).requires_grad_()
    kv = [torch.randn(1, 2, 256, head_dim, device=device, generator=gen).to(dtype).requires_grad_() for _ in "kv"]  # fmt: skip
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=group_size > 1)
        out.sum().backward()
    except (RuntimeError, ValueError, NotImplementedError) as exc:  # "no available kernel", unsupported shape
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None


def _sdpa_choice(preferred: Sequence[str], q: torch.Tensor, k: torch.Tensor) -> tuple[str, bool]:
    """The first backend of ``preferred`` that runs here, and whether it takes GQA natively (``enable_gqa``;
    else K/V heads are repeated to the q heads before the call)."""
    g = q.shape[1] // k.shape[1]
    device, dtype, d = str(q.device), q.dtype, q.shape[2]
    errors = []
    for name in preferred:
        for native in (True, False) if g > 1 else (True,):
            err = _sdpa_probe(name, device, dtype, d, g if native else 1)
            if err is None:
                return name, native
            errors.append(f"{name}{' enable_gqa' if native and g > 1 else ''}: {err}")
    raise Unavailable(f"no SDPA backend among {list(preferred)} runs here: {'; '.join(errors)}")


def _repeat_kv(x: torch.Tensor, g: int, head_axis: int) -> torch.Tensor:
    """Each K/V head `g` times in a row (query head h uses kv head h // g)."""
    return x if g == 1 else x.repeat_interleave(g, dim=head_axis)


# -- ulysses_cudnn ------------------------------------------------------------------------------------------------
def build_ulysses_cudnn(q, k, v, do, mask: Mask, group=None) -> UserCase:
    """Ulysses + ``F.scaled_dot_product_attention`` under the cuDNN backend (full / causal). On a CPU run the
    math backend stands in (cuDNN needs CUDA), so the Ulysses plumbing is still exercised."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    causal = mask.dense_causal()
    if causal is None:
        raise Unavailable("mask not expressible: SDPA without an explicit mask takes full / causal only")
    _check_heads(q, k, dist.get_world_size(group))
    name, native = _sdpa_choice(["CUDNN_ATTENTION"] if q.is_cuda else ["MATH"], q, k)
    backend = getattr(SDPBackend, name)
    g = q.shape[1] // k.shape[1]

    def local(qh, kh, vh):  # [T, h, d] -> SDPA's [1, h, T, d] (a strided view; no copy)
        q4, k4, v4 = (x.transpose(0, 1)[None] for x in (qh, kh, vh))
        if not native:
            k4, v4 = _repeat_kv(k4, g, 1), _repeat_kv(v4, g, 1)
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=native and g > 1)
        return out[0].transpose(0, 1)

    label = "cuDNN SDPA" if name == "CUDNN_ATTENTION" else f"SDPA {name.lower()} (CPU stand-in for cuDNN)"
    gqa = "" if g == 1 else (", enable_gqa" if native else ", K/V heads repeated")
    return _ulysses_case(q, k, v, do, group, local, f"{label} ({'causal' if causal else 'full'}{gqa})")


# -- torch_cp -----------------------------------------------------------------------------------------------------
TORCH_CP_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
"""SDPA backends torch_cp tries, in order (the ring supports these three)."""
_MESHES: dict[tuple[str, int], object] = {}


def _mesh(device_type: str, size: int):
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, size)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, (size,))
    return _MESHES[key]


def enter_torch_cp(mesh, buffers: list[torch.Tensor], seq_dims: list[int], causal: bool) -> contextlib.ExitStack:  # fmt: skip
    """Enter ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)``: each buffer becomes this rank's shard
    in place (head-tail order when ``causal``, as its ring balances only causal attention; contiguous shards
    otherwise) and SDPA is routed to the ring until the returned stack is closed, which also restores the
    load-balancing option."""
    cp_mod = _import("torch.distributed.tensor.experimental._attention", "torch context_parallel")
    from torch.distributed.tensor.experimental import context_parallel

    options = cp_mod._cp_options
    stack = contextlib.ExitStack()
    stack.callback(setattr, options, "enable_load_balance", options.enable_load_balance)
    options.enable_load_balance = bool(causal)  # its ring refuses load balancing for non-causal SDPA
    try:
        stack.enter_context(context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims,
                                             no_restore_buffers=set(buffers)))  # fmt: skip
        with torch.no_grad():
            for x in buffers:  # resize_ kept the global-size storage: give each shard a storage of its own
                x.set_(x.clone())
    except BaseException:
        stack.close()
        raise
    return stack


def build_torch_cp(q, k, v, do, mask: Mask, group=None) -> UserCase:
    """PyTorch native context parallelism: ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` shards
    the [batch, heads, seq, head_dim] buffers (head-tail order for causal) and routes SDPA to its ring. Backend
    preference: cuDNN, then flash, then memory-efficient (the first that runs here). GQA: K/V heads are
    repeated to the q heads on each shard (as torchtitan does), so the ring moves full-width K/V."""
    causal = mask.dense_causal()
    if causal is None:
        raise Unavailable("mask not expressible: the SDPA ring takes full / causal only")
    if not q.is_cuda or dist.get_backend(group) != "nccl":
        raise Unavailable(f"needs CUDA + NCCL: torch context_parallel's SDPA ring, this run is {q.device.type} / "
                          f"{dist.get_backend(group)}")  # fmt: skip
    if group not in (None, dist.group.WORLD):
        raise Unavailable("not on a sub-group: this harness builds torch_cp's mesh over the whole world")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name, _ = _sdpa_choice(TORCH_CP_BACKENDS, q, q)  # q as k: K/V are repeated to the q heads, no GQA call
    backend = getattr(SDPBackend, name)
    cp = dist.get_world_size(group)
    g = q.shape[1] // k.shape[1]
    # the buffers are sharded in place: fresh [1, h, total, d] copies, plus token positions to learn the order
    q4, k4, v4, do4 = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v, do))
    pos = torch.arange(q.shape[0], device=q.device)
    stack = enter_torch_cp(_mesh(q.device.type, cp), [q4, k4, v4, do4, pos], [2, 2, 2, 2, 0], causal)
    inputs = tuple(x.requires_grad_() for x in (q4, k4, v4))

    def step() -> torch.Tensor:
        qs, ks, vs = inputs
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qs, _repeat_kv(ks, g, 1), _repeat_kv(vs, g, 1), is_causal=causal)  # fmt: skip
        return out[0].transpose(0, 1)

    balance = "head-tail balanced" if causal and q.shape[0] % (2 * cp) == 0 else "contiguous shards"
    kernel = f"SDPA ring, {name.split('_')[0].lower()} ({'causal' if causal else 'full'}, {balance}"
    kernel += ", K/V heads repeated)" if g > 1 else ")"
    dout = do4[0].transpose(0, 1)
    return UserCase(step=step, inputs=inputs, dout=dout, token_index=pos.clone(), kernel=kernel, close=stack.close)  # fmt: skip


# -- ulysses_ffa_fa4, ulysses_ffa_cudnn ---------------------------------------------------------------------------
# per magi_ffa vendor package: its availability check, the distribution it needs and what that provides
FFA_VENDORS = {
    "ffa_fa4": ("fa4_available", "flash-attn-4", "FlashAttention-4 (CuTe DSL)"),
    "ffa_cudnn": ("cudnn_available", "nvidia-cudnn-frontend", "cuDNN's flex_attention"),
}


def build_ulysses_ffa(vendor: str, q, k, v, do, mask: Mask, group=None) -> UserCase:
    """Ulysses + ``magi_ffa_fa4`` / ``magi_ffa_cudnn`` (``vendor`` "ffa_fa4" / "ffa_cudnn")
    ``flex_flash_attn_func`` on the whole mask's slices (any mask)."""
    package = f"magi_{vendor}"
    mod = _import(vendor, package)
    available, dependency, provides = FFA_VENDORS[vendor]
    if not getattr(mod, available)():
        raise Unavailable(f"{dependency} not importable: {package} needs {provides}")
    qr, kr = (
        torch.tensor(r, dtype=torch.int32, device=q.device).reshape(-1, 2)
        for r in (mask.q_ranges, mask.k_ranges)
    )
    tm = torch.tensor(mask.types, dtype=torch.int32, device=q.device)

    def local(qh, kh, vh):  # the same tensors every call: the package caches its plan by their identity
        return _first(mod.flex_flash_attn_func(qh, kh, vh, qr, kr, tm))

    return _ulysses_case(q, k, v, do, group, local, f"{package} flex_flash_attn_func ({len(mask.types)} slices)")  # fmt: skip


BUILDERS: dict[str, Callable[..., UserCase]] = {
    "ulysses_fa4": build_ulysses_fa4, "ulysses_cudnn": build_ulysses_cudnn, "torch_cp": build_torch_cp,
    "ulysses_ffa_fa4": functools.partial(build_ulysses_ffa, "ffa_fa4"),
    "ulysses_ffa_cudnn": functools.partial(build_ulysses_ffa, "ffa_cudnn"),
}  # fmt: skip


def build_case(system: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, mask: Mask,
               group: dist.ProcessGroup | None = None) -> UserCase:  # fmt: skip
    """Set up ``system`` (a key of ``BUILDERS``) on this rank from the global ``[total, heads, head_dim]``
    q/k/v/dout; raises ``Unavailable`` (the reason) where it cannot run here."""
    if system not in BUILDERS:
        raise ValueError(f"`system` must be one of {sorted(BUILDERS)}, got {system!r}")
    return BUILDERS[system](q, k, v, do, mask, group)
