#!/usr/bin/env bash
# The GPU test suite in one command (device machine, repo root): bash benchmarks/gpu_suite.sh
# Needs flash-attn-4 for the FA4 parts (`bash benchmarks/fast_path_device.sh install` brings it from the
# wheels; without it those steps fail and say so). With one GPU: both FFA backends' kernel tests and the
# runtime at cp 1 + simulated cp; with N >= 2 GPUs also the runtime over NCCL at cp N (bf16 against dense
# fp64, every mask family, degrees 0-2 and dynamic, FA4 and Triton) and GroupCast / GroupReduce over NCCL
# against gloo. Prints a summary table last; exits 1 if any step failed. Logs go to $OUT (or /tmp).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/root/fa4_cache
export PYTHONPATH=packages/mask/src:packages/solver/src:packages/ffa/src:packages/ffa_fa4/src:packages/group_collective/src:packages/magi_attention/src:${PYTHONPATH:-}
NGPU=$(nvidia-smi -L | wc -l)
SUMMARY=()
step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS log="$OUT/$(echo "$name" | tr -c 'a-zA-Z0-9' '_').log"
  echo "=== $name"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  tail -3 "$log"
  SUMMARY+=("$(printf '%-44s %-5s %4ss' "$name" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" $((SECONDS - t0)))")
}
step "magi-ffa Triton kernels (1 GPU)" 400 python3 -m pytest -q -p no:cacheprovider packages/ffa/tests
step "magi-ffa-fa4 kernels (1 GPU)" 400 python3 -m pytest -q -p no:cacheprovider packages/ffa_fa4/tests
step "runtime cp 1 + simulated cp 4, 8 (1 GPU)" 400 torchrun --standalone --nproc-per-node 1 \
  benchmarks/gpu_runtime_check.py --out "$OUT/check_cp1.json"
if [ "$NGPU" -ge 2 ]; then
  step "runtime over NCCL, cp $NGPU" 400 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_runtime_check.py --out "$OUT/check_cp$NGPU.json"
  step "GroupCast/GroupReduce NCCL == gloo, $NGPU GPUs" 200 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_group_collective_check.py
fi
echo
echo "gpu_suite: $NGPU GPU(s), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
printf '%s\n' "${SUMMARY[@]}"
! printf '%s\n' "${SUMMARY[@]}" | grep -q FAIL
