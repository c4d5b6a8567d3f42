"""The report as text: every line at most ``WIDTH`` (80) columns, except a path or value longer than that,
which stands whole on a line of its own so that it can be copied."""

from __future__ import annotations

__all__ = ["WIDTH", "render"]

WIDTH = 80


def _fit(line: str) -> str:
    """``line`` cut to the width with "...", unless it is one word (a path or value put on its own line
    by ``_wrap``: kept whole so that it can be copied)."""
    if len(line) <= WIDTH or " " not in line.strip():
        return line
    return line[: WIDTH - 3] + "..."


def _wrap(label: str, text: str, indent: int = 2) -> list[str]:
    """``label`` then the words of ``text`` filled to the width, continuation lines indented by four more.
    A word never splits: one too long for a continuation line (a cache path, a long value) goes on a line of
    its own, whole and unindented, so it can be copied as it is."""
    first, cont = " " * indent + label, " " * (indent + 4)
    lines: list[str] = []
    cur, fresh = first, True
    for word in text.split():
        joined = cur + ("" if fresh else " ") + word
        if len(joined) <= WIDTH:
            cur, fresh = joined, False
            continue
        if cur.strip():  # the line so far (with the label) is done
            lines.append(cur)
        if len(cont + word) <= WIDTH:
            cur, fresh = cont + word, False
        else:
            lines.append(word)
            cur, fresh = cont, True
    if cur.strip():
        lines.append(cur)
    return lines or [first]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def render(report: dict) -> str:
    """The report as text, every line at most 80 columns."""
    lines = ["magi-attention info", ""]
    lines.append(f"Python {report['python']}  ({report['platform']})")
    cuda = report["torch_cuda"] or "none (CPU build of torch)"
    lines += _wrap("", f"CUDA (torch build): {cuda}; driver: {report['driver'] or 'none'}", 0)
    lines.append("Packages:")
    for dist, ver in report["versions"].items():
        lines.append(f"  {dist:<24}{ver or 'not installed'}")
    lines.append("GPUs:")
    if not report["gpus"]:
        lines.append("  none (no CUDA device visible to torch)")
    for g in report["gpus"]:
        lines.append(_fit(f"  [{g['index']}] {g['name']}, {g['capability']}, {g['memory_gib']} GiB"))
    lines.append("Kernel backends:")
    for name, b in report["backends"].items():
        lines += _wrap(f"{name:<7}", "runs here" if b["runs"] else "no: " + b["why_not"])
    t = report["auto_table"]
    lines.append(f"auto (GPU kind {t['gpu_kind']!r}):")
    if t["path"]:
        lines += _wrap("", f"{t['rows']} measured rows from {t['path']}")
    else:
        lines += _wrap("", t["note"])
    lines.append("Variables in effect:")
    if not report["variables"]:
        lines.append("  none set")
    for k, v in report["variables"].items():
        lines += _wrap("", f"{k}={v}")
    lines.append("Compiled-kernel caches:")
    for c in report["caches"]:
        state = _size(c["bytes"]) if c["enabled"] or c["name"] == "root" else "off"
        lines += _wrap(f"{c['name']:<7}", f"{state}, {c['directory'] or '-'} ({c['how']})")
    if "check" in report:
        lines += ["", *_render_check(report["check"])]
    if "bench" in report:
        lines += ["", *_render_bench(report["bench"])]
    return "\n".join(_fit(x) for x in lines)


def _render_check(check: dict) -> list[str]:
    lines = ["Check against float64 (ratio: error / naive error in the same dtype;",
             "  pass: at most 2x the naive error plus the dtype's rounding):"]  # fmt: skip
    lines.append(f"  {'backend':<8}{'mask':<8}{'tokens':>7}  {'dtype':<9}{'ratio':>7}  {'result':<7}{'s':>6}")
    for r in check["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"  {r['backend']:<8}{r['mask']:<8}{r['tokens']:>7}  {r['dtype']:<9}{ratio:>7}  "
            f"{'pass' if r['passed'] else 'FAIL':<7}{r['seconds']:>6.1f}"
        )
        if not r["passed"]:
            lines += _wrap("", r["error"], 4)
    for b in check["skipped"]:
        lines.append(f"  {b:<8}not checked: it cannot run here (see Kernel backends)")
    lines.append("All checks passed." if check["passed"] else "SOME CHECKS FAILED.")
    return lines


def _render_bench(bench: dict) -> list[str]:
    if bench.get("skipped"):
        return _wrap("Bench: ", "not run: " + bench["skipped"], 0)
    hq, hk, d = bench["heads"]
    lines = [f"TFLOP/s fwd / bwd, bf16, heads {hq}:{hk}, head_dim {d} (x: vs auto)"]
    lines += _wrap("", "auto and each backend: calc_attn at cp 1 (pick: the backends it ran, forward / "
                   "backward); kernel API: the backend's flex_flash_attn_func; the rest: the vendors' "
                   "own calls.", 0)  # fmt: skip
    lines.append(
        f"  {'mask':<7}{'tokens':>6}  {'runner':<17}{'fwd':>6}{'bwd':>6}{'fwd x':>6}{'bwd x':>6}  pick"
    )
    for row in bench["rows"]:
        auto = row["cells"].get("auto")
        order = ["auto"] + [n for n in row["cells"] if n != "auto"] if auto else list(row["cells"])
        for i, name in enumerate(order):
            c = row["cells"][name]
            fx = f"{c['fwd_tflops'] / auto['fwd_tflops']:.2f}" if auto else "-"
            bx = f"{c['bwd_tflops'] / auto['bwd_tflops']:.2f}" if auto else "-"
            pick = "/".join(c.get("pick", []))
            head = f"{row['mask']:<7}{row['tokens'] // 1024:>5}k" if i == 0 else " " * 13
            lines.append(
                f"  {head}  {name:<17}{c['fwd_tflops']:>6.0f}{c['bwd_tflops']:>6.0f}{fx:>6}{bx:>6}  {pick}"
            )
    for name, why in bench.get("unavailable", {}).items():
        lines += _wrap(f"{name}: ", why)
    return lines
