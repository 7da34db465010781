#!/usr/bin/env bash
# gemm_pdl_ab.sh: our decode GEMM launched as a programmatic dependent launch (fp8rl_n64_sk4_pdl), alone and in the
# served decode step, in one call on one GPU (after the two install calls of scripts/gpu/env.sh):
#   1. its GPU tests: eager and CUDA-graph outputs bit-identical to the plain launch (tests/gpu/test_block_gemm.py -k
#      prefetch)
#   2. scripts/bench_gemm.py --ms 1,8,16 --prefetch --no-triton: every candidate as a whole linear (SGLang's 1x128
#      quantizer, then the GEMM) under CUDA graphs
#   3. scripts/decode_roofline.py, FP8 weights, Triton attention, bs 1 8 32 x context 4k 12k, twice one after the
#      other: with every server candidate (the load-time selection may choose the dependent launch), then with
#      --fp8rl-gemm-exclude fp8rl_n64_sk4_pdl (the selection of before)
#   4. the rest of tests/gpu/test_block_gemm.py
# A step starts only with its minimum time left before DEADLINE (s from start, default 580). Results under $OUT.
#   OUT=/tmp/o bash scripts/gpu/gemm_pdl_ab.sh
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
T0=$(date +%s)
DEADLINE=${DEADLINE:-580}
OUT=${OUT:-/tmp/fp8rl_pdl}
PDL=fp8rl_n64_sk4_pdl
mkdir -p "$OUT"
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
say() { echo "[pdl_ab +$(( $(date +%s) - T0 ))s] $*"; }
step() {  # step NAME MIN_S MAX_S CMD...: run CMD under a timeout, its output in $OUT/NAME.log
  local name=$1 min=$2 max=$3 l; shift 3
  l=$(left)
  if [ "$l" -lt "$min" ]; then say "$name skipped: ${l} s left, needs $min"; return; fi
  [ "$l" -lt "$max" ] && max=$l
  say "$name (timeout $max s)"
  timeout "$max" "$@" > "$OUT/$name.log" 2>&1
  say "$name rc=$?"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, sglang; print('torch', torch.__version__, 'triton', triton.__version__, 'sglang', sglang.__version__)"
step tests_pdl 40 120 python3 -m pytest -q -m gpu tests/gpu/test_block_gemm.py -k prefetch
tail -3 "$OUT/tests_pdl.log"
step gemm 60 200 python3 scripts/bench_gemm.py --ms 1,8,16 --prefetch --no-triton --json "$OUT/gemm_pdl.json"
grep -E "^\||^copy" "$OUT/gemm.log" | head -70
ROOF=(python3 scripts/decode_roofline.py --configs fp8_online_blockwise --batch-sizes 1 8 32 --contexts 4096 12288
      --profile-cells --check-cells --attention-backend triton --model-dir /tmp/fp8rl_models)
step roof_all 120 200 "${ROOF[@]}" --out "$OUT/roof_all" --deadline-s 190
step roof_nopdl 100 200 "${ROOF[@]}" --out "$OUT/roof_nopdl" --deadline-s 190 --extra-args="--fp8rl-gemm-exclude $PDL"
for d in roof_all roof_nopdl; do
  echo "== $d"; grep -h "gemm_select\|$PDL" "$OUT/$d"/raw/*.log 2>/dev/null | head -5
  awk '/^### FP8 weights/{f=1} f&&/^(Cells|### FP8 \+)/{exit} f' "$OUT/$d/roofline.md" 2>/dev/null | head -20
done
step tests_rest 60 300 python3 -m pytest -q -m gpu tests/gpu/test_block_gemm.py -k "not prefetch"
tail -3 "$OUT/tests_rest.log"
say done
