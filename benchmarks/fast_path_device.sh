#!/usr/bin/env bash
# GPU runs of the runtime's fast path, in phases (the device machine, repo root; one or two H200s):
#   bash benchmarks/fast_path_device.sh park                 first call of a fresh machine (carry .fa4/a)
#   bash benchmarks/fast_path_device.sh install tests calib  next call (carry .fa4/b and .whl)
#   bash benchmarks/fast_path_device.sh bench16 | bench32 | sim | profile | headdims
# flash-attn-4 reaches the machine as wheels split in two halves (see docs/benchmarks/cp.md); every phase
# after `install` needs it. Logs and results go to $OUT (at most 8 files come back), calibrated cost
# profiles to $CALIB, which survives between calls while the machine stays warm.
set -uo pipefail
OUT=${OUT:-/tmp/fast_path_out}
CALIB=${CALIB:-/root/magi_calib}
mkdir -p "$OUT" "$CALIB"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/root/fa4_cache
export PYTHONPATH=packages/solver/src:packages/ffa/src:packages/ffa_fa4/src:packages/group_collective/src:packages/magi_attention/src:${PYTHONPATH:-}
NGPU=$(nvidia-smi -L | wc -l)
LOG=$OUT/device.log
say() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
run() { local limit=$1; shift; say "+ $*"; timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -40; }
trun() { local limit=$1 n=$2; shift 2; run "$limit" torchrun --standalone --nproc-per-node "$n" "$@"; }

phase_park() { mkdir -p ~/.cache/fa4 && cp .fa4/a/* ~/.cache/fa4/ && ls -la ~/.cache/fa4; }

phase_install() {
  if ! python3 -c "import flash_attn.cute" 2>/dev/null; then
    local sp
    sp=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cat ~/.cache/fa4/cu13.part.* .fa4/b/cu13.part.* | xz -dc | tar x -C "$sp"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .fa4/b/*.whl
  fi
  python3 -c "import pytest, hypothesis" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  python3 -c "import flash_attn.cute, torch, triton; print('flash-attn-4 ready; torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
}

phase_tests() {
  run 300 python3 -m pytest -q -p no:cacheprovider packages/ffa_fa4/tests/test_fa4_gpu.py packages/ffa_fa4/tests/test_merge.py
  trun 300 1 benchmarks/gpu_runtime_check.py --out "$OUT/check_cp1.json"
  if [ "$NGPU" -ge 2 ]; then trun 300 "$NGPU" benchmarks/gpu_runtime_check.py --out "$OUT/check_cp$NGPU.json"; fi
}

phase_calib() {
  trun 240 "$NGPU" benchmarks/calibrate_overlap.py --out "$CALIB"
  cp "$CALIB/calibration_fit.json" "$OUT/" 2>/dev/null || true
}

cp_bench() {  # tokens heads extra args...
  local tpg=$1 heads=$2; shift 2
  local prof=()
  [ -f "$CALIB/h200_fa4.json" ] && prof=(env MAGI_ATTENTION_COST_PROFILE="$CALIB/h200_fa4.json")
  run "${BENCH_S:-560}" "${prof[@]}" torchrun --standalone --nproc-per-node "$NGPU" benchmarks/cp_bench.py --tokens-per-gpu "$tpg" \
    --heads "$heads" --iters 10 --warmup 3 --out "$OUT/cp_bench_${tpg}_${heads/:/-}" "$@"
}
phase_final() {  # the remaining comparison rows in one call
  BENCH_S=200 cp_bench 16384 64:8 --masks full,causal,varlen_causal --systems magi,ulysses_cudnn,torch_cp,ulysses_fa4 --degrees 0,1,dynamic
  mv "$OUT/cp_bench_16384_64-8.md" "$OUT/cp16_dense.md"; rm -f "$OUT"/cp_bench_16384_64-8.json
  BENCH_S=90 cp_bench 16384 64:8 --masks varlen_causal --systems magi --degrees dynamic --grad-reduce bf16
  mv "$OUT/cp_bench_16384_64-8.md" "$OUT/cp16_bf16reduce.md"; rm -f "$OUT"/cp_bench_16384_64-8.json
  BENCH_S=170 cp_bench 32768 32:32 --masks full,varlen_causal --systems magi,ulysses_cudnn,ulysses_fa4 --degrees 0,1,dynamic
}
phase_verify() {  # the dynamic degree with the shipped profile
  BENCH_S=150 cp_bench 32768 32:32 --masks full,varlen_causal --systems magi --degrees dynamic
  BENCH_S=90 cp_bench 16384 64:8 --masks varlen_causal,varlen_full --systems magi --degrees dynamic
}
phase_bench16() { cp_bench 16384 64:8 "${BENCH_ARGS[@]}"; }
phase_bench32() { cp_bench 32768 32:32 "${BENCH_ARGS[@]}"; }
phase_sim() {
  run 420 python3 benchmarks/magi_attention_bench.py --kernel-backend fa4 --tokens-per-gpu 8192 \
    --cps "${SIM_CPS:-8,16,32,64}" --masks "${SIM_MASKS:-varlen_causal,varlen_full,full,causal}" --degree 1 \
    --cp1-tokens 32768 --json "$OUT/sim_fa4.json"
}
phase_profile() { cp_bench 16384 64:8 --masks varlen_causal --systems magi --degrees dynamic --profile "$OUT"; }
phase_headdims() {  # the runtime at head_dim 64 and 256 (auto: FA4 at 64, the Triton kernels at 256)
  local d
  for d in 64 256; do
    BENCH_S=260 cp_bench 16384 64:8 --head-dim "$d" --masks full,varlen_causal \
      --systems magi,ulysses_cudnn,ulysses_fa4 --degrees 0,dynamic
    mv "$OUT/cp_bench_16384_64-8.md" "$OUT/cp16_d$d.md"
    mv "$OUT/cp_bench_16384_64-8.json" "$OUT/cp16_d$d.json"
  done
}

read -r -a BENCH_ARGS <<< "${BENCH_ARGS:-}"
for phase in "$@"; do
  say "=== $phase (GPUs: $NGPU)"
  "phase_$phase"
done
say "done"
