#!/usr/bin/env bash
# One entry point for a fresh clone: sets up .venv (pip, pinned torch/triton), then runs a job.
#   bash scripts/dev.sh demo    the main job (the distributed-attention demo)
#   bash scripts/dev.sh test    every test: pytest.ini's suite, then each integration's tests with its own pytest
#                               configuration, in its own venv (.venv-integrations/<x>, made on first use: a
#                               hard-linked copy of .venv plus its test dependencies, as CI's int-* jobs have
#                               one venv each). CPU; Triton kernels under the interpreter. With arguments:
#                               pytest with them (an integrations/<x> path first: that integration's venv and config)
#   bash scripts/dev.sh docs    mkdocs build --strict (the site goes to site/)
#   bash scripts/dev.sh lint    ruff check + ruff format --check
#   bash scripts/dev.sh wheels  build each package's wheel on its own (into dist/)
#   bash scripts/dev.sh check-wheels  no CUDA-only wheel (flash-attn-4, nvidia-*) in .venv, in the integrations'
#                               venvs or in what any integration's set-up would install (CI runs it)
# MAGI_VENV moves .venv, MAGI_INT_VENVS the integrations' venvs (default: $MAGI_VENV-integrations).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${MAGI_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
# each integration's tests run in a venv of its own there: <dir>/<integration> (see setup_integration)
INT_VENVS=${MAGI_INT_VENVS:-$VENV-integrations}

# Keep CPU tests deterministic and fast on 2 cores: one BLAS thread per rank (spawned ranks inherit it),
# and the Triton interpreter on whenever there is no GPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
export NO_MKDOCS_2_WARNING=1

step() {  # step SECONDS_AT_START TEXT: one progress line of a set-up (pip itself runs quietly)
  echo "dev.sh: [$((SECONDS - $1)) s] $2" >&2
}

run_step() {  # run_step SECONDS_AT_START TEXT CMD...: a progress line, then CMD, with a line every 15 s while it runs
  local t0=$1 text=$2 pid n=0
  shift 2
  step "$t0" "$text"
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ $((n % 15)) -eq 0 ] && kill -0 "$pid" 2>/dev/null; then step "$t0" "  ... still installing"; fi
  done
  wait "$pid"
}

setup() {
  local stamp=$VENV/.magi-setup
  local want
  want=$(cat requirements/ci.txt packages/*/pyproject.toml | sha1sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  local t0=$SECONDS
  echo "dev.sh: setting up $VENV (once; 1-2 min): torch 2.13.0 (CPU wheel on a machine without a GPU), triton 3.6.0," \
    "numpy<2.4, pytest, ruff, mkdocs, matplotlib, and every package under packages/ editable" >&2
  if [ ! -x "$PY" ]; then step $t0 "creating the virtual environment"; python3 -m venv "$VENV"; fi
  run_step $t0 "upgrading pip" "$PY" -m pip install -q --upgrade pip
  # pip, not uv: pip takes the local CPU torch wheel; uv would download the CUDA stack.
  run_step $t0 "installing requirements/ci.txt (torch, triton, numpy, pytest, ruff, mkdocs, ...; the longest step)" \
    "$PY" -m pip install -q -r requirements/ci.txt
  # Siblings in one pip command so no name is ever looked up on PyPI.
  local pkgs=() d
  for d in packages/*/; do [ -f "$d/pyproject.toml" ] && pkgs+=(-e "${d%/}"); done
  run_step $t0 "installing packages/* editable, without dependencies (no CUDA-only wheel)" \
    "$PY" -m pip install -q --no-deps "${pkgs[@]}"
  echo "$want" > "$stamp"
  echo "dev.sh: $VENV ready in $((SECONDS - t0)) s ($(du -sh "$VENV" | cut -f1))" >&2
}

# CUDA-only distributions: never installed on a machine without a GPU by any documented command (the
# backends that need them are optional; `check-wheels` and CI enforce it).
CUDA_ONLY_NAMES='(flash[-_]attn[-_]4|nvidia[-_][a-z0-9_.-]*|cuda[-_]toolkit|quack[-_]kernels)'
CUDA_ONLY="^${CUDA_ONLY_NAMES}\$"

third_party_requirements() {  # third_party_requirements DIR: DIR's dependencies and test extra, siblings left out
  "$PY" - "$1/pyproject.toml" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("test", [])
for r in reqs:
    name = re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-")
    if not name.startswith("magi-"):  # our packages: installed editable, without their dependencies
        print(r)
PY
}

integrations() {  # every integration with a package (a pyproject.toml)
  local d
  for d in integrations/*/; do [ -f "$d/pyproject.toml" ] && echo "${d%/}"; done
  return 0
}

integration_venv() {  # integration_venv DIR: where DIR's tests run (its own venv, beside $VENV)
  echo "$INT_VENVS/$(basename "$1")"
}

setup_integration() {  # setup_integration DIR: DIR's own venv with its test dependencies, on first use
  # Each integration gets its own venv, as in CI's int-* jobs: their third-party pins need not agree (datasets,
  # which torchtitan brings, caps huggingface-hub below 2; transformers 5 needs 2.x), and one venv for all
  # would have pip report a broken environment. The venv starts as a hard-linked copy of $VENV (torch and
  # the editable packages cost no disk or time again; pip replaces files rather than editing them in place,
  # so $VENV stays intact); it is rebuilt whenever $VENV, DIR's pyproject.toml or the constraints change.
  local dir=$1 v stamp want
  v=$(integration_venv "$dir")
  stamp=$v/.magi-setup-integration
  want=$(cat "$VENV/.magi-setup" "$dir/pyproject.toml" requirements/constraints.txt | sha1sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  local t0=$SECONDS reqs=() py=$v/bin/python
  echo "dev.sh: setting up $v for $dir and its test dependencies (once)" >&2
  step $t0 "copying $VENV (hard links)"
  rm -rf "$v" && mkdir -p "$INT_VENVS"
  cp -al "$VENV" "$v" 2>/dev/null || { rm -rf "$v"; cp -a "$VENV" "$v"; }
  rm -f "$v"/.magi-setup*
  # the copy's scripts must name its own interpreter (pip, pytest, torchrun), not $VENV's
  grep -rlI --null -F "$VENV" "$v/bin" | xargs -0 -r sed -i "s|$VENV|$v|g"
  # The integration editable WITHOUT dependencies (with them, pip would pull the optional backends'
  # CUDA-only wheels: flash-attn-4, the CUTLASS DSL, cuDNN's frontend; the siblings are already there); then
  # only its third-party dependencies, under the constraints that keep the pinned torch, triton and numpy.
  run_step $t0 "$dir editable, without dependencies" "$py" -m pip install -q --no-deps -e "$dir"
  mapfile -t reqs < <(third_party_requirements "$dir")
  if [ ${#reqs[@]} -gt 0 ]; then
    run_step $t0 "third-party dependencies: ${reqs[*]}" \
      "$py" -m pip install -q -c requirements/constraints.txt "${reqs[@]}"
  fi
  pip_check "$py"
  gpu_present || check_wheels_installed "$py"
  echo "$want" > "$stamp"
  echo "dev.sh: $dir's venv ready in $((SECONDS - t0)) s" >&2
}

pip_check() {  # pip_check PY: no broken requirement in PY's venv but the CUDA-only ones, left out on purpose
  local broken
  broken=$("$1" -m pip check 2>/dev/null | grep -viE "requires ${CUDA_ONLY_NAMES}, which is not installed" || true)
  if [ -n "$broken" ] && [ "$broken" != "No broken requirements found." ]; then
    echo "dev.sh: broken requirements in $(dirname "$(dirname "$1")"):" >&2
    echo "$broken" >&2
    return 1
  fi
}

check_wheels_installed() {  # check_wheels_installed [PY]: its venv ($VENV's by default) holds no CUDA-only
  # distribution (run where there is no GPU)
  local py=${1:-$PY} bad
  bad=$("$py" -m pip list --format=freeze 2>/dev/null | cut -d= -f1 | grep -Ei "$CUDA_ONLY" || true)
  if [ -n "$bad" ]; then
    echo "dev.sh: CUDA-only wheels in $(dirname "$(dirname "$py")") on a machine without a GPU: $(echo $bad)" >&2
    return 1
  fi
}

check_wheels() {  # check-wheels: the venvs, and what every integration's set-up would add, hold no CUDA-only wheel
  check_wheels_installed
  local dir reqs report bad
  for dir in $(integrations); do
    # an integration's venv set up before (setup_integration checks it then; its packages may have changed)
    if [ -x "$(integration_venv "$dir")/bin/python" ]; then check_wheels_installed "$(integration_venv "$dir")/bin/python"; fi
    mapfile -t reqs < <(third_party_requirements "$dir")
    [ ${#reqs[@]} -gt 0 ] || continue
    report=$(mktemp)
    "$PY" -m pip install -q --dry-run --ignore-installed --report "$report" -c requirements/constraints.txt "${reqs[@]}"
    bad=$("$PY" -c 'import json,sys; print(" ".join(i["metadata"]["name"] for i in json.load(open(sys.argv[1]))["install"]))' \
      "$report" | tr ' ' '\n' | grep -Ei "$CUDA_ONLY" || true)
    rm -f "$report"
    if [ -n "$bad" ]; then
      echo "dev.sh: $dir's set-up would install CUDA-only wheels: $(echo $bad)" >&2
      return 1
    fi
  done
  echo "dev.sh: no CUDA-only wheel in $VENV, in the integrations' venvs or in any integration's set-up" >&2
}

pytest_integration() {  # pytest_integration DIR [ARGS]: with the integration's own pytest configuration
  local dir=$1
  shift
  setup_integration "$dir"
  "$(integration_venv "$dir")/bin/python" -m pytest -q -c "$dir/pyproject.toml" --rootdir "$dir" "$@"
}

gpu_present() {
  "$PY" -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

cmd=${1:-test}
shift || true
setup
case "$cmd" in
  demo)
    "$PY" -m magi_attention.demo "$@"
    ;;
  test)
    gpu_present || export TRITON_INTERPRET=1
    if [ $# -gt 0 ]; then
      case $1 in
        integrations/*/*|integrations/*)
          dir=$(cut -d/ -f1-2 <<<"$1")
          pytest_integration "$dir" "$@"
          ;;
        *) "$PY" -m pytest -q "$@" ;;
      esac
      exit
    fi
    t0=$SECONDS
    failed=()
    echo "dev.sh: pytest.ini's suite (packages/*/tests, tests/)" >&2
    "$PY" -m pytest -q || failed+=(pytest.ini)
    for dir in $(integrations); do
      echo "dev.sh: $dir/tests (its own pytest configuration)" >&2
      pytest_integration "$dir" "$dir/tests" || failed+=("$dir")
    done
    if [ ${#failed[@]} -gt 0 ]; then
      echo "dev.sh: FAILED: ${failed[*]} ($((SECONDS - t0)) s)" >&2
      exit 1
    fi
    echo "dev.sh: every suite passed: pytest.ini's and $(integrations | wc -l) integrations' ($((SECONDS - t0)) s)" >&2
    ;;
  docs)
    "$PY" -m mkdocs build --strict -q -d "$ROOT/site"
    echo "dev.sh: docs built: $ROOT/site/index.html (serve them: $VENV/bin/mkdocs serve)"
    ;;
  check-wheels)
    check_wheels
    ;;
  lint)
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    ;;
  wheels)
    rm -rf dist && mkdir -p dist
    for dir in packages/*/ $(integrations); do
      [ -f "$dir/pyproject.toml" ] && "$PY" -m pip wheel -q --no-deps -w dist "$dir"
    done
    # The planner must stay installable without torch.
    "$PY" - <<'PY'
import glob, sys, zipfile
whl = zipfile.ZipFile(glob.glob("dist/magi_solver-*.whl")[0])
meta = next(n for n in whl.namelist() if n.endswith("METADATA"))
reqs = [l for l in whl.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
if any("torch" in l or "triton" in l for l in reqs):
    sys.exit(f"magi-solver's wheel must not depend on torch/triton: {reqs}")
PY
    ls dist
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test|docs|lint|wheels|check-wheels} [args]" >&2
    exit 2
    ;;
esac
