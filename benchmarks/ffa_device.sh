#!/usr/bin/env bash
# The Triton FFA on one GPU (device machine, repo root): the GPU tests (kernels at realistic sizes, the shipped
# tile table of every head_dim against dense fp64, bitwise repeatability), then per head_dim a tile sweep and
# the final table beside FlexAttention and cuDNN (benchmarks/ffa_tile_sweep.py). Results go to $OUT.
#   bash benchmarks/ffa_device.sh [tests] [d64] [d128] [d256]     (default: all four)
# Each sweep pair is "FWD/BWD" tiles as MAGI_FFA_TILES_FWD / MAGI_FFA_TILES_BWD take them; the first pair of
# each list is the shipped table row, so the sweep shows what the alternatives would change.
set -uo pipefail
OUT=${OUT:-/tmp/ffa_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
export PYTHONPATH=packages/mask/src:packages/solver/src:packages/ffa/src:${PYTHONPATH:-}
S=benchmarks/ffa_tile_sweep.py
FINAL=full,causal,varlen_causal,swa_causal_w1024,varlen_block_causal,random
PHASES=${*:-tests d64 d128 d256}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for phase in $PHASES; do
  case $phase in
    tests) timeout 400 python3 -m pytest -q -p no:cacheprovider packages/ffa/tests ${FFA_TESTS_K:+-k "$FFA_TESTS_K"} 2>&1 |
      tail -4 | tee "$OUT/tests.log" ;;
    d128) timeout 500 python3 $S --d 128 --out "$OUT/sweep_d128.json" --final-masks $FINAL \
      --masks ${SWEEP_MASKS:-full,causal,varlen_causal} \
      --pairs "128,128,8,3,1/64,128,128,64,8,3,1,0;128,128,8,3,1/64,128,128,64,8,3,1,1;128,128,8,3,1/64,128,128,64,8,3,0,1" \
      2>&1 | grep -v '^{' | tail -9 ;;
    d64) timeout 400 python3 $S --d 64 --out "$OUT/sweep_d64.json" --masks full,varlen_causal --final-masks $FINAL \
      --pairs "128,64,4,3,1/64,64,64,64,4,3,1,0;128,64,4,3,1/64,128,128,64,8,3,1,0;128,64,4,3,1/64,128,128,64,8,3,1,1" \
      2>&1 | grep -v '^{' | tail -9 ;;
    d256) timeout 400 python3 $S --d 256 --out "$OUT/sweep_d256.json" --masks full,varlen_causal --final-masks $FINAL \
      --pairs "64,32,4,2,1/32,32,32,32,4,2,1,0;64,32,4,2,1/32,32,32,32,4,2,1,1" 2>&1 | grep -v '^{' | tail -9 ;;
    *) echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
