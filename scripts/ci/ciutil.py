"""Helpers of `.ci/run` (stdlib + `packaging`, which every venv has through pip): wheel metadata checks,
the install plan of one package's job, and the check that the per-package jobs ran every test of the suite.

    python scripts/ci/ciutil.py check-metadata WHEELHOUSE PROJECT_DIR...
    python scripts/ci/ciutil.py plan WHEELHOUSE PROJECT_DIR [--drop NAME,NAME]   (prints bash assignments)
    python scripts/ci/ciutil.py coverage COLLECTED_IDS RAN_IDS...
"""

from __future__ import annotations

import argparse
import email.parser
import re
import shlex
import sys
import tomllib
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
except ImportError:  # a bare venv: pip's vendored copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name

# Every first-party package uses enum.StrEnum (3.11): no wheel may claim an older Python.
MIN_PYTHON = (3, 11)
# Packages that must install and import without torch (the planner stack).
NO_TORCH = {"magi-mask", "magi-solver"}


class Wheel:
    def __init__(self, path: Path) -> None:
        self.path = path
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
            self.meta = email.parser.Parser().parsestr(zf.read(meta_name).decode())
        self.name = canonicalize_name(self.meta["Name"])
        self.version = self.meta["Version"]
        self.requires = [Requirement(r) for r in self.meta.get_all("Requires-Dist") or []]
        self.extras = [canonicalize_name(e) for e in self.meta.get_all("Provides-Extra") or []]
        # top-level import names: first path component of the files outside *.dist-info / *.data
        self.top_level = sorted(
            {
                n.split("/")[0].removesuffix(".py")
                for n in names
                if not n.split("/")[0].endswith((".dist-info", ".data"))
            }
        )

    def reqs(self, extras: set[str] = frozenset()) -> list[Requirement]:
        """Requirements that apply on this machine, with the given extras requested."""
        out = []
        for req in self.requires:
            if req.marker is None:
                out.append(req)
                continue
            envs = [dict(default_environment(), extra=e) for e in (extras or {""})]
            if any(req.marker.evaluate(env) for env in envs):
                out.append(req)
        return out


def load_wheels(wheelhouse: Path) -> dict[str, Wheel]:
    wheels = {}
    for path in sorted(wheelhouse.glob("*.whl")):
        w = Wheel(path)
        if w.name in wheels:
            sys.exit(f"two wheels of {w.name} in {wheelhouse}")
        wheels[w.name] = w
    return wheels


def project_name(project_dir: Path) -> str:
    return canonicalize_name(tomllib.loads((project_dir / "pyproject.toml").read_text())["project"]["name"])


def sibling_closure(
    wheels: dict[str, Wheel], reqs: list[Requirement], errors: list[str]
) -> tuple[list[Wheel], list[Requirement]]:
    """The first-party wheels that `reqs` need, transitively (each through its own declared requirements,
    with the extras asked for), and every third-party requirement met on the way (`reqs`' own included)."""
    seen: dict[str, Wheel] = {}
    asked: set[tuple[str, frozenset[str]]] = set()
    third: list[Requirement] = []
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name not in wheels:
            if str(req) not in {str(r) for r in third}:
                third.append(req)
            continue
        w = wheels[name]
        if not req.specifier.contains(w.version, prereleases=True):
            errors.append(f"requirement {req} does not accept the built {w.name} {w.version}")
        key = (name, frozenset(canonicalize_name(e) for e in req.extras))
        if key not in asked:
            asked.add(key)
            seen[name] = w
            todo.extend(w.reqs(set(key[1])))
    return sorted(seen.values(), key=lambda w: w.name), third


# ---------------------------------------------------------------------------------------------- plan
def bare(req: Requirement) -> str:
    """The requirement without its marker (already evaluated: `extra == "test"` would be false on pip's command line)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def cmd_plan(args: argparse.Namespace) -> None:
    wheels = load_wheels(Path(args.wheelhouse))
    name = project_name(Path(args.project))
    if name not in wheels:
        sys.exit(f"no wheel of {name} in {args.wheelhouse}")
    me = wheels[name]
    drop = {canonicalize_name(d) for d in args.drop.split(",") if d}
    wanted = {canonicalize_name(e) for e in args.extras.split(",") if e}
    unknown = wanted - {"test"} - set(me.extras)
    if unknown:
        sys.exit(f"{name} has no extra {sorted(unknown)}")
    extras = wanted & set(me.extras)
    errors: list[str] = []
    closure, third = sibling_closure(wheels, me.reqs(extras), errors)
    siblings = [w for w in closure if w.name != name]
    if errors:
        sys.exit("\n".join(errors))
    third = [r for r in third if canonicalize_name(r.name) not in drop]
    needs_torch = any(canonicalize_name(r.name) == "torch" for r in third)
    first_party = sorted({t for w in wheels.values() for t in w.top_level})
    out = {
        "WHEEL": str(me.path),
        "DIST": me.name,
        "VERSION": me.version,
        "HAS_TEST_EXTRA": "1" if "test" in extras else "0",
        "EXTRAS": ",".join(sorted(extras)),
        "NEEDS_TORCH": "1" if needs_torch else "0",
        "TOP_LEVEL": " ".join(me.top_level),
        "FIRST_PARTY": " ".join(first_party),
        "SIBLINGS": " ".join(str(w.path) for w in siblings),
        "SIBLING_NAMES": " ".join(w.name for w in siblings),
        # with --drop: this wheel and its siblings go in with --no-deps, after every third-party requirement
        # of theirs (extras resolved, the dropped ones left out)
        "THIRD_PARTY": " ".join(shlex.quote(bare(r)) for r in third),
    }
    for key, value in out.items():
        print(f"{key}={shlex.quote(value)}")


def cmd_plan_all(args: argparse.Namespace) -> None:
    """Every package wheel in one venv: wheels with a dropped requirement go in with --no-deps (their other
    requirements listed), the others with every extra that needs nothing dropped."""
    wheels = load_wheels(Path(args.wheelhouse))
    names = {project_name(Path(p)) for p in args.projects}
    drop = {canonicalize_name(d) for d in args.drop.split(",") if d}
    chosen = {n: w for n, w in wheels.items() if n in names}
    nodeps = {n for n, w in chosen.items() if any(canonicalize_name(r.name) in drop for r in w.reqs())}
    install, extra_reqs = [], []
    for n, w in sorted(chosen.items()):
        if n in nodeps:
            extra_reqs += [bare(r) for r in w.reqs() if canonicalize_name(r.name) not in drop | set(wheels)]
            continue
        ok = [
            e
            for e in w.extras
            if not any(canonicalize_name(r.name) in drop | nodeps for r in w.reqs({e}) if r not in w.reqs())
        ]
        install.append(f"{w.path}[{','.join(ok)}]" if ok else str(w.path))
    out = {
        "INSTALL": " ".join(shlex.quote(i) for i in install),
        "NODEPS": " ".join(str(chosen[n].path) for n in sorted(nodeps)),
        "EXTRA_REQS": " ".join(shlex.quote(r) for r in extra_reqs),
        "FIRST_PARTY": " ".join(sorted({t for w in wheels.values() for t in w.top_level})),
        "NAMES": " ".join(sorted(chosen)),
    }
    for key, value in out.items():
        print(f"{key}={shlex.quote(value)}")


# ------------------------------------------------------------------------------------ check-metadata
LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)|^\[[^\]]+\]:\s*(\S+)", re.M)


def relative_links(markdown: str) -> list[str]:
    bad = []
    for m in LINK.finditer(markdown):
        target = m.group(1) or m.group(2)
        if not re.match(r"^(https?://|mailto:|#)", target):
            bad.append(target)
    return bad


def cmd_check_metadata(args: argparse.Namespace) -> None:
    wheels = load_wheels(Path(args.wheelhouse))
    problems, warnings = [], []
    projects = [Path(p) for p in args.projects]
    by_name = {project_name(p): p for p in projects}
    missing = sorted(set(by_name) - set(wheels))
    if missing:
        problems.append(f"no wheel built for {missing}")
    here = sys.version_info[:2]
    for name, w in sorted(wheels.items()):
        strict = by_name.get(name, Path("packages")).parts[0] == "packages"
        issues = []
        rp = w.meta.get("Requires-Python")
        if not rp:
            issues.append("no Requires-Python")
        else:
            spec = SpecifierSet(rp)
            if spec.contains(f"{MIN_PYTHON[0]}.{MIN_PYTHON[1] - 1}"):
                issues.append(
                    f"Requires-Python {rp} admits 3.{MIN_PYTHON[1] - 1}; the code uses enum.StrEnum (3.11)"
                )
            lowest = next((f"3.{m}" for m in range(6, 20) if spec.contains(f"3.{m}")), None)
            if lowest != f"{here[0]}.{here[1]}":
                warnings.append(f"{name}: lowest claimed Python {lowest}, but CI runs {here[0]}.{here[1]}")
        if w.meta.get("Description-Content-Type", "").split(";")[0] != "text/markdown":
            issues.append("README is not declared as text/markdown")
        rel = relative_links(w.meta.get_payload() or "")
        if rel:
            issues.append(f"README links that break outside the repository: {rel}")
        if strict:
            if not w.meta.get_all("Project-URL"):
                issues.append("no [project.urls]")
            classifiers = w.meta.get_all("Classifier") or []
            if not any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers):
                issues.append("no 'Programming Language :: Python :: 3.x' classifier")
            for c in classifiers:
                m = re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c)
                if m and rp and not SpecifierSet(rp).contains(f"3.{m.group(1)}"):
                    issues.append(f"classifier {c!r} contradicts Requires-Python {rp}")
        if name in NO_TORCH:
            heavy = [str(r) for r in w.reqs() if canonicalize_name(r.name) in {"torch", "triton"}]
            if heavy:
                issues.append(f"must install without torch/triton, but requires {heavy}")
        if issues:
            (problems if strict else warnings).extend(f"{name}: {i}" for i in issues)
    for line in warnings:
        print(f"warning: {line}")
    for _, w in sorted(wheels.items()):
        print(
            f"{w.path.name}: Requires-Python {w.meta.get('Requires-Python')}, requires {[str(r) for r in w.reqs()]}"
        )
    if problems:
        sys.exit("metadata problems:\n  " + "\n  ".join(problems))
    print(f"metadata of {len(wheels)} wheels checked")


# ------------------------------------------------------------------------------------------ coverage
def cmd_coverage(args: argparse.Namespace) -> None:
    collected = {line.strip() for line in Path(args.collected).read_text().splitlines() if "::" in line}
    if not collected:
        sys.exit(f"no test ids in {args.collected}")
    ran: dict[str, list[str]] = {}
    for path in args.ran:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                ran.setdefault(line.strip(), []).append(Path(path).stem)
    missing = sorted(collected - set(ran))
    twice = sorted(i for i in collected if len(ran.get(i, [])) > 1)
    for i in twice:
        print(f"warning: {i} ran in {ran[i]}")
    if missing:
        shown = "\n  ".join(missing[:40])
        sys.exit(
            f"{len(missing)} of {len(collected)} tests of the suite ran in no per-package job:\n  {shown}"
        )
    print(f"all {len(collected)} tests of the suite ran in a per-package job ({len(twice)} in more than one)")


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("wheelhouse")
    p.add_argument("project")
    p.add_argument("--drop", default="")
    p.add_argument("--extras", default="test")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("plan-all")
    p.add_argument("wheelhouse")
    p.add_argument("projects", nargs="+")
    p.add_argument("--drop", default="")
    p.set_defaults(func=cmd_plan_all)
    p = sub.add_parser("check-metadata")
    p.add_argument("wheelhouse")
    p.add_argument("projects", nargs="+")
    p.set_defaults(func=cmd_check_metadata)
    p = sub.add_parser("coverage")
    p.add_argument("collected")
    p.add_argument("ran", nargs="+")
    p.set_defaults(func=cmd_coverage)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
