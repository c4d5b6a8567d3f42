#!/usr/bin/env bash
# One entry point for a fresh clone: sets up .venv (pip, pinned torch/triton), then runs a job.
#   bash scripts/dev.sh demo    the main job (the distributed-attention demo)
#   bash scripts/dev.sh test    every test of every package (CPU; Triton kernels under the interpreter)
#   bash scripts/dev.sh docs    mkdocs build --strict
#   bash scripts/dev.sh lint    ruff check + ruff format --check
#   bash scripts/dev.sh wheels  build each package's wheel on its own (into dist/)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${MAGI_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

# Keep CPU tests deterministic and fast on 2 cores: one BLAS thread per rank (spawned ranks inherit it),
# and the Triton interpreter on whenever there is no GPU.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
export NO_MKDOCS_2_WARNING=1

setup() {
  local stamp=$VENV/.magi-setup
  local want
  want=$(cat requirements/ci.txt packages/*/pyproject.toml | sha1sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # pip, not uv: pip takes the local CPU torch wheel; uv would download the CUDA stack.
  "$PY" -m pip install -q -r requirements/ci.txt
  # Siblings in one pip command so no name is ever looked up on PyPI.
  "$PY" -m pip install -q --no-deps -e packages/mask -e packages/solver -e packages/ffa -e packages/group_collective \
    -e packages/magi_attention -e packages/ffa_fa4 -e packages/ffa_cudnn
  echo "$want" > "$stamp"
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
    "$PY" -m pytest -q "$@"
    ;;
  docs)
    "$PY" -m mkdocs build --strict -q -d "$ROOT/site"
    ;;
  lint)
    "$VENV/bin/ruff" check .
    "$VENV/bin/ruff" format --check .
    ;;
  wheels)
    rm -rf dist && mkdir -p dist
    for pkg in mask solver ffa ffa_fa4 ffa_cudnn group_collective magi_attention; do
      "$PY" -m pip wheel -q --no-deps -w dist "packages/$pkg"
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
    echo "usage: bash scripts/dev.sh {demo|test|docs|lint|wheels} [args]" >&2
    exit 2
    ;;
esac
