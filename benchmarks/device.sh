#!/usr/bin/env bash
# The GPU runs, phase by phase (the device machine, repository root; one or more H200s):
#   bash benchmarks/device.sh PHASE [PHASE ...]        e.g. bash benchmarks/device.sh install gpu-tests kernels
# Setup:    park (first call of a fresh machine: the first half of the FA4 wheels, carry .fa4/a)
#           install (next call: the FA4 wheels, carry .fa4/b; and .whl/ with hatchling and its requirements for
#           the editable install of our packages, e.g. pip download -d .whl hatchling packaging pathspec pluggy
#           trove-classifiers; without them the phases run this checkout from source through PYTHONPATH)
#           install-integrations (the wheels of benchmarks/integration_wheels.sh, carry .intwheels)
# Checks:   gpu-tests (python -m pytest -m gpu, as docs/development.md says; GPU_TESTS_K=<expr> selects,
#           GPU_TESTS_ARGS adds pytest arguments, e.g. "-n 8 -p no:benchmark" for pytest-xdist, docs/development.md)
#           info (python -m magi_attention.info --check --bench)
# Kernels:  kernels (every backend interleaved, d 128; SEQLENS, HEAD_DIMS, MASKS, KERNELS, REP, REPEATS, TAG
#           override; PROFILE=1 adds each runner's torch.profiler table, kernels_profile.txt)
#           kernels-det (deterministic against default backward, + the busiest rank of simulated cp 8)
#           layer-step (a 32-layer attention-only step: kernel API and calc_attn beside FA4's and cuDNN's own
#           calls, same mask and a new mask every step; LAYER_SEQLENS, default 8192,32768)
#           fa4-versions (magi_ffa_fa4 and FA4 native on flash-attn-4 4.0.0b36, installed, against 4.0.0b40,
#           carried as a wheel in .fa4/b40: 3 interleaved rounds of the kernels case per release at 8k and
#           32k on packed documents / causal / window, the table of the fa4-versions case, then the
#           package's GPU tests on 4.0.0b40 unless FA4_VERSIONS_TESTS=0; prepare here: pip download --no-deps
#           -d .fa4/b40 flash-attn-4==4.0.0b40), fa4-b40-tests (those tests alone, for a second call)
# Runtime:  mask-loop (a new mask every step), mask-loop-profile (the slow steps' torch.profiler tables;
#           LOOP_BACKENDS, LOOP_CPS), first-step (first step against steady step, cold and warm;
#           the breakdown of a fresh process from launch for auto, fa4, cudnn)
#           sim (simulated cp ranks on one GPU, auto beside each backend), scaling (the scaling table;
#           TOKENS, SCALING_MASKS, SCALING_CPS, SINGLE, DISPATCH_ALGS, KERNEL (the ranks' backend, auto) override)
#           cp (the cp case over every GPU, 16k tokens per GPU, 64:8; CP_ARGS adds arguments)
#           grpcoll (GroupCast / GroupReduce bandwidth, native and all-to-all-v; 2+ GPUs)
#           checks-overhead (the status agreement of every call, NCCL at cp 2 and cp 1)
#           calibrate (the overlap cost model's profile per kernel backend, on every GPU, to $OUT/calibration)
# Models:   hf | hf-deterministic | fsdp | megatron | torchtitan (benchmarks/integration_runs, bf16, world 1)
# Every phase runs `python -m benchmarks <case>` (python -m benchmarks lists them); the probes of one
# investigation (rank-ncu, det-ncu, dq-order) are kept at git tag benchmark-probes-2026-12-03.
# Results go to $OUT (each phase its files), every command's output to $OUT/device.log; the integration runs'
# reports close a call that ran one, as a table. Exits 1 if a phase failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/magi_device_out}
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OMP_NUM_THREADS=4
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=/root/fa4_cache
# this checkout's sources first (installed integration wheels provide only their metadata)
PYTHONPATH=$(ls -d "$PWD"/packages/*/src "$PWD"/integrations/*/src 2>/dev/null | tr '\n' ':')${PYTHONPATH:-}
export PYTHONPATH
NGPU=$(nvidia-smi -L | wc -l)
LOG=$OUT/device.log
FAILED=()
say() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
run() {  # limit_s command...: logged, the tail shown, a failure remembered
  local limit=$1; shift
  say "+ $*"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | grep -v '^{' | tail -40
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { FAILED+=("$PHASE (exit $rc)"); say "exit $rc"; }
}

phase_park() { mkdir -p ~/.cache/fa4 && cp .fa4/a/* ~/.cache/fa4/ && ls -la ~/.cache/fa4; }
phase_install() {
  if ! python3 -c "import flash_attn.cute" 2>/dev/null; then
    local sp
    sp=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cat ~/.cache/fa4/cu13.part.* .fa4/b/cu13.part.* | xz -dc | tar x -C "$sp"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .fa4/b/*.whl
  fi
  python3 -c "import pytest, hypothesis" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl
  run 60 python3 -c "import flash_attn.cute, cudnn.flex_attention, torch, triton; print('FA4 and cuDNN ready; torch', torch.__version__, 'triton', triton.__version__)"
  # our packages as docs/development.md installs them (no index here: the vendors above are already in place)
  run 180 python3 scripts/install.py --editable fa4 cudnn transformers -- --no-index --no-deps --find-links .whl
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
}
phase_install-integrations() {
  run 120 bash benchmarks/integration_wheels.sh install
  run 60 python3 -c "import torchtitan, magi_attention_torchtitan, torch; print('torchtitan imports on torch', torch.__version__)"
}

phase_gpu-tests() {  # as documented: TRITON_INTERPRET unset (each conftest decides by the CUDA device), and
  # the installed packages rather than PYTHONPATH when the install phase installed them
  local unset=(-u TRITON_INTERPRET)
  env -u PYTHONPATH python3 -c "import magi_attention, magi_ffa_fa4, magi_ffa_cudnn" 2>/dev/null && unset+=(-u PYTHONPATH)
  run "${TEST_S:-590}" env "${unset[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider --basetemp "$OUT/gpu_tests" \
    --junitxml "$OUT/gpu_tests.xml" ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} ${GPU_TESTS_ARGS:-}
}
phase_info() { run 400 python3 -m magi_attention.info --check --bench; }

phase_kernels() {
  run "${BENCH_S:-560}" python3 -m benchmarks kernels --seqlens "${SEQLENS:-8192,32768}" --head-dims "${HEAD_DIMS:-128}" \
    --masks "${MASKS:-full,varlen_causal,swa_causal_w1024,varlen_block_causal,random}" --rep "${REP:-25}" \
    ${KERNELS:+--kernels "$KERNELS"} ${REPEATS:+--repeats "$REPEATS"} ${PROFILE:+--profile "$OUT/kernels_profile.txt"} --out-dir "$OUT" --tag "${TAG:-kernels_d128}"
}
phase_layer-step() {
  run "${BENCH_S:-560}" python3 -m benchmarks layer-step --seqlens "${LAYER_SEQLENS:-8192,32768}" \
    --out-dir "$OUT" --tag "${TAG:-layer_step}"
}
phase_kernels-det() {
  run "${BENCH_S:-560}" python3 -m benchmarks kernels --deterministic --sim-cp 8 --repeats 3 --out-dir "$OUT" --tag det
}

FA4_B40=/tmp/fa4_b40  # flash-attn-4 4.0.0b40 (pure Python): its own --target folder, first on PYTHONPATH
fa4_b40_install() {
  [ -d "$FA4_B40/flash_attn" ] ||
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$FA4_B40" .fa4/b40/*.whl
}
phase_fa4-versions() {
  local dir="$OUT/fa4_versions" r v
  fa4_b40_install
  mkdir -p "$dir"
  declare -A path=([b36]="$PYTHONPATH" [b40]="$FA4_B40:$PYTHONPATH")
  for v in b36 b40; do
    run 120 env PYTHONPATH="${path[$v]}" python3 -c "import flash_attn.cute, magi_ffa_fa4._fa4_version as f
print('$v:', f.installed(), flash_attn.cute.__file__)"
  done
  for r in 1 2 3; do
    for v in b36 b40; do
      run "${BENCH_S:-500}" env PYTHONPATH="${path[$v]}" python3 -m benchmarks kernels \
        --seqlens 8192,32768 --masks varlen_causal,causal,swa_causal_w2048 --kernels ffa_fa4,fa4 \
        --repeats "${REPEATS:-3}" --out-dir "$dir" --tag "${v}_r$r"
    done
  done
  run 60 python3 -m benchmarks fa4-versions "$dir"
  [ "${FA4_VERSIONS_TESTS:-1}" = 0 ] || phase_fa4-b40-tests
}
phase_fa4-b40-tests() {
  fa4_b40_install
  run "${TEST_S:-590}" env -u TRITON_INTERPRET PYTHONPATH="$FA4_B40:$PYTHONPATH" python3 -m pytest -m gpu -q \
    -p no:cacheprovider --basetemp "$OUT/fa4_b40_tests" --junitxml "$OUT/fa4_b40_gpu_tests.xml" packages/ffa_fa4
}

phase_mask-loop() {  # the seven kinds in turn, then a training loop's packs (one kind, the same area)
  run "${BENCH_S:-500}" python3 -m benchmarks mask-loop --out-dir "$OUT"
  local kind
  for kind in docs_causal random; do
    run "${BENCH_S:-500}" python3 -m benchmarks mask-loop --kinds "$kind" --same-area --literal \
      --out-dir "$OUT/same_area_$kind"
  done
}
phase_mask-loop-profile() {  # the steps that miss 1.5x the median, profiled (FA4 at simulated cp 8 by default)
  run "${BENCH_S:-400}" python3 -m benchmarks mask-loop --backends "${LOOP_BACKENDS:-fa4}" --cps "${LOOP_CPS:-8}" \
    --kinds docs_causal --same-area --literal --profile "$OUT/mask_loop_profile.txt" --out-dir "$OUT/mask_loop_profile"
}
phase_first-step() { run "${BENCH_S:-590}" python3 -m benchmarks first-step --out-dir "$OUT"; }
phase_sim() {
  run "${BENCH_S:-560}" python3 -m benchmarks sim --kernel-backend "${SIM_BACKENDS:-auto,fa4,cudnn}" \
    --simulate-explicit --tokens-per-gpu 8192 --cps "${SIM_CPS:-8,32}" --masks "${SIM_MASKS:-varlen_causal,varlen_full}" \
    --degree 0 --no-single --no-cp1 --json "$OUT/sim.json"
}
phase_scaling() {
  run "${BENCH_S:-590}" python3 -m benchmarks sim --tokens-per-gpu "${TOKENS:-8192}" --cps "${SCALING_CPS:-8,16,32,64}" \
    --masks "${SCALING_MASKS:-full,causal,varlen_full,varlen_causal,video_block_causal}" --degree 0 --kernel-backend "${KERNEL:-auto}" \
    --single-backend "${SINGLE:-fa4}" --no-cp1 --single-max-tokens 131072 --scaling --json "$OUT/scaling_${TOKENS:-8192}.json" \
    --dispatch-algs "${DISPATCH_ALGS:-default}" \
    --profile "$OUT/profile_${TOKENS:-8192}.txt"
}
phase_cp() {
  local extra=()
  read -r -a extra <<< "${CP_ARGS:-}"
  run "${BENCH_S:-560}" torchrun --standalone --nproc-per-node "$NGPU" -m benchmarks cp \
    --tokens-per-gpu 16384 --heads 64:8 --iters 10 --warmup 3 --out "$OUT/cp_bench" "${extra[@]}"
}
phase_grpcoll() {
  [ "$NGPU" -ge 2 ] || { say "grpcoll needs 2+ GPUs; skipped"; return; }
  run 240 torchrun --standalone --nproc-per-node "$NGPU" -m benchmarks grpcoll --gpu-bandwidth \
    --sizes-mb 8,64,512 --json "$OUT/bandwidth.json"
}

phase_checks-overhead() {
  local n
  for n in 2 1; do
    [ "$NGPU" -ge "$n" ] || continue
    run 400 torchrun --standalone --nproc-per-node "$n" -m benchmarks checks-overhead --agreement \
      --heads 32 --dtype bf16 --iters 20 --rounds 5
  done
}

phase_calibrate() {
  run 300 torchrun --standalone --nproc-per-node "$NGPU" -m benchmarks calibrate --out-dir "$OUT/calibration"
}

integration() { run "${PHASE_S:-150}" python3 -m benchmarks "$1"; INTEGRATIONS=1; }
phase_hf() { integration hf; }
phase_hf-deterministic() { CUBLAS_WORKSPACE_CONFIG=:4096:8 integration hf-deterministic; }
phase_fsdp() { integration fsdp; }
phase_megatron() { integration megatron; }
phase_torchtitan() { integration torchtitan; }
integration_table() {
  python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys
from pathlib import Path

print(f"\n{'run':<16} {'kernel':<7} {'loss0 |d|':>9} {'max |d|':>9} {'grad rel':>9} {'tok/s magi':>11} {'tok/s ref':>10} {'x':>5}  checks")
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    report = json.loads(path.read_text())
    for r in report.get("runs", []) if isinstance(report, dict) else []:
        if "checks" not in r:
            continue
        verdict = "PASS" if all(v == "PASS" for v in r["checks"].values()) else "MISS"
        print(f"{r['name']:<16} {r.get('kernel_backend', '?'):<7} {r['loss_abs_diff'][0]:>9.2e} {max(r['loss_abs_diff']):>9.2e} "
              f"{r['grad_rel_err_step0']:>9.2e} {r['tokens_per_s_magi']:>11,.0f} {r['tokens_per_s_ref']:>10,.0f} "
              f"{r['tokens_per_s_magi'] / r['tokens_per_s_ref']:>5.2f}  {verdict}")
PY
}

[ $# -gt 0 ] || { awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 2; }
for PHASE in "$@"; do
  declare -F "phase_$PHASE" >/dev/null || { echo "unknown phase $PHASE" >&2; exit 2; }
done
INTEGRATIONS=0
for PHASE in "$@"; do
  say "=== $PHASE (GPUs: $NGPU)"
  "phase_$PHASE"
done
[ "$INTEGRATIONS" -eq 0 ] || integration_table
say "done${FAILED[*]:+; failed: ${FAILED[*]}}"
[ ${#FAILED[@]} -eq 0 ]
