"""Every caller of the one document-length generator (`magi_solver.lognormal_doc_lengths`) draws the documents
it drew before the generator existed.

The expected values below were computed by running the callers' own code at commit 4e4131a (before they were
replaced by calls to the generator), for the seeds and sizes given; the larger cases are compared by the first
16 hex digits of the SHA-256 of their JSON. Do not regenerate them from the current code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16]


# magi_solver.long_tailed_cu_seqlens(total, seed)
LONG_TAILED = {
    (4096, 0): [0, 213, 477, 991, 1223, 2247, 2375, 2710, 2838, 3080, 3271, 3462, 3590, 3868, 4096],
    (4096, 1): [0, 469, 721, 1597, 2303, 2485, 3349, 3477, 3684, 3825, 3953, 4096],
    (100, 0): [0, 100],
    (20000, 7): [
        0,
        875,
        2527,
        3904,
        4172,
        4479,
        5070,
        5614,
        7170,
        10140,
        10765,
        10974,
        11311,
        13138,
        14502,
        14984,
        17130,
        17709,
        18823,
        20000,
    ],
}
LONG_TAILED_DIGEST = {
    (1048576, 0): "329783fb41e8a598",
    (65536, 3): "7aeabc96335c6e88",
}
# magi_solver.cli.lognormal_doc_lens(total, num_docs, seed)
CLI = {
    (1000, 7, 0): [105, 81, 176, 103, 54, 133, 348],
    (4096, 12, 3): [744, 7, 146, 54, 61, 77, 12, 76, 40, 2691, 121, 67],
    (50, 50, 1): [
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        2,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        -4,
        1,
        1,
        5,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
        1,
    ],
}
CLI_DIGEST = {
    (1048576, 300, 0): "4925a3739972a028",
    (32768, 3000, 0): "c70bd1b728c64f5c",
}
# magi_solver.demo.varlen_doc_lengths(total, num_docs, seed, sigma)
SOLVER_DEMO = {
    (1000, 7, 3, 1.0): [677, 6, 132, 49, 55, 70, 11],
    (5000, 9, 2, 1.5): [236, 81, 95, 4, 2648, 989, 109, 567, 271],
}
# benchmarks.common.varlen_docs(total, seed, floor)
COMMON = {
    (4096, 0, 16): [
        [0, 213],
        [213, 477],
        [477, 991],
        [991, 1223],
        [1223, 2247],
        [2247, 2302],
        [2302, 2637],
        [2637, 2713],
        [2713, 2955],
        [2955, 3146],
        [3146, 3337],
        [3337, 3368],
        [3368, 3646],
        [3646, 4096],
    ],
    (4096, 2, 8): [
        [0, 1024],
        [1024, 1413],
        [1413, 1819],
        [1819, 2121],
        [2121, 2331],
        [2331, 3355],
        [3355, 3579],
        [3579, 3813],
        [3813, 3851],
        [3851, 4096],
    ],
    (8, 0, 16): [[0, 8]],
    (3000, 1, 128): [
        [0, 344],
        [344, 528],
        [528, 1170],
        [1170, 1687],
        [1687, 1820],
        [1820, 2453],
        [2453, 2581],
        [2581, 2732],
        [2732, 2860],
        [2860, 2988],
        [2988, 3000],
    ],
}
COMMON_DIGEST = {
    (131072, 0, 16): "81a0f59df04d55dc",
    (262144, 1, 512): "e087e19c1b70f308",
}
# scripts/make_gallery.py bench_varlen_docs(total, seed)
GALLERY = {
    (4096, 0): [
        [0, 213],
        [213, 477],
        [477, 991],
        [991, 1223],
        [1223, 2247],
        [2247, 2302],
        [2302, 2637],
        [2637, 2713],
        [2713, 2955],
        [2955, 3146],
        [3146, 3337],
        [3337, 3368],
        [3368, 3646],
        [3646, 4096],
    ],
    (9000, 5): [
        [0, 1272],
        [1272, 1396],
        [1396, 1920],
        [1920, 2590],
        [2590, 3557],
        [3557, 4573],
        [4573, 5281],
        [5281, 5578],
        [5578, 6271],
        [6271, 7744],
        [7744, 8166],
        [8166, 8404],
        [8404, 8779],
        [8779, 9000],
    ],
}
GALLERY_DIGEST = {
    (1048576, 0): "0169dee6c5d02b1d",
}
# magi_attention.demo.video_batch_mask(total, block, seed)[0] (the query ranges: one per block of a document)
VIDEO = {
    (2048, 128, 0): [
        [0, 128],
        [128, 256],
        [256, 384],
        [384, 512],
        [512, 640],
        [640, 768],
        [768, 896],
        [896, 1024],
        [1024, 1152],
        [1152, 1280],
        [1280, 1408],
        [1408, 1536],
        [1536, 1664],
        [1664, 1792],
        [1792, 1920],
        [1920, 2048],
    ],
    (3000, 128, 1): [
        [0, 128],
        [128, 256],
        [256, 384],
        [384, 512],
        [512, 640],
        [640, 768],
        [768, 896],
        [896, 1024],
        [1024, 1152],
        [1152, 1280],
        [1280, 1408],
        [1408, 1536],
        [1536, 1664],
        [1664, 1792],
        [1792, 1920],
        [1920, 2048],
        [2048, 2176],
        [2176, 2304],
        [2304, 2432],
        [2432, 2560],
        [2560, 2688],
        [2688, 2816],
        [2816, 2944],
        [2944, 3000],
    ],
    (512, 256, 2): [[0, 256], [256, 512]],
}
VIDEO_DIGEST = {
    (65536, 128, 0): "c8e5058b00760898",
}


def test_planner_long_tailed_documents_unchanged() -> None:
    from magi_solver import long_tailed_cu_seqlens

    for (total, seed), cu in LONG_TAILED.items():
        assert long_tailed_cu_seqlens(total, seed) == cu
    for (total, seed), digest in LONG_TAILED_DIGEST.items():
        assert _digest(long_tailed_cu_seqlens(total, seed)) == digest


def test_cli_and_solver_demo_documents_unchanged() -> None:
    from magi_solver.cli import lognormal_doc_lens
    from magi_solver.demo import varlen_doc_lengths

    for (total, num, seed), lens in CLI.items():
        assert lognormal_doc_lens(total, num, seed) == lens
    for (total, num, seed), digest in CLI_DIGEST.items():
        assert _digest(lognormal_doc_lens(total, num, seed)) == digest
    for (total, num, seed, sigma), lens in SOLVER_DEMO.items():
        assert varlen_doc_lengths(total, num, seed, sigma) == lens


def test_benchmark_and_gallery_documents_unchanged() -> None:
    from benchmarks.common import varlen_docs

    for (total, seed, floor), docs in COMMON.items():
        assert varlen_docs(total, seed, floor) == docs
    for (total, seed, floor), digest in COMMON_DIGEST.items():
        assert _digest(varlen_docs(total, seed, floor)) == digest
    spec = importlib.util.spec_from_file_location("_magi_gallery", ROOT / "scripts" / "make_gallery.py")
    gallery = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gallery)
    for (total, seed), docs in GALLERY.items():
        assert gallery.bench_varlen_docs(total, seed) == docs
    for (total, seed), digest in GALLERY_DIGEST.items():
        assert _digest(gallery.bench_varlen_docs(total, seed)) == digest


def test_runtime_demo_documents_unchanged() -> None:
    pytest.importorskip("torch")
    from magi_attention.demo import video_batch_mask

    for (total, block, seed), q_ranges in VIDEO.items():
        assert video_batch_mask(total, block, seed)[0] == q_ranges
    for (total, block, seed), digest in VIDEO_DIGEST.items():
        assert _digest(video_batch_mask(total, block, seed)[0]) == digest


def test_one_lognormal_call_site() -> None:
    """One place draws log-normal document lengths in the packages, benchmarks and scripts (tests aside)."""
    import re

    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("packages", "benchmarks", "scripts")
        for p in (ROOT / d).rglob("*.py")
        if "tests" not in p.relative_to(ROOT).parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"lognormvariate|\.lognormal\(", line)
    ]
    assert len(hits) == 1 and hits[0].startswith("packages/solver/src/magi_solver/builders.py:"), hits
