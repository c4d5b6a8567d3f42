#!/usr/bin/env bash
# The jobs of .ci/run (each also runs alone, after `wheels` and `torch-base`):
#   bash scripts/ci/job.sh wheels                 build every package's and integration's wheel, check metadata
#   bash scripts/ci/job.sh torch-base             a venv holding only torch==2.13.0 (CPU), cloned by the jobs that need torch
#   bash scripts/ci/job.sh dev                    scripts/dev.sh's editable venv: lint, docs, collect every test of the suite,
#                                                 no CUDA-only wheel (dev.sh check-wheels)
#   bash scripts/ci/job.sh pkg DIR [--extras test,X] [--drop A,B]
#                                                 DIR's wheel alone in a fresh venv (declared deps + sibling wheels), its tests
#   bash scripts/ci/job.sh repo [--drop A,B]      every package wheel in one venv, the root tests/
#   bash scripts/ci/job.sh coverage               the pkg jobs together ran every test that the dev job collected
#   bash scripts/ci/job.sh install-commands       every install command of the docs and READMEs, each in a fresh venv
# Layout under $CI_OUT (default out/ci): wheels/, venvs/<job>/, ids/<job>.txt, work/<job>/.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
CI_OUT=${CI_OUT:-$ROOT/out/ci}
PYTHON=${MAGI_PYTHON:-python3}
WHEELS=$CI_OUT/wheels
CONSTRAINTS=$ROOT/requirements/constraints.txt
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$CI_OUT"/{venvs,ids,work}

say() { echo "[$(date +%T)] $*"; }

tools_py() {  # a bare venv for building wheels and running ciutil.py (pip brings `packaging`)
  local v=$CI_OUT/venvs/tools
  if [ ! -x "$v/bin/python" ]; then "$PYTHON" -m venv "$v" && "$v/bin/python" -m pip install -q hatchling; fi
  "$v/bin/python" "$@"
}

projects() {  # every package and integration with a pyproject.toml
  local d
  for d in packages/*/ integrations/*/; do [ -f "$d/pyproject.toml" ] && echo "${d%/}"; done
  return 0
}

job_wheels() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  local d
  for d in $(projects); do
    say "wheel: $d"
    # no build isolation: hatchling is in the tools venv (saves a throwaway build env per package)
    tools_py -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "$d"
  done
  ls -l "$WHEELS"
  # shellcheck disable=SC2046
  tools_py scripts/ci/ciutil.py check-metadata "$WHEELS" $(projects)
}

job_torch_base() {
  local v=$CI_OUT/venvs/torch-base
  rm -rf "$v"
  "$PYTHON" -m venv "$v"
  "$v/bin/python" -m pip install -q --upgrade pip  # the bundled pip 23.2 mishandles `wheel[extra]` files
  # pip, never uv: pip takes the local CPU wheel of torch 2.13.0 (uv would download the CUDA stack)
  "$v/bin/python" -m pip install -q -c "$CONSTRAINTS" torch==2.13.0
  "$v/bin/python" -c 'import torch; assert torch.version.cuda is None, torch.__version__; print("torch", torch.__version__)'
  "$v/bin/python" -m pip list --format=freeze
}

new_venv() {  # new_venv PATH NEEDS_TORCH: a fresh venv, a copy of torch-base when torch is needed
  local v=$1 base=$CI_OUT/venvs/torch-base
  rm -rf "$v"
  if [ "$2" = 1 ]; then
    # Hard links, not copies: a dozen copies of torch filled a CI disk. pip never edits an installed file in
    # place (it unlinks and writes new ones), so torch-base stays intact; other filesystems get a real copy.
    cp -al "$base" "$v" 2>/dev/null || { rm -rf "$v"; cp -a "$base" "$v"; }
    # the copy's scripts must name its own interpreter (torchrun & co.), not torch-base's
    grep -rlI --null -F "$base" "$v/bin" | xargs -0 -r sed -i "s|$base|$v|g"
  else
    "$PYTHON" -m venv "$v"
    "$v/bin/python" -m pip install -q --upgrade pip
  fi
}

drop_venv_when_done() {  # drop_venv_when_done PATH...: under .ci/run (MAGI_CI_DROP_VENVS=1) a job's venvs go when it ends
  [ "${MAGI_CI_DROP_VENVS:-0}" = 1 ] || return 0
  local quoted="" p
  for p in "$@"; do quoted+=" '$p'"; done
  # shellcheck disable=SC2064
  trap "rm -rf$quoted" EXIT
}

pip_check() {  # pip_check PY DROP: no broken requirement but the left-out ones
  local rc=0 out d
  out=$("$1" -m pip check 2>&1) || rc=$?
  [ $rc -eq 0 ] && { echo "pip check: $out"; return 0; }
  for d in ${2//,/ }; do out=$(grep -vi "requires ${d}," <<<"$out" || true); done
  if [ -n "$out" ]; then echo "$out"; return 1; fi
  echo "pip check: only the left-out requirements are missing ($2)"
}

run_pytest() {  # run_pytest JOB PY OWN_TOP_LEVEL CONFIG_ARGS... -- TEST_PATHS...
  # From an empty directory, so only site-packages can provide the packages (importlib import mode);
  # magi_ci_guard fails the session if a first-party module came from anywhere else.
  local job=$1 py=$2 own=$3 cfg=()
  shift 3
  while [ "$1" != -- ]; do cfg+=("$1"); shift; done
  shift
  local work=$CI_OUT/work/$job
  rm -rf "$work" && mkdir -p "$work"
  say "pytest (from $work)"
  (
    cd "$work"
    PYTHONPATH=$ROOT/scripts/ci MAGI_CI_FIRST_PARTY=$FIRST_PARTY MAGI_CI_OWN=$own \
      MAGI_CI_NODEIDS=$CI_OUT/ids/$job.txt TRITON_INTERPRET=1 \
      "$py" -m pytest -q -p no:cacheprovider -p magi_ci_guard "${cfg[@]}" "$@"
  )
}

job_pkg() {
  local dir=$1 drop="" extras=test
  shift
  while [ $# -gt 0 ]; do
    case $1 in
      --drop) drop=$2; shift 2 ;;
      --extras) extras=$2; shift 2 ;;
      *) echo "unknown option $1" >&2; return 2 ;;
    esac
  done
  local job kind
  kind=$(basename "$(dirname "$dir")")
  job=${kind/packages/pkg}
  job=${job/integrations/int}-$(basename "$dir")
  local v=$CI_OUT/venvs/$job
  local WHEEL DIST VERSION HAS_TEST_EXTRA EXTRAS NEEDS_TORCH TOP_LEVEL FIRST_PARTY SIBLINGS SIBLING_NAMES THIRD_PARTY
  eval "$(tools_py scripts/ci/ciutil.py plan "$WHEELS" "$dir" --drop "$drop" --extras "$extras")"
  say "$DIST $VERSION${EXTRAS:+[$EXTRAS]}: siblings [${SIBLING_NAMES}], torch needed: $NEEDS_TORCH${drop:+, left out: $drop}"
  new_venv "$v" "$NEEDS_TORCH"
  drop_venv_when_done "$v"
  say "venv ready: $v; installing"
  local py=$v/bin/python sib=()
  read -r -a sib <<<"$SIBLINGS"
  local test_reqs=()
  [ "$HAS_TEST_EXTRA" = 1 ] || test_reqs=(-r "$ROOT/requirements/test.txt")
  # Only this wheel, its declared dependencies and the sibling wheels they name: a package that imports
  # something it does not declare fails here. Constraints keep torch the local CPU 2.13.0 wheel.
  if [ -z "$drop" ]; then
    local target=$WHEEL
    [ -n "$EXTRAS" ] && target="$WHEEL[$EXTRAS]"
    "$py" -m pip install -q -c "$CONSTRAINTS" "$target" "${sib[@]}" "${test_reqs[@]}"
  else
    # some requirement is left out (CUDA-only): every first-party wheel goes in with --no-deps, after all the
    # third-party requirements that they declare but the left-out ones
    local third=()
    eval "third=($THIRD_PARTY)"
    "$py" -m pip install -q -c "$CONSTRAINTS" "${third[@]}" "${test_reqs[@]}"
    "$py" -m pip install -q --no-deps "$WHEEL" "${sib[@]}"
  fi
  say "installed:"
  "$py" -m pip list --format=freeze | sed 's/^/  /'
  pip_check "$py" "$drop"
  # the package imports from site-packages, and its __version__ is the wheel's version
  "$py" - "$DIST" $TOP_LEVEL <<'PY'
import importlib, importlib.metadata, sys, sysconfig
from pathlib import Path
dist, names = sys.argv[1], sys.argv[2:]
site = Path(sysconfig.get_paths()["purelib"]).resolve()
for name in names:
    mod = importlib.import_module(name)
    where = Path(mod.__file__).resolve()
    assert site in where.parents, f"{name} imported from {where}, not from {site}"
    version = getattr(mod, "__version__", None)
    if version is not None and version != importlib.metadata.version(dist):
        sys.exit(f"{name}.__version__ = {version!r}, but the installed {dist} is {importlib.metadata.version(dist)}")
    print(f"{name}.__version__ = {version} (wheel {importlib.metadata.version(dist)}), imported from {where.parent}")
PY
  if [ "$NEEDS_TORCH" = 0 ]; then
    "$py" -c 'import importlib.util, sys; sys.exit("torch is installed" if importlib.util.find_spec("torch") else 0)'
    echo "torch is not installed in this job's venv"
  fi
  # a package with its own [tool.pytest.ini_options] is its own rootdir; the others use the root pytest.ini
  local cfg=(-c "$ROOT/pytest.ini" --rootdir "$ROOT")
  if grep -q '^\[tool\.pytest\.ini_options\]' "$dir/pyproject.toml"; then
    cfg=(-c "$ROOT/$dir/pyproject.toml" --rootdir "$ROOT/$dir")
  fi
  run_pytest "$job" "$py" "$TOP_LEVEL" "${cfg[@]}" -- "$ROOT/$dir/tests"
}

job_repo() {
  # The repository's own tests (tests/: layering, docs examples, cp baselines, GPU scripts on gloo) against
  # every package's wheel in one venv, with their extras; a wheel whose requirements include a left-out
  # one (--drop) goes in with --no-deps.
  local drop=""
  [ "${1:-}" = --drop ] && drop=$2
  local v=$CI_OUT/venvs/repo INSTALL NODEPS EXTRA_REQS FIRST_PARTY NAMES
  # shellcheck disable=SC2046
  eval "$(tools_py scripts/ci/ciutil.py plan-all "$WHEELS" $(projects | grep '^packages/') --drop "$drop")"
  say "every package: $NAMES${NODEPS:+; without their dependencies: $NODEPS}"
  new_venv "$v" 1
  drop_venv_when_done "$v"
  local py=$v/bin/python inst=() extra=() nodeps=()
  eval "inst=($INSTALL)"
  eval "extra=($EXTRA_REQS)"
  read -r -a nodeps <<<"$NODEPS"
  "$py" -m pip install -q -c "$CONSTRAINTS" "${inst[@]}" "${extra[@]}" -r "$ROOT/requirements/test.txt"
  [ ${#nodeps[@]} -eq 0 ] || "$py" -m pip install -q --no-deps "${nodeps[@]}"
  say "installed:"
  "$py" -m pip list --format=freeze | sed 's/^/  /'
  pip_check "$py" "$drop"
  run_pytest repo "$py" "" -c "$ROOT/pytest.ini" --rootdir "$ROOT" -- "$ROOT/tests"
}

job_dev() {
  # The README's setup: dev.sh makes .venv (or $MAGI_VENV) with every package editable. Each step runs
  # even if an earlier one failed (the coverage job needs the collection).
  local failed=()
  if [ "${MAGI_CI_DROP_VENVS:-0}" = 1 ] && [ -z "${MAGI_VENV:-}" ]; then
    export MAGI_VENV=$CI_OUT/venvs/dev  # not the checkout's .venv, which a developer may be using
    # (and the integrations' venvs that dev.sh makes beside it, where the whole suite runs)
    drop_venv_when_done "$MAGI_VENV" "$MAGI_VENV-integrations"
  fi
  # Every test of the suite is collected here (imports every test module in the editable venv) and run
  # once in the pkg-*/repo jobs; MAGI_CI_FULL_EDITABLE=1 also runs the whole suite here, as before.
  say "collect the whole suite (pytest.ini)"
  # (dev.sh passes -q: one test id a line)
  bash scripts/dev.sh test -p no:cacheprovider --collect-only >"$CI_OUT/work/collected.txt" || failed+=(collect)
  grep -v '::' "$CI_OUT/work/collected.txt" | grep -v '^$' | tail -n 20 || true
  if [ "${MAGI_CI_FULL_EDITABLE:-0}" = 1 ]; then
    say "the whole suite in the editable venv"
    bash scripts/dev.sh test -p no:cacheprovider || failed+=(test)
  fi
  # No CUDA-only wheel (flash-attn-4, nvidia-*) in the dev venv or in what any integration's set-up adds
  say "no CUDA-only wheel on a CPU machine"
  bash scripts/dev.sh check-wheels || failed+=(check-wheels)
  say "docs"
  bash scripts/dev.sh docs || failed+=(docs)
  say "lint"
  bash scripts/dev.sh lint || failed+=(lint)
  if [ ${#failed[@]} -gt 0 ]; then say "failed: ${failed[*]}"; return 1; fi
}

job_install_commands() {
  # scripts/ci/install_commands.py finds the commands (a new package's documented command is picked up
  # by being written in a doc) and runs or resolves each; the table of seconds and venv sizes ends the log
  local work=$CI_OUT/work/install-commands
  [ "${MAGI_CI_DROP_VENVS:-0}" = 1 ] && trap "rm -rf '$work'" EXIT
  tools_py scripts/ci/install_commands.py run --wheels "$WHEELS" --torch-base "$CI_OUT/venvs/torch-base" \
    --work "$work" --python "$PYTHON" --jobs "${MAGI_CI_INSTALL_JOBS:-4}"
  cp "$work/install-commands.md" "$CI_OUT/install-commands.md"
}

job_coverage() {
  tools_py scripts/ci/ciutil.py coverage "$CI_OUT/work/collected.txt" "$CI_OUT"/ids/*.txt
}

cmd=${1:?usage: job.sh wheels|torch-base|dev|pkg DIR|coverage}
shift
case $cmd in
  wheels) job_wheels ;;
  torch-base) job_torch_base ;;
  dev) job_dev ;;
  pkg) job_pkg "$@" ;;
  repo) job_repo "$@" ;;
  coverage) job_coverage ;;
  install-commands) job_install_commands ;;
  projects) projects ;;
  *) echo "unknown job $cmd" >&2; exit 2 ;;
esac
