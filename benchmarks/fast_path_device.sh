#!/usr/bin/env bash
# GPU runs of the runtime's fast path, in phases (the device machine, repo root; one or two H200s):
#   bash benchmarks/fast_path_device.sh park                 first call of a fresh machine (carry .fa4/a)
#   bash benchmarks/fast_path_device.sh install tests calib  next call (carry .fa4/b and .whl)
#   bash benchmarks/fast_path_device.sh bench16 | bench32 | sim | profile | headdims
#   bash benchmarks/fast_path_device.sh kernel_tests | cudnn_tests | hostprof | kernels | kernels256 | plans
#   bash benchmarks/fast_path_device.sh fa4prof | fa4ncu | stages | autosim
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
export PYTHONPATH=packages/mask/src:packages/solver/src:packages/ffa/src:packages/ffa_fa4/src:packages/ffa_cudnn/src:packages/group_collective/src:packages/magi_attention/src:${PYTHONPATH:-}
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
  python3 -c "import cudnn.flex_attention; print('cudnn flex_attention ready')" 2>&1 | tail -1 | tee -a "$LOG"
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
  run 420 python3 -m benchmarks.magi_attention_bench --kernel-backend fa4 --tokens-per-gpu 8192 \
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

# -- the kernel backends (magi-ffa-cudnn beside magi-ffa-fa4, FA4 native, cuDNN's own flex_attention) --------
phase_kernel_tests() {
  run 420 python3 -m pytest -q -p no:cacheprovider -x packages/ffa_cudnn/tests packages/ffa_fa4/tests \
    packages/ffa/tests/test_intervals.py
}
phase_kernels() {  # d 128, 8k and 32k, every backend interleaved
  local masks=${MASKS:-full,varlen_causal,swa_causal_w1024,varlen_block_causal,random}
  run "${BENCH_S:-560}" python3 -m benchmarks.kernel_backends_bench --seqlens "${SEQLENS:-8192,32768}" \
    --d "${HEAD_DIMS:-128}" --masks "$masks" --rep "${REP:-25}" \
    --kernels "${KERNELS:-ffa_cudnn,cudnn_flex,cudnn_varlen,ffa_fa4,fa4,flex}" --out-dir "$OUT" --tag "${TAG:-kernels_d128}"
}
phase_kernels256() {  # d 256 (cuDNN and FlexAttention and the Triton kernel; FA4 stops at 128)
  run "${BENCH_S:-400}" python3 -m benchmarks.kernel_backends_bench --seqlens 8192,32768 --d 256 \
    --masks full,varlen_causal,random --kernels ffa_cudnn,cudnn_flex,flex,ffa --out-dir "$OUT" --tag kernels_d256
}
phase_cudnn_tests() {  # the cuDNN backend's GPU tests (cached launches included)
  run "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -x packages/ffa_cudnn/tests/test_cudnn_gpu.py
}
phase_hostprof() {  # host time against device time per call at 8k (our wrappers beside the kernels they wrap)
  run "${BENCH_S:-240}" python3 -m benchmarks.kernel_host_profile --seqlen 8192 --cprofile "${CPROFILE:-12}" \
    --masks "${MASKS:-varlen_causal,varlen_full,swa_causal_w1024,varlen_block_causal,full}" \
    --kernels "${KERNELS:-ffa_cudnn,cudnn_flex,ffa_fa4,fa4}" --out "$OUT/host_profile.json"
}
phase_plans() {
  run 300 python3 -m benchmarks.kernel_backends_bench --plan-times 8192,32768,1048576 --out-dir "$OUT" --tag plans
}
phase_fa4prof() {  # the FA4 backend's backward and its degree-1 stages beside FA4 native (torch.profiler)
  run 300 python3 benchmarks/fa4_bwd_profile.py --what kernels --tokens "${PROF_TOKENS:-32768}" \
    --masks varlen_causal,swa_causal_w2048,full --out "$OUT/fa4_bwd_kernels.json"
  run 200 python3 benchmarks/fa4_bwd_profile.py --what stages --tokens 8192 --cp 8 --masks varlen_causal \
    --out "$OUT/fa4_stages.json"
}
phase_stages() {  # simulated cp 8, 8k tokens per GPU: the slowest rank at degree 0 and 1, per backend
  local b deg
  for b in ${STAGE_BACKENDS:-fa4 cudnn}; do
    for deg in 0 1; do
      run 200 python3 -m benchmarks.magi_attention_bench --kernel-backend "$b" --tokens-per-gpu 8192 --cps 8 \
        --masks "${STAGE_MASKS:-varlen_causal,full}" --degree "$deg" --no-single --no-cp1 --json "$OUT/stages_${b}_deg$deg.json" \
        | grep -v '^{' | tail -8
    done
  done
}
phase_autosim() {  # simulated cp (8k tokens per GPU, degree 0): auto beside each explicit backend, slowest rank
  run "${SIM_S:-600}" python3 -m benchmarks.magi_attention_bench --kernel-backend "${SIM_BACKENDS:-auto,fa4,cudnn}" \
    --tokens-per-gpu 8192 --cps "${SIM_CPS:-8,32}" --masks "${SIM_MASKS:-varlen_causal,varlen_full}" --degree 0 \
    --no-single --no-cp1 --json "$OUT/sim_auto.json" | grep -v '^{' | tail -12
}
phase_fa4ncu() {  # Nsight Compute on both backward kernels (varlen causal and sliding window, 32k)
  run 420 ncu --clock-control none --profile-from-start off --target-processes all \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --csv --page details python3 benchmarks/fa4_bwd_profile.py --what kernels --ncu \
    --masks varlen_causal,swa_causal_w2048 > "$OUT/fa4_ncu.csv" 2>&1
  tail -5 "$OUT/fa4_ncu.csv"
}

read -r -a BENCH_ARGS <<< "${BENCH_ARGS:-}"
for phase in "$@"; do
  say "=== $phase (GPUs: $NGPU)"
  "phase_$phase"
done
say "done"
