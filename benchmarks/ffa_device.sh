#!/usr/bin/env bash
# One H200 call: GPU correctness (the Triton test grid at 8x the CPU sizes), a small tile sweep, then the
# benchmark with the best tiles. Usage (device machine, repo root): bash benchmarks/ffa_device.sh [masks] [seqlens] [heads]
set -uo pipefail
OUT=${OUT:-/tmp/ffa_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=packages/ffa/src:${PYTHONPATH:-}
LOG=$OUT/ffa_device.log
MASKS=${1:-all}; [ "$MASKS" = all ] && MASKS=full,causal,varlen_full,varlen_causal,swa_causal_w1024,swa_causal_w4096,varlen_block_causal,random
SEQ=${2:-32768}; HEADS=${3:-64:8}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
if ! python3 -c "import pytest" 2>/dev/null && [ -d .ffa_whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .ffa_whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
t0=$(date +%s)
timeout ${PYTEST_S:-170} python3 -m pytest packages/ffa/tests/test_triton.py packages/ffa/tests/test_triton_bwd_fused.py -q -p no:cacheprovider 2>&1 | tail -15 | tee -a "$LOG"
echo "pytest: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
# fused backward (not yet the default) against the split one, same process settings
for impl in split fused; do
  MAGI_FFA_BWD_IMPL=$impl timeout ${FUSED_S:-90} python3 benchmarks/ffa_bench.py --kernels ffa --masks full,causal,varlen_causal \
    --seqlens 32768 --heads 64:8 --out-dir /tmp/bwd_$impl 2>&1 | grep '^{' | sed "s/^/bwd_impl=$impl /" | tee -a "$LOG"
done
# tile sweep: fwd BM,BN,warps,stages | dq | dkv  (32k, 64:8, full + causal)
best=""; bestv=0
for cfg in "128,64,8,3|64,64,8,2|32,64,8,2" "128,32,8,3|128,32,8,2|32,128,8,2" "128,128,8,3|128,64,8,2|64,64,8,2"; do
  IFS='|' read -r F Q K <<< "$cfg"
  t1=$(date +%s)
  res=$(MAGI_FFA_TILES_FWD=$F MAGI_FFA_TILES_DQ=$Q MAGI_FFA_TILES_DKV=$K timeout ${SWEEP_S:-70} python3 benchmarks/ffa_bench.py \
        --kernels ffa --masks full,causal --seqlens 32768 --heads 64:8 --out-dir /tmp/sweep 2>&1 | grep '^{')
  echo "sweep $cfg ($(( $(date +%s) - t1 )) s): $res" | tee -a "$LOG"
  v=$(python3 -c "import json,sys; r=[json.loads(l) for l in sys.argv[1].splitlines() if 'fwd_tflops' in l]; print(sum(x['fwd_tflops']+x['bwd_tflops'] for x in r) if len(r)==2 else 0)" "$res")
  if python3 -c "import sys; sys.exit(0 if float('$v') > float('$bestv') else 1)"; then best=$cfg; bestv=$v; fi
done
echo "best tiles: $best ($bestv)" | tee -a "$LOG"
IFS='|' read -r F Q K <<< "${best:-128,64,8,3|64,64,8,2|32,64,8,2}"
MAGI_FFA_TILES_FWD=$F MAGI_FFA_TILES_DQ=$Q MAGI_FFA_TILES_DKV=$K timeout ${BENCH_S:-280} python3 benchmarks/ffa_bench.py \
  --masks "$MASKS" --seqlens "$SEQ" --heads "$HEADS" --kernels ffa,flex,sdpa_cudnn,sdpa_flash,ffa_fa4,fa4 --out-dir "$OUT" 2>&1 | tee -a "$LOG" | tail -25
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$LOG"
