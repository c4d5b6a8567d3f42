"""Helpers the benchmarks share: their masks, each kernel's runner on the same inputs (built outside the timing),
timing, a result file's header. FLOPs(fwd) = 4 * area * heads_q * head_dim, FLOPs(bwd) = 2.5 * FLOPs(fwd).
Only torch is imported with the module (magi packages where used)."""

import datetime
import importlib
import itertools
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

MASK_NAMES = (
    "full", "causal", "varlen_full", "varlen_causal", "swa_causal_w1024", "swa_causal_w2048", "swa_causal_w4096",
    "varlen_block_causal", "random",
)  # fmt: skip


@dataclass(frozen=True)
class BenchMask:
    """One mask: slices (CPU int32 tensors), a Flex ``mask_mod`` (None = no mask), exact visible area."""

    name: str
    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    attn_type_map: torch.Tensor
    mask_mod: Callable | None
    area: int
    cudnn_causal: bool | None  # SDPA expresses it as (is_causal), or None if SDPA cannot


def varlen_docs(total: int, seed: int = 0, floor: int = 128) -> list[list[int]]:
    """``[start, end)`` of packed documents with long-tailed lengths: log-normal around ``total / 16`` (sigma
    1), each in [``floor``, ``total / 4``], the last one cut at ``total``; seeded. The default floor is
    ``magi_solver.long_tailed_cu_seqlens`` (the documents of the runtime benchmarks); the kernel masks (floor
    16) and ``cp_bench`` (floor ``total / 512``) keep the floor their committed measurements were made with
    (the shipped kernel table's features are computed from the kernel masks' documents)."""
    if floor == 128:
        from magi_solver import long_tailed_cu_seqlens

        return [list(doc) for doc in itertools.pairwise(long_tailed_cu_seqlens(total, seed))]
    from magi_solver import lognormal_doc_lengths

    lengths = lognormal_doc_lengths(total, median=max(total / 16, 1.0), sigma=1.0, seed=seed, floor=floor, cap=max(1, total // 4))  # fmt: skip
    return [list(doc) for doc in itertools.pairwise([0, *itertools.accumulate(lengths)])]


CROSS_KV_RATIO = 4
"""cross_varlen: each query document (video) attends its own key document (text), CROSS_KV_RATIO x shorter."""
FRAME_TOKENS = 1560
"""video_block_causal: tokens of one frame (frames do not line up with chunks)."""
CLIP_FRAMES = 16
"""video_block_causal: frames per clip (the clip length grows with nothing; the last clip takes the rest)."""

SCALING_MASKS = (
    "full", "causal", "varlen_full", "varlen_causal", "video_block_causal", "cross_varlen",
    "docs4k_causal", "docs4k_full", "short_docs_causal", "docs4k_window2048", "video_clips",
)  # fmt: skip
"""`make_mask`'s names: the runtime benchmarks' masks. The first six scale their documents with the total
(``varlen_*``: log-normal around total / 16); the ``magi_solver.FAMILY_MASKS`` families are defined in tokens,
the same documents at every cp size."""


def kv_total(name: str, total: int) -> int:
    """Tokens of the key/value sequence (the query sequence's, except for cross-attention masks)."""
    return total // CROSS_KV_RATIO if name == "cross_varlen" else total


def make_mask(name: str, total: int, seed: int = 0) -> tuple[list, list, list]:
    """``(q_ranges, k_ranges, types)`` of runtime-benchmark mask ``name`` (`SCALING_MASKS`) over ``total``
    query tokens (``kv_total`` keys); types as int codes (0 full, 1 causal, 2 inv-causal, 3 bi-causal).
    ``seed`` draws the documents of the ``magi_solver.FAMILY_MASKS`` families; the other masks keep the
    documents of seed 0 their recorded results were measured on."""
    from magi_solver import FAMILY_MASKS, make_family_mask

    if name in FAMILY_MASKS and name not in ("full", "causal"):
        spec = make_family_mask(name, total, seed)
        q, k = ([list(r) for r in x.to_tuples()] for x in (spec.q_ranges, spec.k_ranges))
        return q, k, [t.code for t in spec.types]
    if name == "video_block_causal":
        # clips of CLIP_FRAMES whole frames (the last clip and frame take the remainder), block-causal by
        # frame: a frame sees every frame of its clip up to itself
        q_ranges, k_ranges = [], []
        for clip in range(0, total, CLIP_FRAMES * FRAME_TOKENS):
            end = min(total, clip + CLIP_FRAMES * FRAME_TOKENS)
            for a in range(clip, end, FRAME_TOKENS):
                q_ranges.append([a, min(end, a + FRAME_TOKENS)])
                k_ranges.append([clip, min(end, a + FRAME_TOKENS)])
        return q_ranges, k_ranges, [0] * len(q_ranges)
    if name == "full":
        return [[0, total]], [[0, total]], [0]
    if name == "causal":
        return [[0, total]], [[0, total]], [1]
    if name not in SCALING_MASKS:
        raise ValueError(f"unknown mask {name!r}; choose from {', '.join(SCALING_MASKS)}")
    docs = varlen_docs(total)  # magi_solver.long_tailed_cu_seqlens's documents
    if name == "cross_varlen":
        # text documents: the video documents' boundaries scaled down, each at least one token
        bounds = sorted({min(total // CROSS_KV_RATIO, -(-s // CROSS_KV_RATIO)) for s, _ in docs})
        bounds.append(total // CROSS_KV_RATIO)
        kdocs = [[a, b] for a, b in itertools.pairwise(bounds) if a < b]
        n = min(len(docs), len(kdocs))
        return docs[:n], kdocs[:n], [0] * n
    return docs, docs, [1 if name == "varlen_causal" else 0] * len(docs)


def _t(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 5)
    return t[:, 0:2].contiguous(), t[:, 2:4].contiguous(), t[:, 4].contiguous()


def mask_area(q_ranges, k_ranges, types) -> int:
    """The area of a mask given as ``[start, end)`` range lists and per-slice types."""
    from magi_solver import SliceList

    return SliceList.from_typed([(*q, *k, t) for q, k, t in zip(q_ranges, k_ranges, types)]).area()


def build_mask(name: str, total: int, device: str = "cuda") -> BenchMask:
    """Build mask ``name`` for ``total`` tokens (Flex mask_mod tensors live on ``device``)."""
    S = total
    docs = varlen_docs(S, floor=16)
    lens = [b - a for a, b in docs]
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    cudnn = None
    if name == "full":
        rows, mod, cudnn = [[0, S, 0, S, 0]], None, False
    elif name == "causal":
        rows, mod, cudnn = [[0, S, 0, S, 1]], (lambda b, h, q, k: q >= k), True
    elif name == "varlen_full":
        rows = [[a, b, a, b, 0] for a, b in docs]
        mod = lambda b, h, q, k: ids[q] == ids[k]  # noqa: E731
    elif name == "varlen_causal":
        rows = [[a, b, a, b, 1] for a, b in docs]
        mod = lambda b, h, q, k: (ids[q] == ids[k]) & (q >= k)  # noqa: E731
    elif name.startswith("swa_causal_w"):
        w = int(name.removeprefix("swa_causal_w"))
        # rows [0, w): causal square; rows [w, S): keys (q - w, q] = a bi-causal band over k [1, S)
        rows = [[0, min(w, S), 0, min(w, S), 1]] + ([[w, S, 1, S, 3]] if S > w else [])
        mod = lambda b, h, q, k, w=w: (q >= k) & (q - k < w)  # noqa: E731
    elif name == "varlen_block_causal":
        B = 2048
        rows = []
        for a, b in docs:
            for blk in range(a // B, (b - 1) // B + 1):
                q0, q1 = max(a, blk * B), min(b, (blk + 1) * B)
                rows.append([q0, q1, a, q1, 0])
        blk_of = torch.arange(S, device=device) // B
        mod = lambda b, h, q, k: (ids[q] == ids[k]) & (blk_of[k] <= blk_of[q])  # noqa: E731
    elif name == "random":
        rows = _random_rows(S, seed=0)
        dense = torch.zeros(S, S, dtype=torch.bool, device=device)
        for qs, qe, ks, ke, t in rows:
            i = torch.arange(qs, qe, device=device)[:, None]
            j = torch.arange(ks, ke, device=device)[None, :]
            m = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=device)
            if t in (1, 3):
                m &= j <= i + (ke - qe)
            if t in (2, 3):
                m &= j >= i + (ks - qs)
            dense[qs:qe, ks:ke] |= m
        mod = lambda b, h, q, k: dense[q, k]  # noqa: E731
    else:
        raise ValueError(f"unknown mask {name!r}; choose from {MASK_NAMES}")
    qr, kr, tm = _t(rows)
    return BenchMask(name, qr, kr, tm, mod, mask_area(qr.tolist(), kr.tolist(), tm.tolist()), cudnn)


def _random_rows(S: int, seed: int) -> list[list[int]]:
    """Random overlapping slices: q and k cut into 16 bands at 128-token granularity, each (q band, k band)
    cell holds a slice with probability 0.3 (random type, sub-range); disjoint areas."""
    rng = random.Random(seed)

    def bands() -> list[tuple[int, int]]:
        pts = sorted({0, S, *(128 * rng.randrange(1, S // 128) for _ in range(15))})
        return list(itertools.pairwise(pts))

    rows = []
    for q0, q1 in bands():
        for k0, k1 in bands():
            if rng.random() < 0.3:
                t = rng.randrange(4)
                if t == 3 and (q1 - q0) > (k1 - k0):
                    t = 1
                rows.append([q0, q1, k0, k1, t])
    rng.shuffle(rows)
    return rows


def flex_setup():
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # one compiled kernel per mask: raise the limits or Flex silently falls back to an eager O(N^2) path
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.recompile_limit = 256
    return torch.compile(flex_attention, dynamic=False), create_block_mask


def kernel_runners(m: BenchMask, S: int, hq: int, hk: int, d: int, kernels: set[str], flex_tools):
    """name -> (fn, inputs needing grad); every input tensor is created here, outside the timing."""
    import magi_ffa
    from magi_attention import vendors

    dev, dt = "cuda", torch.bfloat16
    out = {}
    q = torch.randn(S, hq, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(S, hk, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(S, hk, d, device=dev, dtype=dt, requires_grad=True)

    def add(name: str, make: Callable[[], tuple | None]) -> None:
        """An optional entry, if asked for: one this machine cannot run is reported, not hidden."""
        if name not in kernels:
            return
        try:
            runner = make()
        except Exception as e:
            print(f"# {name} unavailable for {m.name}: {e!r}"[:200])
            return
        if runner is not None:
            out[name] = runner

    def ffa(mod):  # a magi_ffa package's own autograd entry on the whole mask
        return (lambda: mod.flex_flash_attn_func(q, k, v, m.q_ranges, m.k_ranges, m.attn_type_map)[0], (q, k, v))  # fmt: skip

    def ffa_cudnn():
        import magi_ffa_cudnn

        magi_ffa_cudnn.get_mask_plan(q, k, m.q_ranges, m.k_ranges, m.attn_type_map)  # plan outside the timing
        return ffa(magi_ffa_cudnn)

    if "ffa" in kernels:
        out["ffa"] = ffa(magi_ffa)
    add("ffa_fa4", lambda: ffa(importlib.import_module("magi_ffa_fa4")))
    add("ffa_cudnn", ffa_cudnn)
    # cuDNN's own flex_attn_func: the packed problem as one BSHD sample with the mask's global key intervals,
    # or (varlen_* masks) the THD path with one sample per document and local intervals
    add("cudnn_flex", lambda: vendors.cudnn_flex_call(_slice_mask(m, S), q, k, v))
    if m.name in ("varlen_full", "varlen_causal"):
        add("cudnn_varlen", lambda: vendors.cudnn_varlen_call(_slice_mask(m, S), q, k, v))
    if "flex" in kernels:
        # FlexAttention's layout: [1, heads, tokens, head_dim]
        qb, kb, vb = (t.detach().transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))
        gqa = hq != hk
        flex, create_block_mask = flex_tools
        bm = create_block_mask(m.mask_mod, 1, 1, S, S, device=dev) if m.mask_mod is not None else None
        out["flex"] = (lambda: flex(qb, kb, vb, block_mask=bm, enable_gqa=gqa), (qb, kb, vb))
    if m.cudnn_causal is not None:
        for name in ("sdpa_cudnn", "sdpa_flash"):
            add(name, lambda name=name: vendors.sdpa_call(_slice_mask(m, S), q, k, v, name.removeprefix("sdpa_")))  # fmt: skip
    if m.name != "random":  # flash_attn.cute's native calls: full, causal, varlen, sliding window
        add("fa4", lambda: vendors.fa4_call(_slice_mask(m, S), q, k, v))
    for name, backend in CALC_ATTN_RUNNERS.items():
        add(name, lambda backend=backend: calc_attn_runner(m, q, k, v, backend))
    return out


CALC_ATTN_RUNNERS = {"auto": "auto", "calc_fa4": "fa4", "calc_cudnn": "cudnn", "calc_triton": "triton"}
"""Runner name -> ``kernel_backend`` of the runtime's ``calc_attn`` at cp = 1 (the call a user makes)."""


def calc_attn_runner(m: BenchMask, q, k, v, backend: str):
    """The runtime's ``calc_attn`` at cp = 1 with ``kernel_backend=backend`` on the same inputs (its key
    built outside the timing; the backend it resolved and why printed)."""
    from magi_attention import DistAttnConfig, calc_attn, get_kernel_backend, magi_attn_flex_key

    S, hq, d = q.shape
    key = magi_attn_flex_key(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), S, S, hq,
                             k.shape[1], d, None, DistAttnConfig(kernel_backend=backend))  # fmt: skip
    resolved, reason = get_kernel_backend(key)
    print(f"# calc_attn({backend}) on {m.name} {S}: {resolved} ({reason})", flush=True)
    return (lambda: calc_attn(q, k, v, key)[0], (q, k, v))


def _slice_mask(m: BenchMask, total: int):
    """The bench mask as the vendor calls' mask (``magi_attention.vendors``, one definition of each vendor
    call); ``swa_causal_wN`` is also FA4's / Flex's causal window of N keys (itself included)."""
    from magi_attention.vendors import SliceMask

    window = int(m.name.removeprefix("swa_causal_w")) - 1 if m.name.startswith("swa_causal_w") else None
    return SliceMask.of(m.q_ranges.tolist(), m.k_ranges.tolist(), m.attn_type_map.tolist(), total, name=m.name,
                        window=window)  # fmt: skip


def git_sha() -> str:
    """The checkout's short commit (``"unknown"`` outside a git checkout): every result file records it."""
    import subprocess  # (not os.popen: its pipe stays open until collected, a ResourceWarning under pytest)

    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30, check=False).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.strip() or "unknown"


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
"""``--dtype`` names."""


def no_multicast() -> None:
    """NVLink multicast (NVLS) stays off in every multi-GPU run of this project: call before NCCL initialises
    (a variable already set is kept)."""
    for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")


def join_torchrun(cuda: bool) -> torch.device:
    """Join the process group torchrun's environment describes (NCCL on this rank's GPU, else gloo), NVLink
    multicast off; returns this rank's device."""
    no_multicast()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    import torch.distributed as dist

    dist.init_process_group("nccl" if cuda else "gloo")
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def events_loop_ms(fn: Callable[[], object], n: int, warmup: int) -> float:
    """Milliseconds per call of ``n`` calls of ``fn`` back to back (CUDA events), after ``warmup`` calls, a
    device sync and a barrier of the default process group (every rank starts the loop together)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / n


def interleaved(names: list[str], rounds: int, run: Callable[[str, int], object], errors: dict[str, str]) -> dict:  # fmt: skip
    """``{name: [run(name, i) for each round i]}``, every name once per round, each round starting one name
    later (no name is always timed first, or always after the same neighbour); a name whose call raises is
    recorded in ``errors`` (its repr) and left out of the later rounds: reported, not hidden."""
    out: dict[str, list] = {n: [] for n in names}
    for i in range(rounds if names else 0):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            if n in errors:
                continue
            try:
                out[n].append(run(n, i))
            except Exception as e:
                errors[n] = repr(e)[:300]
    return out


def profile_table(fn: Callable[[], object], cuda: bool, sort: str, width: int = 70) -> tuple[str, object]:
    """``(table, fn())``: ``fn`` under torch.profiler (CPU, and CUDA when ``cuda``), its top 25 ops by ``sort``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        out = fn()
    return prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=width), out


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU): host clocks around GPU work need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def times_ms(fn: Callable[[], object], n: int, setup: Callable[[], object] = lambda: None,
             device: torch.device | None = None, *, events: bool = False, warmup: int = 0) -> list[float]:  # fmt: skip
    """Milliseconds of ``n`` calls of ``fn`` after ``warmup`` untimed ones, ``setup()`` (untimed) before each: by
    CUDA events (``events``), else by the host clock, ``device``'s queued work waited for around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(n):
        setup()
        times.append(once_ms(fn, device, events=events)[0])
    return times


def once_ms(fn: Callable[[], object], device: torch.device | None = None, *, events: bool = False) -> tuple[float, object]:  # fmt: skip
    """``(milliseconds, fn())`` of one call: by CUDA events (``events``), else by the host clock, ``device``'s
    queued work waited for before and after."""
    if events:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), out
    if device is not None:
        sync(device)
    t0 = time.perf_counter()
    out = fn()
    if device is not None:
        sync(device)
    return (time.perf_counter() - t0) * 1e3, out


def host_median_ms(fn: Callable[[], object], n: int, setup: Callable[[], object] = lambda: None,
                   device: torch.device | None = None) -> float:  # fmt: skip
    """The median of `times_ms` on the host clock."""
    return statistics.median(times_ms(fn, n, setup, device))


def package_versions(names: Sequence[str]) -> dict[str, str]:
    """The installed version of each distribution of ``names`` (one not installed is left out)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def environment() -> dict:
    """The header of a kernel result file: date, GPU, torch, triton, commit and the vendor packages' versions."""
    import triton

    versions = [f"{n} {v}" for n, v in package_versions(("nvidia-cudnn-frontend", "flash-attn-4", "nvidia-cutlass-dsl")).items()]  # fmt: skip
    return dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name() if torch.cuda.is_available()
                else "none", torch=torch.__version__, triton=triton.__version__, git=git_sha(), versions=", ".join(versions))  # fmt: skip


def rank_kernel_calls(rank_plan, overlap_degree: int, k, v, rk, rv) -> list:
    """One rank's kernel calls ``(slices, k, v)`` as the runtime makes them (``simulate.call_slices``: at overlap
    degree 0 one merged call, else the host call and one per remote stage; slices checked once, as the runtime
    does), calls without slices left out. ``k`` / ``v``: the rank's shard; ``rk`` / ``rv``: one buffer for every
    rank whose leading rows stand in for the received keys (at degree 0 the merged call's own and received)."""
    from magi_attention.simulate import call_slices, checked_slices, kernel_ranges

    if overlap_degree == 0:
        n = k.shape[0] + rank_plan.num_remote_tokens
        keys = [(rk[:n], rv[:n])]
    else:
        keys = [(k, v)] + [(rk[: s.num_remote_tokens], rv[: s.num_remote_tokens]) for s in rank_plan.stages]
    slices = call_slices(rank_plan, merged=overlap_degree == 0)
    return [(checked_slices(*kernel_ranges(sl)), kk, vv) for sl, (kk, vv) in zip(slices, keys, strict=True) if len(sl.types)]  # fmt: skip


def time_fwd_bwd(fn: Callable, xs, g, warmup: int, rep: int) -> tuple[float, float]:
    """(forward ms, backward ms) of ``fn``: ``triton.testing.do_bench`` medians of the forward and of forward +
    backward (gradient ``g`` into ``xs``); backward = (forward + backward) - forward."""
    from triton.testing import do_bench

    tf = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    tfb = do_bench(lambda: torch.autograd.grad(fn(), xs, g), warmup=warmup, rep=rep, return_mode="median")
    return tf, tfb - tf
