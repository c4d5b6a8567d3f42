"""Every install command that the docs and READMEs show, run the way a user runs it (the `install-commands`
job of `.ci/run`; stdlib only).

An install command is a line of a fenced shell block (bash, sh, shell, console) in `docs/**/*.md` or any
`README*.md` that starts with `pip install`, `python -m pip install` or `python scripts/install.py`. Every
command runs from the root of a copy of the clone. An HTML comment right before the block (invisible in the
rendered page) changes what CI does with the block's commands:

* none: run. In a fresh venv: `pip install --dry-run --report` first, which must resolve no CUDA wheel
  (`nvidia-*`, `cuda-toolkit`, a torch build other than the CPU one), then the command itself, then a smoke
  check: every first-party module installed imports, every first-party console script answers `--help`,
  `pip check` passes, and a command that needs no torch leaves no torch behind. A venv starts empty; it
  starts with the CPU torch (a copy of the torch-base job's venv) when the command needs torch, as
  docs/install.md tells a user without a GPU to install it first.
* `<!-- install: resolve -->`: CUDA-only dependencies (flash-attn-4, the CUTLASS DSL, cuDNN's frontend):
  only `pip install --dry-run --report`, in a venv with the CPU torch; it must resolve.
* `<!-- install: network -->`: needs a network CI lacks (another package index): listed, not run.

    python scripts/ci/install_commands.py list
    python scripts/ci/install_commands.py run --wheels DIR --torch-base VENV --work DIR [--jobs N] [--only TEXT]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("run", "resolve", "network")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*install:\s*([\w-]+)\s*-->\s*$")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
# CPU CI must never download these: the CUDA stack a torch CUDA build pulls
CUDA_NAME = re.compile(r"^(nvidia-.*|cuda-toolkit)$")


@dataclass(frozen=True, slots=True)
class InstallCommand:
    """One documented install command: where it is written, the command and what CI does with it."""

    where: str
    command: str
    mode: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command, comments=True)

    @property
    def is_install_script(self) -> bool:
        return _script_index(self.argv) is not None


def _script_index(argv: list[str]) -> int | None:
    """Index of `scripts/install.py` in `python scripts/install.py ...`, or None."""
    if len(argv) >= 2 and re.fullmatch(r"python3?", argv[0]) and argv[1].endswith("scripts/install.py"):
        return 1
    return None


def is_install_command(line: str) -> bool:
    try:
        argv = shlex.split(line, comments=True)
    except ValueError:
        return False
    if argv[:2] == ["pip", "install"] or argv[:2] == ["pip3", "install"]:
        return True
    if len(argv) >= 4 and re.fullmatch(r"python3?", argv[0]) and argv[1:4] == ["-m", "pip", "install"]:
        return True
    return _script_index(argv) is not None


def commands_in(text: str, where: str) -> list[InstallCommand]:
    """The install commands of one Markdown text (`where` names it in messages)."""
    out: list[InstallCommand] = []
    lines = text.splitlines()
    mode, marker_line, fence, lang, pending = "run", None, None, "", ""
    for n, line in enumerate(lines, 1):
        if fence is None:
            m = MARKER.match(line)
            if m:
                if m[1] not in MODES[1:]:
                    raise ValueError(f"{where}:{n}: unknown install marker {m[1]!r} (known: {MODES[1:]})")
                mode, marker_line = m[1], n
                continue
            f = FENCE.match(line)
            if f:
                fence, lang = f[2], f[3].lower()
                continue
            if marker_line is not None and line.strip():
                raise ValueError(
                    f"{where}:{marker_line}: an install marker must stand right before a fenced block"
                )
            continue
        if line.strip().startswith(fence[0] * 3) and line.strip().strip(fence[0]) == "":
            fence, mode, marker_line, pending = None, "run", None, ""
            continue
        if lang not in SHELL_LANGS:
            continue
        text_line = pending + line.strip()
        if text_line.endswith("\\"):
            pending = text_line[:-1].rstrip() + " "
            continue
        pending = ""
        if text_line.startswith("$ "):
            text_line = text_line[2:]
        if is_install_command(text_line):
            out.append(InstallCommand(f"{where}:{n}", text_line, mode))
    return out


def doc_files(root: Path) -> list[Path]:
    """docs/**/*.md and every README*.md that git tracks or would track (untracked, not ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "--", "*.md"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        paths = [root / p for p in listed]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every Markdown file
        paths = [
            p for p in root.rglob("*.md") if not {".venv", ".venv-integrations", "out", "site"} & set(p.parts)
        ]
    keep = [
        p
        for p in paths
        if p.is_file() and (p.name.startswith("README") or "docs" in p.relative_to(root).parts[:1])
    ]
    return sorted(set(keep))


def find_commands(root: Path = ROOT) -> list[InstallCommand]:
    out = []
    for path in doc_files(root):
        out += commands_in(path.read_text(), str(path.relative_to(root)))
    return out


# --------------------------------------------------------------------------------------------- running
def _load_install_script(root: Path):
    spec = importlib.util.spec_from_file_location("_magi_install", root / "scripts" / "install.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


def _shell_join(argv: list[str]) -> str:
    """argv back into one shell line: quoted, except that `*` and `?` stay globs (`dist/magi_ffa-*.whl`)."""
    return " ".join(a if re.fullmatch(r"[\w@%+=:,./*?-]+", a) else shlex.quote(a) for a in argv)


@dataclass(slots=True)
class Result:
    cmd: InstallCommand
    others: list[str] = field(default_factory=list)  # the same command written elsewhere
    ok: bool = False
    what: str = ""
    seconds: float | None = None
    venv_mb: float | None = None
    torch: bool = False
    log: list[str] = field(default_factory=list)


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.work = Path(args.work).resolve()
        self.wheels = Path(args.wheels).resolve()
        self.torch_base = Path(args.torch_base).resolve()
        self.python = args.python
        self.clone = self.work / "clone"
        self.first_party = self._first_party()

    def _first_party(self) -> dict[str, list[str]]:
        """distribution name -> import names, for every project of the clone."""
        out = {}
        for proj in sorted(
            [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("integrations/*/pyproject.toml")]
        ):
            name = tomllib.loads(proj.read_text())["project"]["name"]
            out[name] = sorted(p.parent.name for p in proj.parent.glob("src/*/__init__.py"))
        return out

    def prepare(self) -> None:
        """A copy of the working tree (what git tracks or would track), with dist/ = the CI wheels (as after
        `bash scripts/dev.sh wheels`), and an empty venv with a current pip to copy."""
        shutil.rmtree(self.work, ignore_errors=True)
        self.clone.mkdir(parents=True)
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.split(b"\0")
        for rel in filter(None, files):
            src, dst = ROOT / rel.decode(), self.clone / rel.decode()
            if src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        (self.clone / "dist").mkdir()
        for whl in self.wheels.glob("*.whl"):
            shutil.copy2(whl, self.clone / "dist" / whl.name)
        # The dry runs build our packages' metadata with this hatchling (on PYTHONPATH, --no-build-isolation)
        # instead of a fresh isolated build env per package: same metadata, half the index round trips.
        # The commands themselves run as written.
        subprocess.run(
            [self.python, "-m", "pip", "install", "-q", "--target", str(self.work / "hatchling"), "hatchling"],
            check=True,
        )  # fmt: skip
        bare = self.work / "bare"
        subprocess.run([self.python, "-m", "venv", str(bare)], check=True)
        # the bundled pip 23.2 mishandles `file.whl[extra]`
        subprocess.run(
            [str(bare / "bin/python"), "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True
        )

    def new_venv(self, path: Path, torch: bool) -> None:
        base = self.torch_base if torch else self.work / "bare"
        shutil.rmtree(path, ignore_errors=True)
        # hard links (torch is ~900 MB): pip never edits an installed file in place
        if subprocess.run(["cp", "-al", str(base), str(path)], capture_output=True).returncode != 0:
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(base, path, symlinks=True)
        for script in (path / "bin").iterdir():  # the copy's scripts must name its own interpreter
            if script.is_file() and not script.is_symlink():
                data = script.read_bytes()
                if str(base).encode() in data:
                    script.unlink()  # a new file, never the hard-linked one
                    script.write_bytes(data.replace(str(base).encode(), str(path).encode()))
                    script.chmod(0o755)

    def shell(
        self, venv: Path, line: str, res: Result, timeout: int = 900, dry: bool = False
    ) -> subprocess.CompletedProcess:
        env = {
            k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT", "VIRTUAL_ENV")
        }
        env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        # no .pyc at install time (Python writes them on first import): compiling every module of triton,
        # transformers or megatron-core costs CPU that 2 cores lack, and no install's success depends on it
        env["PIP_NO_COMPILE"] = "1"
        if dry:
            env["PYTHONPATH"] = str(self.work / "hatchling")
        res.log.append(f"$ {line}")
        r = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + line],
            cwd=self.clone, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        noise = "is ignored: it is neither a file nor a directory"
        res.log += [ln for ln in (r.stdout + r.stderr).splitlines() if noise not in ln][-40:]
        return r

    def with_pip_args(self, cmd: InstallCommand, extra: list[str]) -> str:
        argv = cmd.argv
        if cmd.is_install_script and "--" not in argv:
            extra = ["--", *extra]
        return _shell_join(argv + extra)

    def needs_torch(self, cmd: InstallCommand) -> bool:
        """Whether the command installs something that requires torch: from the rows' pyproject files for the
        install script, else from a dry run in an empty venv where torch can only be the CPU wheel."""
        idx = _script_index(cmd.argv)
        if idx is not None:
            inst = _load_install_script(self.clone)
            try:
                args = inst.parse_args(cmd.argv[idx + 1 :])
            except SystemExit:
                return False  # a usage error: the command itself will fail and say why
            if args.list:
                return False
            try:
                return inst.needs_torch([inst._pyproject(f, args.rows) for f in inst.projects(args.rows)])
            except inst.InstallError:
                return False  # the command itself will fail and say why
        probe = Result(cmd)
        venv = self.work / f"probe-{os.getpid()}-{id(probe)}"
        self.new_venv(venv, torch=False)
        pin = self.work / "torch-cpu-pin.txt"
        try:
            report = venv / "report.json"
            extra = ["-c", str(pin), "--no-build-isolation", "--dry-run", "--report", str(report)]
            self.shell(venv, self.with_pip_args(cmd, extra), probe, dry=True)
            return report.exists() and any(
                i["metadata"]["name"].lower() == "torch" for i in json.loads(report.read_text())["install"]
            )
        finally:
            shutil.rmtree(venv, ignore_errors=True)

    def run_one(self, res: Result, index: int) -> Result:
        cmd = res.cmd
        t_start = time.perf_counter()
        if cmd.mode == "network":
            res.ok, res.what = True, "not run: needs a network CI lacks"
            return res
        torch = cmd.mode == "resolve" or self.needs_torch(cmd)
        res.torch = torch
        venv = self.work / f"venv-{index:02d}"
        self.new_venv(venv, torch)
        try:
            report = self.work / f"report-{index:02d}.json"
            extra = ["--no-build-isolation", "--dry-run", "--report", str(report)]
            r = self.shell(venv, self.with_pip_args(cmd, extra), res, dry=True)
            t_dry = time.perf_counter() - t_start
            if r.returncode != 0 or not report.exists():
                res.what = f"dry run failed (rc {r.returncode})"
                return res
            planned = {
                i["metadata"]["name"].lower(): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]
            }
            if cmd.mode == "resolve":
                res.ok, res.what = True, f"resolves ({len(planned)} distributions), not installed (CUDA-only)"
                res.seconds = time.perf_counter() - t_start
                return res
            cuda = sorted(n for n in planned if CUDA_NAME.match(n))
            if "torch" in planned and "+cpu" not in planned["torch"]:
                cuda.append(f"torch {planned['torch']}")
            if cuda:
                res.what = f"would install CUDA wheels on a CPU machine: {', '.join(cuda)}"
                return res
            t0 = time.perf_counter()
            r = self.shell(venv, cmd.command, res)
            res.seconds = time.perf_counter() - t0
            if r.returncode != 0:
                res.what = f"failed (rc {r.returncode})"
                return res
            problem = self.smoke(venv, res, torch)
            res.venv_mb = _du_mb(venv)
            phases = f"dry run {t_dry:.0f} s, install {res.seconds:.0f} s"
            res.ok, res.what = not problem, problem or f"installed; smoke passed ({phases})"
            return res
        finally:
            if os.environ.get("MAGI_CI_DROP_VENVS", "0") == "1":
                shutil.rmtree(venv, ignore_errors=True)

    def smoke(self, venv: Path, res: Result, torch: bool) -> str:
        """'' if every first-party module that the command installed imports (and its console scripts answer
        --help, pip check passes, no torch appeared where none was needed), else what went wrong."""
        code = r"""
import importlib, importlib.metadata as md, json, sys
first_party = json.loads(sys.argv[1])
done, scripts = [], []
for dist, mods in first_party.items():
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        continue
    for m in mods:
        mod = importlib.import_module(m)
        done.append(f"{m} {getattr(mod, '__version__', '?')}")
    scripts += [ep.name for ep in d.entry_points if ep.group == "console_scripts"]
try:
    md.distribution("torch")
    torch = True
except md.PackageNotFoundError:
    torch = False
print(json.dumps({"imported": done, "scripts": scripts, "torch": torch}))
"""
        r = self.shell(
            venv, f"python -c {shlex.quote(code)} {shlex.quote(json.dumps(self.first_party))}", res
        )
        if r.returncode != 0:
            return "a first-party module does not import"
        info = json.loads(r.stdout.strip().splitlines()[-1])
        if not info["imported"]:
            return "installed no first-party package"
        if info["torch"] and not torch:
            return "a command that needs no torch installed torch"
        for script in info["scripts"]:
            if self.shell(venv, f"{script} --help >/dev/null", res).returncode != 0:
                return f"`{script} --help` failed"
        if self.shell(venv, "python -m pip check", res).returncode != 0:
            return "pip check failed"
        res.log.append(
            f"imported: {', '.join(info['imported'])}; scripts: {', '.join(info['scripts']) or '-'}"
        )
        return ""


def _du_mb(path: Path) -> float:
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True).stdout.split()
    return float(out[0]) if out else float("nan")


def cmd_list(args: argparse.Namespace) -> int:
    for c in find_commands():
        print(f"{c.mode:<8} {c.where:<45} {c.command}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    found = [c for c in find_commands() if not args.only or args.only in c.command]
    unique: dict[tuple[str, ...], Result] = {}
    for c in found:
        key = (*tuple(c.argv), c.mode)
        if key in unique:
            unique[key].others.append(c.where)
        else:
            unique[key] = Result(c)
    print(f"{len(found)} install commands in the docs and READMEs, {len(unique)} different", flush=True)
    runner = Runner(args)
    runner.prepare()
    (runner.work / "torch-cpu-pin.txt").write_text("torch==2.13.0\n")
    # longest first, so that the slowest command does not start last: integrations pull the most from the
    # index (torchtitan: 79 distributions), then the other runs, then the dry runs only
    inst = _load_install_script(ROOT)

    def cost(res: Result) -> int:
        """Sort key: integration rows 0, other runs 1, dry runs only 2, not run 3."""
        integration = False
        idx = _script_index(res.cmd.argv)
        if idx is not None:
            try:
                rows = inst.parse_args(res.cmd.argv[idx + 1 :]).rows
                integration = any(f.startswith("integrations/") for f in inst.projects(rows))
            except (SystemExit, inst.InstallError):
                pass  # the command fails when it runs, and says why
        return {"run": 1, "resolve": 2, "network": 3}[res.cmd.mode] - integration

    results = sorted(unique.values(), key=cost)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(runner.run_one, r, i): r for i, r in enumerate(results)}
        for fut in concurrent.futures.as_completed(futures):
            res = fut.result()
            print(f"[{time.perf_counter() - t0:5.0f} s] {'ok  ' if res.ok else 'FAIL'} {res.cmd.where}: {res.cmd.command}\n"
                  f"        {res.what}", flush=True)  # fmt: skip
            if not res.ok:
                print("\n".join("        | " + ln for ln in res.log), flush=True)
    rows = ["| command | where | CI | seconds | venv MB | result |", "|---|---|---|---:|---:|---|"]
    for r in results:
        where = ", ".join([r.cmd.where, *r.others])
        secs = "-" if r.seconds is None else f"{r.seconds:.0f}"
        size = "-" if r.venv_mb is None else f"{r.venv_mb:.0f}" + (" (with torch)" if r.torch else "")
        rows.append(f"| `{r.cmd.command}` | {where} | {r.cmd.mode} | {secs} | {size} | {r.what} |")
    table = "\n".join(rows)
    (runner.work / "install-commands.md").write_text(table + "\n")
    print("\n" + table)
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="print every install command found")
    r = sub.add_parser("run", help="run them")
    r.add_argument("--wheels", required=True, help="the CI wheels (become dist/ of the copy)")
    r.add_argument("--torch-base", required=True, help="a venv with only the CPU torch")
    r.add_argument("--work", required=True, help="scratch folder (emptied)")
    r.add_argument("--python", default=sys.executable, help="interpreter of the new venvs")
    r.add_argument("--only", metavar="TEXT", help="only the commands that contain TEXT (a developer's check)")
    r.add_argument("--jobs", type=int, default=4, help="commands at a time (pip mostly waits on the index)")
    args = p.parse_args(argv)
    return cmd_list(args) if args.cmd == "list" else cmd_run(args)


if __name__ == "__main__":
    raise SystemExit(main())
