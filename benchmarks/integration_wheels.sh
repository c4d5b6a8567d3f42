#!/usr/bin/env bash
# The wheels the integration runs need on the GPU machine (which reaches no package index), in .intwheels/:
#   bash benchmarks/integration_wheels.sh prepare   here, with network: download them (Python 3.12, x86-64)
#   bash benchmarks/integration_wheels.sh install   there (carry .intwheels): install them into python3
#
# The GPU image has torch, numpy, packaging, transformers and most of torchtitan's dependencies; what it lacks
# was found by importing magi_attention_torchtitan (all of it, the trainer and config functions included),
# torchtitan.train and megatron.core in a venv holding only torch and the image's packages: megatron-core
# needs nothing more; torchtitan imports tyro (+ docstring-parser, typeguard), torchdata, spmd-types and
# datasets (+ dill, multiprocess) at module level. Declared but not imported there, and left out: wandb (a
# 20 MB binary; torchtitan imports it only when wandb logging is on); torch-checkpointing is small and goes in.
# The four integrations travel as their own wheels too: magi_attention_torchtitan reads its version from the
# installed metadata. (PYTHONPATH still points at the sources: benchmarks/device.sh.)
# torchtitan 0.3.0 needs torch>=2.12 (torch.distributed.fsdp.DataParallelMeshDims): on a torch 2.11 image its
# wheels install (--no-deps) but do not import, and magi_attention_torchtitan's ImportError says which torch it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.intwheels
PY=${PYTHON:-python3}
# versions: the integrations' pins (integrations/*/pyproject.toml), the rest as pip resolves torchtitan 0.3.0
THIRD_PARTY=(
  megatron-core==0.16.1 torchtitan==0.3.0 spmd-types==0.2.3 torchdata==0.11.0 torch-checkpointing==0.1.0
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)

prepare() {
  rm -rf "$DIR" && mkdir -p "$DIR"
  grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >>"$(git rev-parse --git-path info/exclude)"
  local platform_args=()
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" -d "$DIR" "${THIRD_PARTY[@]}"
  for int in integrations/*/; do
    "$PY" -m pip wheel -q --no-deps -w "$DIR" "$int"
  done
  ls -la "$DIR"
  local kib
  kib=$(du -sk "$DIR" | cut -f1)
  echo "total: $(( kib / 1024 )).$(( (kib % 1024) * 10 / 1024 )) MiB in $(ls "$DIR" | wc -l) wheels (one device call carries 64 MiB)"
  if [ "$kib" -gt $(( 40 * 1024 )) ]; then echo "too large to carry beside the project" >&2; exit 1; fi
}

install() {
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$DIR"/*.whl
  "$PY" - <<'PY'
from importlib.metadata import version
import torch
print("torch", torch.__version__, "| " + ", ".join(
    f"{d} {version(d)}" for d in ("transformers", "megatron-core", "torchtitan", "datasets", "tyro")))
PY
}

case ${1:-} in
  prepare) prepare ;;
  install) install ;;
  *) echo "usage: $0 prepare|install" >&2; exit 2 ;;
esac
