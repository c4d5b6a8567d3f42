#!/usr/bin/env bash
# Native group collectives on the device machine (repo root, 2+ GPUs of one node): correctness, then bandwidth.
#
#   bash benchmarks/native_grpcoll_device.sh          # (a) + (b), about 2-3 minutes; short table last
#   bash benchmarks/native_grpcoll_device.sh e2e      # also (c): the runtime end to end with native
#
# (a) the native kernels compiled on one GPU with every rank simulated in one process (pytest), then
#     GroupCast / GroupReduce native against all-to-all-v over NCCL and against gloo + the references on
#     random tables (cast bit-exact, reduce sum / avg / lse to 1e-5, a second native run bitwise equal),
#     including tables of tens of MB per rank (the symmetric buffer grows);
# (b) effective bandwidth of native and all-to-all-v at 8, 64 and 512 MiB per rank (bf16), with a plain
#     NCCL all_to_all_single for reference;
# (c) (with `e2e`) benchmarks/gpu_runtime_check.py with native group collectives, and the cp benchmark's
#     magi rows (--systems magi) with native and with all-to-all-v, one table each.
# NVLink multicast stays off. Logs in $OUT (default /tmp/native_grpcoll); exits 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/native_grpcoll}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
export PYTHONPATH=packages/mask/src:packages/solver/src:packages/ffa/src:packages/ffa_fa4/src:packages/group_collective/src:packages/magi_attention/src:${PYTHONPATH:-}
NGPU=$(nvidia-smi -L | wc -l)
SUMMARY=()
logname() { printf '%s/%s.log' "$OUT" "$(printf '%s' "$1" | tr -c 'a-zA-Z0-9' '_')"; }
step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS log
  log=$(logname "$name")
  echo "=== $name"
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  tail -4 "$log"
  SUMMARY+=("$(printf '%-52s %-5s %4ss' "$name" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" $((SECONDS - t0)))")
}
python3 -c "import cuda.bindings, sys; print('cuda-bindings', cuda.bindings.__version__)" ||
  echo "cuda-bindings is missing: pip install 'cuda-bindings>=13,<14' (the native extra)"

step "native kernels, simulated ranks (1 GPU)" 240 python3 -m pytest -q -p no:cacheprovider \
  packages/group_collective/tests/test_native.py
if [ "$NGPU" -ge 2 ]; then
  step "native == a2av == gloo, $NGPU GPUs" 240 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/gpu_group_collective_check.py --impl native --seeds 20 --big-seeds 2
  step "bandwidth native vs a2av, $NGPU GPUs" 240 torchrun --standalone --nproc-per-node "$NGPU" \
    benchmarks/group_collective_bench.py --gpu-bandwidth --sizes-mb 8,64,512 --json "$OUT/bandwidth.json"
  if [ "${1:-}" = "e2e" ]; then
    step "runtime over NCCL with native, cp $NGPU" 500 torchrun --standalone --nproc-per-node "$NGPU" \
      benchmarks/gpu_runtime_check.py --grpcoll native --out "$OUT/runtime_native.json"
    for g in native a2av; do
      step "cp_bench magi, group collectives $g" 500 torchrun --standalone --nproc-per-node "$NGPU" \
        benchmarks/cp_bench.py --systems magi --grpcoll "$g" --tokens-per-gpu 16384 --out "$OUT/cp_$g"
    done
  fi
else
  SUMMARY+=("only $NGPU GPU: the multi-GPU steps did not run")
fi
echo
BW=$(logname "bandwidth native vs a2av, $NGPU GPUs")
[ -f "$BW" ] && grep -E '^(group collective bandwidth|\|)' "$BW"
for g in native a2av; do
  [ -f "$OUT/cp_$g.md" ] && { echo; echo "cp_bench, group collectives $g:"; cat "$OUT/cp_$g.md"; }
done
echo
echo "native_grpcoll_device: $NGPU GPU(s), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
printf '%s\n' "${SUMMARY[@]}"
! printf '%s\n' "${SUMMARY[@]}" | grep -q FAIL
