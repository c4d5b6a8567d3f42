#!/usr/bin/env bash
# One entry point for a fresh clone: sets up .venv (pip, pinned torch/triton), then runs a job.
#   bash scripts/dev.sh demo    the main job (the distributed-attention demo)
#   bash scripts/dev.sh test    every test of every package (CPU; Triton kernels under the interpreter)
#   bash scripts/dev.sh docs    mkdocs build --strict
#   bash scripts/dev.sh lint    ruff check + ruff format --check
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
  "$PY" -m pip install -q --no-deps -e packages/solver -e packages/ffa -e packages/group_collective \
    -e packages/magi_attention -e packages/ffa_fa4
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
  *)
    echo "usage: bash scripts/dev.sh {demo|test|docs|lint} [args]" >&2
    exit 2
    ;;
esac
