"""Install one row of the install table (docs/install.md) into the active Python environment.

    python scripts/install.py ROW [ROW ...] [--wheels DIR] [--editable] [--print] [--any-torch] [-- PIP_ARGS]
    python scripts/install.py --list

Run it from anywhere with the interpreter of the environment you want to install into (an activated
venv's `python`). Our own packages always come from this clone: their folders, or with `--wheels DIR` the
wheel files that `bash scripts/dev.sh wheels` built into DIR (each picked by exact name and version).
They all go to pip in one command, so pip never looks one of our names up on a package index (the name
`magi-attention` there belongs to someone else). Third-party dependencies come from your index as usual.

Torch: a row that needs torch keeps the torch you have (pinned to its installed version). Without torch and
without an NVIDIA GPU the script stops, because pip would take the index's default torch, a CUDA build of
several GB; install the CPU wheel first, or pass --any-torch. With a CPU build of torch it also holds
triton==3.6.0 and numpy<2.4, the versions the CPU tests run (Triton's interpreter, TRITON_INTERPRET=1).

Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the install table: what it is for, and what it installs.

    `parts` are other rows' names (included whole) and project folders relative to the clone, with pip
    extras in brackets (`packages/solver[plot]`). A row whose folder this clone lacks is refused by name.
    """

    what: str
    parts: tuple[str, ...]


RUNTIME = (
    "packages/mask",
    "packages/solver",
    "packages/ffa",
    "packages/group_collective",
    "packages/magi_attention",
)
# The install table, one line a row. docs/install.md shows the same rows (tests/test_install_table.py).
ROWS: dict[str, Row] = {
    "planner": Row("the planner and magi-attention-plan (numpy, rich; no torch)", ("packages/mask", "packages/solver")),
    "plot": Row("the planner with --plot (adds matplotlib; no torch)", ("planner", "packages/solver[plot]")),
    "kernel": Row("the FFA kernel alone: magi_ffa (Triton) and its torch reference", ("packages/mask", "packages/ffa")),
    "runtime": Row("the runtime: magi_attention with the Triton kernel and the group collectives", RUNTIME),
    "fa4": Row("the runtime with the FlashAttention-4 backend (CUDA; Hopper/Blackwell)", ("runtime", "packages/magi_attention[fa4]", "packages/ffa_fa4")),
    "cudnn": Row("the runtime with the cuDNN backend (CUDA)", ("runtime", "packages/magi_attention[cudnn]", "packages/ffa_cudnn")),
    "native": Row("the runtime with native group collectives (cuda-bindings 13)", ("runtime", "packages/group_collective[native]")),
    "transformers": Row("the runtime and the HF Transformers integration", ("runtime", "integrations/transformers")),
    "fsdp": Row("the runtime and the FSDP2 integration", ("runtime", "integrations/fsdp")),
    "megatron": Row("the runtime and the Megatron-core integration", ("runtime", "integrations/megatron")),
    "torchtitan": Row("the runtime and the torchtitan integration", ("runtime", "integrations/torchtitan")),
}  # fmt: skip

# Held when the environment's torch is a CPU build: the versions every CPU test runs (Triton 3.6's
# interpreter breaks runtime-bounded loops with numpy >= 2.4).
CPU_PINS = ("triton==3.6.0", "numpy<2.4")
SPEC = re.compile(r"^(?P<path>[^\[\]]+)(?:\[(?P<extras>[^\]]*)\])?$")


class InstallError(Exception):
    """Printed as `install.py: error: ...`, exit status 2."""


def projects(names: list[str]) -> dict[str, set[str]]:
    """Project folder -> extras, for the given rows (included rows expanded, extras merged)."""
    out: dict[str, set[str]] = {}

    def add(name: str, stack: tuple[str, ...]) -> None:
        if name not in ROWS:
            raise InstallError(f"no row {name!r}; the rows are: {', '.join(ROWS)}")
        if name in stack:
            raise InstallError(f"row {name!r} includes itself through {' -> '.join(stack)}")
        for part in ROWS[name].parts:
            if part in ROWS:
                add(part, (*stack, name))
                continue
            m = SPEC.match(part)
            assert m, f"row {name!r}: bad part {part!r}"
            extras = {e.strip() for e in (m["extras"] or "").split(",") if e.strip()}
            out.setdefault(m["path"], set()).update(extras)

    for name in names:
        add(name, ())
    return out


def _pyproject(folder: str, row_names: list[str]) -> dict:
    path = ROOT / folder / "pyproject.toml"
    if not path.is_file():
        raise InstallError(
            f"{'/'.join(row_names)} needs {folder}/, which this clone does not have (update the clone: git pull)"
        )
    return tomllib.loads(path.read_text())["project"]


def needs_torch(metas: list[dict]) -> bool:
    return any(re.match(r"torch\b", dep) for meta in metas for dep in meta.get("dependencies", ()))


def wheel_of(meta: dict, wheel_dir: Path) -> Path:
    """The wheel of exactly this project and version in `wheel_dir`."""
    stem = f"{re.sub(r'[-_.]+', '_', meta['name']).lower()}-{meta['version']}-"
    found = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if len(found) != 1:
        what = "no wheel" if not found else f"{len(found)} wheels"
        raise InstallError(
            f"{what} of {meta['name']} {meta['version']} in {wheel_dir} (build them: bash scripts/dev.sh wheels)"
        )
    return found[0]


def _release(version: str) -> tuple[int, ...]:
    """'2.11.0+cu130' -> (2, 11, 0): the release numbers, local and pre-release tags dropped."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0].split("rc")[0].split("a")[0])[:3])


def torch_too_old(metas: list[dict], version: str) -> str | None:
    """Why `version` of torch cannot satisfy a project's `torch>=X` (the first such project), or None."""
    for meta in metas:
        for dep in meta.get("dependencies", ()):
            m = re.match(r"torch\s*>=\s*([\d.]+)", dep)
            if m and _release(version) < _release(m.group(1)):
                return f"{meta['name']} needs torch>={m.group(1)}"
    return None


def installed_torch() -> tuple[str, bool] | None:
    """(version, is_cpu_build) of the torch this interpreter imports, or None. The version is the installed
    distribution's (what pip compares a pin with), which an image's own build of torch may give without the
    local part that ``torch.__version__`` shows (``2.11.0`` against ``2.11.0+cu130``)."""
    if importlib.util.find_spec("torch") is None:
        return None
    code = (
        "import importlib.metadata as m, torch; "
        "print(m.version('torch'), torch.version.cuda is None and torch.version.hip is None)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        raise InstallError(f"torch is installed but does not import:\n{r.stderr.strip()}")
    version, cpu = r.stdout.split()
    return version, cpu == "True"


def nvidia_gpu_present() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def pip_command(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(the pip command, notes to print) for the rows asked."""
    wanted = projects(args.rows)
    metas = [_pyproject(folder, args.rows) for folder in wanted]
    notes = [f"{meta['name']} {meta['version']}" for meta in metas]
    targets = []
    for (folder, extras), meta in zip(wanted.items(), metas):
        suffix = f"[{','.join(sorted(extras))}]" if extras else ""
        if args.wheels:
            targets.append(f"{wheel_of(meta, Path(args.wheels))}{suffix}")
        elif args.editable:
            targets += ["-e", f"{ROOT / folder}{suffix}"]
        else:
            targets.append(f"{ROOT / folder}{suffix}")
    cmd = [sys.executable, "-m", "pip", "install"]
    pins: list[str] = []
    if needs_torch(metas):
        torch = installed_torch()
        if torch is None and not (args.any_torch or nvidia_gpu_present()):
            raise InstallError(
                "this row needs torch, which this environment lacks, and there is no NVIDIA GPU: pip would take "
                "the index's default torch, a CUDA build of several GB. Install torch's CPU wheel first:\n"
                "    pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
                "then run this again (or pass --any-torch to take the index's build anyway)."
            )
        if torch is not None:
            version, cpu = torch
            why = torch_too_old(metas, version)
            if why is not None:  # pip would only say that no torch=={version} distribution matches
                raise InstallError(
                    f"{why}, and this environment has torch {version}, which this script keeps (it never "
                    "replaces a user's torch): install a newer torch first, then run this again."
                )
            pins.append(f"torch=={version}")  # never replace the user's torch
            if cpu:
                pins += CPU_PINS
            notes.append(
                f"keeping torch {version}{' (CPU build: holding ' + ', '.join(CPU_PINS) + ')' if cpu else ''}"
            )
    # the pins go in as requirements (an installed torch satisfies its own pin), so that the printed
    # command (--print) is the whole story
    return cmd + targets + pins + args.pip_args, notes


def parse_args(argv: list[str]) -> argparse.Namespace:
    pip_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, pip_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(
        prog="python scripts/install.py",
        usage="python scripts/install.py [options] ROW [ROW ...] [-- PIP_ARGS]",
        description="Install rows of the install table (docs/install.md) into this Python environment. "
        "Arguments after `--` go to pip.",
        epilog="rows:\n" + "\n".join(f"  {name:<13} {row.what}" for name, row in ROWS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("rows", nargs="*", metavar="ROW", help="one or more rows (see below)")
    p.add_argument(
        "--wheels", metavar="DIR", help="install our packages from the wheels in DIR (dev.sh wheels)"
    )
    p.add_argument(
        "-e", "--editable", action="store_true", help="install our packages editable (development)"
    )
    p.add_argument("--print", action="store_true", help="print the pip command instead of running it")
    p.add_argument(
        "--any-torch",
        action="store_true",
        help="without torch and without a GPU, let pip take the index's torch",
    )
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    args = p.parse_args(argv)
    args.pip_args = pip_args
    if args.wheels and args.editable:
        p.error("--wheels and --editable exclude each other")
    if not args.rows and not args.list:
        p.error("name at least one row (--list shows them)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:<13} {row.what}")
        return 0
    try:
        cmd, notes = pip_command(args)
    except InstallError as e:
        print(f"install.py: error: {e}", file=sys.stderr)
        return 2
    if args.print:
        print(shlex.join(cmd))
        return 0
    print(f"installing {' + '.join(args.rows)} into {sys.prefix}: {', '.join(notes)}", flush=True)
    print(f"$ {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    if rc == 0:
        done = "resolved" if "--dry-run" in args.pip_args else "installed"
        print(f"{done} {' + '.join(args.rows)} in {time.perf_counter() - t0:.0f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
