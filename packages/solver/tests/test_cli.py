"""`magi-attention-plan`: runs without torch (in a subprocess), JSON records agree with the planner, plots,
input formats and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from magi_solver import PlanOptions, make_varlen_causal_mask, plan_attention
from magi_solver.cli import main
from magi_solver.tools.hardware import HARDWARE, MaskFamily, get_hardware
from magi_solver.tools.predict import Workload, predict_cp

SMALL = ["--mask", "varlen-causal", "--total", "32768", "--num-docs", "12", "--chunk-size", "512"]


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict]:
    assert main([*argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_subprocess_runs_without_torch(tmp_path: Path) -> None:
    """The CLI in a fresh interpreter: JSON on stdout, and neither torch nor matplotlib imported."""
    code = (
        "import sys, json\n"
        "from magi_solver.cli import main\n"
        f"rc = main({[*SMALL, '--cp', '2,4', '--json']!r})\n"
        "bad = sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules)\n"
        "sys.exit(rc or (3 if bad else 0))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    recs = json.loads(r.stdout)
    assert [x["cp"] for x in recs] == [2, 4]
    assert "planned 2 cp size(s)" in r.stderr  # the closing summary


def test_console_script_installed() -> None:
    exe = Path(sys.executable).with_name("magi-attention-plan")
    if not exe.exists():
        pytest.skip("magi-solver not installed with its console script in this environment")
    r = subprocess.run([str(exe), *SMALL, "--cp", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cp 2:" in r.stdout and "magi" in r.stdout and "ring (zigzag)" in r.stdout


def test_json_records_match_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    recs = _run_json(capsys, *SMALL, "--cp", "2,4,8", "--heads", "8:2", "--head-dim", "64")
    for rec in recs:
        areas = rec["rank_areas"]
        assert rec["imbalance"] == pytest.approx(max(areas) / (sum(areas) / len(areas)))
        assert rec["imbalance"] >= rec["lower_bound_imbalance"] - 1e-12
        assert rec["remote_kv_bytes_max"] == rec["remote_kv_tokens_max"] * 2 * 2 * 64 * 2
        assert set(rec["schemes"]) == {"magi", "ring", "all_gather", "ulysses"}
        assert sum(areas) == rec["mask_area"]
        # ring and all-gather move every other shard; magi moves at most that
        assert rec["ring_kv_tokens_per_rank"] == rec["padded_seqlen"] - rec["tokens_per_rank"]
        assert rec["remote_kv_tokens_max"] <= rec["ring_kv_tokens_per_rank"]
    # Ulysses needs heads divisible by cp: 8:2 heads run at cp 2 but not at 4
    assert "skipped" not in recs[0]["schemes"]["ulysses"]
    assert "skipped" in recs[1]["schemes"]["ulysses"]


def test_remote_tokens_equal_the_plan() -> None:
    from magi_solver.cli import lognormal_doc_lens

    lens = lognormal_doc_lens(32768, 12, 0)
    cu = [0, *np.cumsum(lens).tolist()]
    q, k, t = make_varlen_causal_mask(cu)
    rec, _ = predict_cp(q, k, t, 32768, 4, hardware=get_hardware("h200"), workload=Workload(chunk_size=512))
    ref = plan_attention(q, k, t, 32768, 4, chunk_size=512, options=PlanOptions(overlap_degree=0))
    assert rec["remote_kv_tokens_max"] == max(ref.remote_tokens_per_rank)
    assert rec["imbalance"] == pytest.approx(ref.imbalance)


def test_magi_time_is_the_runtime_cost_model() -> None:
    """On one node the prediction is the planner's own `degree_costs` (the dynamic overlap's cost model)."""
    full = [[0, 65536]]
    hw = get_hardware("h200")
    rec, plan = predict_cp(full, full, "full", 65536, 4, hardware=hw, family="full")
    magi = rec["schemes"]["magi"]
    assert (magi["fwd_ms"] + magi["bwd_ms"]) / 1e3 == pytest.approx(plan.degree_costs[plan.overlap_degree])


def test_internode_links_slow_the_baselines_down() -> None:
    full = [[0, 1 << 17]]
    hw = get_hardware("h200").with_overrides(internode_gbps=2.0)
    small = hw.with_overrides(gpus_per_node=16)
    a, _ = predict_cp(full, full, "causal", 1 << 17, 16, hardware=hw, family="causal")
    b, _ = predict_cp(full, full, "causal", 1 << 17, 16, hardware=small, family="causal")
    assert a["schemes"]["ring"]["fwd_ms"] > b["schemes"]["ring"]["fwd_ms"]
    assert a["schemes"]["magi"]["fwd_ms"] > b["schemes"]["magi"]["fwd_ms"]


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_profiles(name: str) -> None:
    hw = get_hardware(name)
    assert hw.estimate == (name != "h200")
    for fam in MaskFamily:
        fwd, bwd = hw.tflops(fam)
        assert fwd > 0 and bwd > 0
        assert hw.cost_profile(fam).fwd_tflops == fwd


@pytest.mark.parametrize(
    "mask_args",
    [
        pytest.param(["--mask", "full", "--total", "16384"], id="full"),
        pytest.param(["--mask", "causal", "--cu-seqlens", "0,4096,6000,16384"], id="causal-cu"),
        pytest.param(["--mask", "sliding-window", "--doc-lens", "8192,8192", "--window", "1024,0"], id="swa"),
        pytest.param(["--mask", "global-window", "--total", "16384", "--window", "512,0"], id="global"),
        pytest.param(["--mask", "block-causal", "--total", "16384", "--block-size", "1024"], id="block"),
        pytest.param(["--mask", "prefix-lm", "--doc-lens", "8192,8192", "--prefix-len", "512"], id="prefix"),
        pytest.param(["--mask", "docs4k_causal", "--total", "32768"], id="docs4k_causal"),
        pytest.param(["--mask", "short_docs_causal", "--total", "16384", "--seed", "2"], id="short_docs"),
        pytest.param(["--mask", "docs4k_window2048", "--total", "32768"], id="docs4k_window"),
        pytest.param(["--mask", "video_clips", "--total", "32768"], id="video_clips"),
    ],
)
def test_every_builder(capsys: pytest.CaptureFixture[str], mask_args: list[str]) -> None:
    (rec,) = _run_json(capsys, *mask_args, "--cp", "4", "--chunk-size", "512")
    assert rec["cp"] == 4 and rec["mask_area"] > 0


def test_doc_lens_file_and_slices_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "lens.txt"
    f.write_text("4096\n4096\n8192\n")
    (a,) = _run_json(
        capsys, "--mask", "causal", "--doc-lens-file", str(f), "--cp", "2", "--chunk-size", "512"
    )
    s1 = tmp_path / "a.json"
    s1.write_text(json.dumps({"q_ranges": [[0, 4096], [4096, 8192], [8192, 16384]],
                              "k_ranges": [[0, 4096], [4096, 8192], [8192, 16384]], "types": "causal"}))  # fmt: skip
    s2 = tmp_path / "b.json"
    s2.write_text(json.dumps({"slices": [[0, 4096, 0, 4096, 1], [4096, 8192, 4096, 8192, "causal"],
                                         [8192, 16384, 8192, 16384, "CAUSAL"]], "total_seqlen": 16384}))  # fmt: skip
    (b,) = _run_json(
        capsys, "--slices", str(s1), "--cp", "2", "--chunk-size", "512", "--family", "varlen_causal"
    )
    (c,) = _run_json(
        capsys, "--slices", str(s2), "--cp", "2", "--chunk-size", "512", "--family", "varlen_causal"
    )
    for key in ("mask_area", "imbalance", "remote_kv_tokens_max"):
        assert a[key] == b[key] == c[key]


def test_padding_to_chunk_times_cp(capsys: pytest.CaptureFixture[str]) -> None:
    (rec,) = _run_json(capsys, "--mask", "causal", "--total", "10000", "--cp", "4", "--chunk-size", "512")
    assert rec["padded_seqlen"] == 10240 and rec["total_seqlen"] == 10000


def test_uneven_shard_needs_no_padding(capsys: pytest.CaptureFixture[str]) -> None:
    """--uneven-shard plans magi on the unpadded sequence; the baselines keep their padded pricing."""
    argv = ["--mask", "causal", "--total", "10000", "--cp", "3", "--chunk-size", "512"]
    (padded,) = _run_json(capsys, *argv)
    (uneven,) = _run_json(capsys, *argv, "--uneven-shard")
    assert (padded["padded_seqlen"], padded["uneven_shard"]) == (10752, False)
    assert (uneven["padded_seqlen"], uneven["uneven_shard"]) == (10752, True)  # the baselines' length
    assert uneven["tokens_per_rank"] <= padded["tokens_per_rank"]
    for key in ("ring_kv_tokens_per_rank", "all_gather_kv_tokens_per_rank"):
        assert uneven[key] == padded[key] == 10752 - 10752 // 3
    assert uneven["remote_kv_tokens_max"] <= uneven["ring_kv_tokens_per_rank"]
    assert uneven["mask_area"] == padded["mask_area"] == sum(uneven["rank_areas"])
    for name in ("ring", "all_gather", "ulysses"):
        assert uneven["schemes"][name] == padded["schemes"][name]
    full = [[0, 10000]]
    rec, plan = predict_cp(
        full,
        full,
        "causal",
        10000,
        3,
        hardware=get_hardware("h200"),
        workload=Workload(chunk_size=512, uneven_shard=True),
    )
    shards = plan.dispatch.shard_seqlens
    assert sum(shards) == 10000 and rec["tokens_per_rank"] == max(shards)
    assert main([*argv, "--uneven-shard", "--quiet"]) == 0
    assert "up to" in capsys.readouterr().out
    with pytest.raises(TypeError, match="uneven_shard"):
        Workload(uneven_shard=1)


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["--cp", "0"], "--cp sizes must be >= 1", id="cp0"),
        pytest.param(["--heads", "64"], "--heads must be Q:KV", id="heads"),
        pytest.param(["--cu-seqlens", "0,10", "--doc-lens", "10"], "at most one of", id="two-doc-sources"),
        pytest.param(["--cu-seqlens", "5,10"], "must start at 0", id="cu"),
        pytest.param(["--degree", "many"], "--degree must be", id="degree"),
        pytest.param(["--slices", "/nonexistent.json"], "cannot read --slices", id="slices"),
        pytest.param(
            ["--mask", "docs4k_full", "--doc-lens", "10"], "draws its own documents", id="family-docs"
        ),
    ],
)
def test_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main([*argv, "--total", "4096", "--chunk-size", "512", "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if not installed\n"
        "from magi_solver.cli import main\n"
        f"sys.exit(main({[*SMALL, '--cp', '2', '--plot', str(tmp_path)]!r}))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "python scripts/install.py plot" in r.stderr


def test_plot_writes_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert main([*SMALL, "--cp", "2,4", "--plot", str(tmp_path), "--quiet"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == [
        "comm_matrix_cp2.png", "comm_matrix_cp4.png", "dispatch_cp2.png", "dispatch_cp4.png", "mask.png",
        "rank_areas_cp2.png", "rank_areas_cp4.png", "scaling.png",
    ]  # fmt: skip
    assert all(p.stat().st_size < 200_000 for p in tmp_path.glob("*.png"))
    for png in tmp_path.glob("*.png"):  # readable: 150 dpi, 1000 px or more on the long side
        width, height, dpi = _png_size(png)
        assert max(width, height) >= 1000 and round(dpi) >= 150, (png.name, width, height, dpi)


def _png_size(path: Path) -> tuple[int, int, float]:
    """(width, height, dots per inch) from a PNG's IHDR and pHYs chunks."""
    import struct

    data = path.read_bytes()
    width, height = struct.unpack(">II", data[16:24])
    i = data.index(b"pHYs")
    ppm = struct.unpack(">I", data[i + 4 : i + 8])[0]  # pixels per metre (unit byte 1)
    return width, height, ppm * 0.0254


def test_scaling_curve_gets_three_cp_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--plot with one cp size: scaling.png is still a curve (the default sizes that fit the mask added)."""
    pytest.importorskip("matplotlib")
    assert main([*SMALL, "--cp", "4", "--plot", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    # 32768 tokens in chunks of 512 = 64 chunks: the defaults 8, 16 and 64 all fit; two are added
    assert "scaling.png over cp 4, 8, 16 (cp 8, 16 added for the curve)" in " ".join(err.split())
    assert sorted(p.name for p in tmp_path.glob("dispatch_*.png")) == ["dispatch_cp4.png"]


def test_scaling_cps() -> None:
    from magi_solver.cli import scaling_cps

    assert scaling_cps([2, 4, 8], 1 << 20, 2048, [8, 16, 64]) == [2, 4, 8]  # three given: kept
    assert scaling_cps([16], 1 << 20, 2048, [8, 16, 64]) == [8, 16, 64]
    assert scaling_cps([2], 8192, 2048, [8, 16, 64]) == [2, 4]  # 4 chunks: no default fits, powers of two
    assert scaling_cps([3], 1 << 16, 2048, [8, 16, 64]) == [3, 8, 16]


# cp 8 and 64 at 256k tokens (H200 profile): the widest cells the CLI prints (MiB, five-digit token counts)
NARROW = ["--mask", "varlen-causal", "--total", "262144", "--num-docs", "60", "--cp", "8,64", "--quiet"]


@pytest.mark.parametrize("columns", [80, 100, 60])
def test_table_fits_the_terminal(
    columns: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At COLUMNS=80 (and narrower or wider) no line is longer than the terminal, no cell is cut (`…`), and
    every number of the JSON records appears whole in the text."""
    monkeypatch.setenv("COLUMNS", str(columns))
    recs = _run_json(capsys, *NARROW)
    assert main(NARROW) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= columns, max(lines, key=len)
    assert "…" not in text
    cells = {c.strip() for line in lines for c in line.split("│")}
    for rec in recs:
        magi = rec["schemes"]["magi"]
        for name, s in rec["schemes"].items():
            if "skipped" in s:
                continue
            want = [f"{s['fwd_ms']:.2f}", f"{s['bwd_ms']:.2f}", f"{s['imbalance']:.3f}",
                    f"{s['fwd_tflops_per_gpu']:.0f}", f"{s['bwd_tflops_per_gpu']:.0f}"]  # fmt: skip
            if name != "magi":
                want.append(f"{(s['fwd_ms'] + s['bwd_ms']) / (magi['fwd_ms'] + magi['bwd_ms']):.2f}x")
            missing = [w for w in want if w not in cells]
            assert not missing, (rec["cp"], name, missing)


def test_wide_keeps_one_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--wide: one table per cp size with every column whole, wider than COLUMNS."""
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*SMALL, "--cp", "2", "--quiet", "--wide"]) == 0
    out = capsys.readouterr().out
    assert out.count("┃ scheme") == 1 and "vs magi" in out and "fwd ms" in out and "…" not in out
    assert max(len(line) for line in out.splitlines()) > 80


def test_auto_kernel_pick_per_cp_size(capsys: pytest.CaptureFixture[str]) -> None:
    """The kernel `auto` would pick: from the hardware's measured table when it has one, else the rule."""
    docs = ["--mask", "varlen-causal", "--total", "32768", "--chunk-size", "1024", "--cp", "1,8"]
    recs = _run_json(capsys, *docs)
    # one backend, or "forward/backward" where the table measured a clearly faster backward elsewhere
    picks = ("fa4", "cudnn", "fa4/cudnn", "cudnn/fa4")
    assert all(r["kernel_auto"] in picks and "h200 table" in r["kernel_auto_reason"] for r in recs)
    # one rank's whole packed sequence is a set of documents: FA4's varlen kernels win the measured rows
    assert recs[0]["kernel_auto"] == "fa4" and "documents" in recs[0]["kernel_auto_reason"]
    recs = _run_json(capsys, *docs, "--hardware", "b200")
    assert all(r["kernel_auto"] is None and "capability rule" in r["kernel_auto_reason"] for r in recs)
    assert main([*docs, "--quiet"]) == 0
    assert "kernel_backend='auto' on h200, head_dim 128: cp 1: fa4, cp 8:" in capsys.readouterr().out


def test_json_records_the_keys_that_cross_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    """Past one node (8 GPUs) the busiest rank's keys from other nodes: part of its remote K/V; none inside."""
    recs = _run_json(capsys, *SMALL, "--cp", "8,16")
    one_node, two_nodes = recs
    assert one_node["remote_kv_internode_tokens_max"] == 0
    assert 0 < two_nodes["remote_kv_internode_tokens_max"] <= two_nodes["remote_kv_tokens_max"]


def test_mask_family_is_the_builders_mask(capsys: pytest.CaptureFixture[str]) -> None:
    """`--mask docs4k_full --total N --seed S` plans `make_family_mask("docs4k_full", N, S)`."""
    from magi_solver import family_doc_lengths

    (rec,) = _run_json(capsys, "--mask", "docs4k_full", "--total", "40000", "--seed", "3", "--cp", "2")
    lens = family_doc_lengths("docs4k_full", 40000, 3)
    assert len(lens) > 2 and rec["mask_area"] == sum(n * n for n in lens)
