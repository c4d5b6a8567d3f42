#!/usr/bin/env bash
# The integration runs on one H200 (the device machine, repo root), after FA4 / cuDNN are installed
# (bash benchmarks/fast_path_device.sh install), in phases:
#   bash benchmarks/integrations_device.sh install hf fsdp megatron torchtitan   (carry .intwheels)
# install: the wheels of benchmarks/integration_wheels.sh (prepared here beforehand) and a torchtitan import
# check; each other phase runs benchmarks/integration_runs/<phase>_run.py (bf16, NCCL world 1, kernel "auto",
# about a minute) and writes $OUT/<phase>.json. Every phase logs to $OUT/integrations.log; a table of the
# JSON reports under $OUT closes the call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/integration_runs_out}
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/root/fa4_cache
# the sources of this checkout first (the installed integration wheels only provide their metadata)
PYTHONPATH=$(ls -d packages/*/src integrations/*/src | tr '\n' ':')${PYTHONPATH:-}
export PYTHONPATH
LOG=$OUT/integrations.log
PHASE_S=${PHASE_S:-150}
say() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
run() { local limit=$1; shift; say "+ $*"; timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -40; say "exit ${PIPESTATUS[0]}"; }

phase_install() {
  run 120 bash benchmarks/integration_wheels.sh install
  run 60 python3 -c "import torchtitan, magi_attention_torchtitan, torch; print('torchtitan imports on torch', torch.__version__)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
}
phase_hf() { run "$PHASE_S" python3 -m benchmarks.integration_runs.hf_run "${RUN_ARGS[@]}"; }
phase_fsdp() { run "$PHASE_S" python3 -m benchmarks.integration_runs.fsdp_run "${RUN_ARGS[@]}"; }
phase_megatron() { run "$PHASE_S" python3 -m benchmarks.integration_runs.megatron_run "${RUN_ARGS[@]}"; }
phase_torchtitan() { run "$PHASE_S" python3 -m benchmarks.integration_runs.torchtitan_run "${RUN_ARGS[@]}"; }

summary() {
  python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys
from pathlib import Path

print(f"\n{'run':<16} {'kernel':<7} {'loss0 |d|':>9} {'max |d|':>9} {'grad rel':>9} {'tok/s magi':>11} {'tok/s ref':>10} {'x':>5}  checks")
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    report = json.loads(path.read_text())
    for r in report.get("runs", []):
        verdict = "PASS" if all(v == "PASS" for v in r["checks"].values()) else "MISS"
        print(f"{r['name']:<16} {r.get('kernel_backend', '?'):<7} {r['loss_abs_diff'][0]:>9.2e} {max(r['loss_abs_diff']):>9.2e} "
              f"{r['grad_rel_err_step0']:>9.2e} {r['tokens_per_s_magi']:>11,.0f} {r['tokens_per_s_ref']:>10,.0f} "
              f"{r['tokens_per_s_magi'] / r['tokens_per_s_ref']:>5.2f}  {verdict}")
PY
}

read -r -a RUN_ARGS <<< "${RUN_ARGS:-}"
for phase in "$@"; do
  say "=== $phase"
  "phase_$phase"
done
summary
say "done"
