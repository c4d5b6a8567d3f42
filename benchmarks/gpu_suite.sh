#!/usr/bin/env bash
# The GPU test suite in one command (device machine, repo root): bash benchmarks/gpu_suite.sh
# Needs flash-attn-4 for the FA4 parts (`bash benchmarks/fast_path_device.sh install` brings it from the
# wheels; without it those steps fail and say so). With one GPU: both FFA backends' kernel tests, mask_mod -> slices, and the
# runtime at cp 1 + simulated cp; with N >= 2 GPUs also the runtime over NCCL at cp N (bf16 against dense
# fp64, every mask family, degrees 0-2 and dynamic, FA4 and Triton; head_dim 64 and 256, uneven shards, native
# group collectives) and GroupCast / GroupReduce (all-to-all-v and native) over NCCL against gloo. Prints a summary table last; exits 1 if any step failed. Logs go to $OUT
# (or /tmp). GPU_SUITE_ONLY=<regex> runs only the steps whose name matches (to split the suite across calls).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/root/fa4_cache
export PYTHONPATH=packages/mask/src:packages/solver/src:packages/ffa/src:packages/ffa_fa4/src:packages/group_collective/src:packages/magi_attention/src:${PYTHONPATH:-}
NGPU=$(nvidia-smi -L | wc -l)
SUMMARY=()
ONLY=${GPU_SUITE_ONLY:-}
step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  if [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]]; then return; fi
  local t0=$SECONDS log="$OUT/$(echo "$name" | tr -c 'a-zA-Z0-9' '_').log"
  echo "=== $name"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  tail -3 "$log"
  SUMMARY+=("$(printf '%-44s %-5s %4ss' "$name" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" $((SECONDS - t0)))")
}
step "magi-ffa Triton kernels (1 GPU)" 400 python3 -m pytest -q -p no:cacheprovider packages/ffa/tests
step "magi-ffa-fa4 kernels (1 GPU)" 400 python3 -m pytest -q -p no:cacheprovider packages/ffa_fa4/tests
step "native group collectives, simulated ranks (1 GPU)" 240 python3 -m pytest -q -p no:cacheprovider \
  packages/group_collective/tests/test_native.py
step "mask_mod -> slices on the GPU (compiled pass)" 240 python3 -m pytest -q -p no:cacheprovider \
  packages/magi_attention/tests/test_mask_mod.py -k cuda
step "runtime cp 1 + simulated cp 4, 8 (1 GPU)" 400 torchrun --standalone --nproc-per-node 1 \
  benchmarks/gpu_runtime_check.py --out "$OUT/check_cp1.json"
if [ "$NGPU" -ge 2 ]; then
  step "runtime over NCCL, cp $NGPU" 400 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_runtime_check.py --out "$OUT/check_cp$NGPU.json"
  step "runtime head_dim 64 (FA4, Triton), cp $NGPU" 300 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_runtime_check.py --head-dim 64 --degrees 0,dynamic --out "$OUT/check_cp${NGPU}_d64.json"
  step "runtime head_dim 256 (Triton), cp $NGPU" 300 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_runtime_check.py --head-dim 256 --backends triton --degrees 0,dynamic --out "$OUT/check_cp${NGPU}_d256.json"
  step "runtime uneven_shard, cp $NGPU" 300 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_runtime_check.py --uneven-shard --tokens 4000 --degrees 0,dynamic
  step "runtime with native group collectives, cp $NGPU" 400 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_runtime_check.py --grpcoll native --out "$OUT/check_cp${NGPU}_native.json"
  step "GroupCast/GroupReduce native == a2av == gloo" 240 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_group_collective_check.py --impl native --seeds 20 --big-seeds 2
  step "GroupCast/GroupReduce NCCL == gloo, $NGPU GPUs" 200 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_group_collective_check.py
fi
echo
echo "gpu_suite: $NGPU GPU(s), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
printf '%s\n' "${SUMMARY[@]}"
! printf '%s\n' "${SUMMARY[@]}" | grep -q FAIL
