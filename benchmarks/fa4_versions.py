"""Two flash-attn-4 releases side by side, from interleaved ``kernel_backends_bench`` processes.
What it measures and how to run it: docs/benchmarks/cases.md (fa4-versions)."""

import json
import re
import statistics
from pathlib import Path

from benchmarks.cli import run_module, write_results


def collect(folder: Path, release: str) -> tuple[dict[tuple, list[tuple[float, float]]], str]:
    """Per (kernel, mask, S, heads, d): the (fwd_ms, bwd_ms) of each round of ``release``, and the versions
    line the runs recorded (that of the first round)."""
    cells: dict[tuple, list[tuple[float, float]]] = {}
    versions = ""
    for path in sorted(folder.glob(f"{release}_r*.json")):
        if not re.fullmatch(rf"{re.escape(release)}_r\d+\.json", path.name):
            continue
        data = json.loads(path.read_text())
        versions = versions or data.get("env", {}).get("versions", "")
        for r in data.get("rows", []):
            if "fwd_ms" in r:
                key = (r["kernel"], r["mask"], r["S"], f"{r['hq']}:{r['hk']}", r["d"])
                cells.setdefault(key, []).append((r["fwd_ms"], r["bwd_ms"]))
    return cells, versions


def compare(folder: Path, old: str = "b36", new: str = "b40") -> dict:
    """The table of :mod:`benchmarks.fa4_versions` (module docstring) as rows of plain values."""
    a, va = collect(folder, old)
    b, vb = collect(folder, new)
    if not a or not b:
        raise SystemExit(f"no timed rows for {old if not a else new} in {folder}")
    rows = []
    for key in sorted(a.keys() & b.keys(), key=str):
        (fa, ba), (fb, bb) = (tuple(statistics.median(x[i] for x in v) for i in (0, 1)) for v in (a[key], b[key]))  # fmt: skip
        kernel, mask, size, heads, d = key
        rows.append(dict(kernel=kernel, mask=mask, S=size, heads=heads, d=d, rounds=[len(a[key]), len(b[key])],
                         fwd_ms=[fa, fb], bwd_ms=[ba, bb], fwd_ratio=round(fa / fb, 3), bwd_ratio=round(ba / bb, 3)))  # fmt: skip
    return dict(old=old, new=new, versions={old: va, new: vb}, rows=rows)


def render(table: dict) -> str:
    old, new = table["old"], table["new"]
    lines = [
        f"{old}: {table['versions'][old]}; {new}: {table['versions'][new]}. Medians over interleaved processes "
        f"(rounds {old} / {new}); {new}/{old} = speed ratio (> 1: {new} faster).",
        "",
        f"| kernel | mask | S | heads | d | rounds | fwd ms {old} | fwd ms {new} | fwd {new}/{old} "
        f"| bwd ms {old} | bwd ms {new} | bwd {new}/{old} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table["rows"]:
        lines.append(
            f"| {r['kernel']} | {r['mask']} | {r['S']} | {r['heads']} | {r['d']} | {r['rounds'][0]} / {r['rounds'][1]} "
            f"| {r['fwd_ms'][0]:.3f} | {r['fwd_ms'][1]:.3f} | {r['fwd_ratio']:.3f} "
            f"| {r['bwd_ms'][0]:.3f} | {r['bwd_ms'][1]:.3f} | {r['bwd_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(ap) -> None:
    ap.add_argument("folder", type=Path, help="the folder of <release>_r<round>.json runs (the table goes there)")  # fmt: skip
    ap.add_argument("--old", default="b36", help="the release tag to compare against (default b36)")
    ap.add_argument("--new", default="b40", help="the release tag compared (default b40)")


def main(args) -> None:
    table = compare(args.folder, args.old, args.new)
    text = render(table)
    write_results(args.folder, "fa4_versions", table, text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run_module(__spec__.name))
