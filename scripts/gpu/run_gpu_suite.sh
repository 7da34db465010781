#!/usr/bin/env bash
# run_gpu_suite.sh STAGE... : the GPU measurement suite of sglang-fp8rl, on the lent GPU machine (one H100).
#
# Stages (run in the order given; each has a timeout, and the whole call a DEADLINE so it ends inside the
# GPU machine's 600 s per-command limit; a stage that cannot get its minimum time is skipped, not started):
#   tests     python -m pytest $TESTS -q -m gpu (TESTS default "tests/gpu tests/test_kv_scales.py"; T_TESTS, 480 s)
#   accuracy  scripts/train_toy_policy.py (skipped when $TOY already holds a checkpoint: warm machine)
#             then scripts/accuracy_regression.py --task addition (BF16 vs fp8_online_blockwise)  (~4-6 min cold)
#   rollout   scripts/bench_rollout.py: bf16, fp8_online_blockwise, block_prequant, fp8_channel on Qwen3-8B shapes,
#             bs 64 128, in 512, out 1024                                               (~5-6 min cold)
#   kv        scripts/bench_rollout.py, FP8 KV cache on triton: bf16, fp8_online_blockwise_kv (scales calibrated),
#             fp8_online_blockwise_kv_sglang_write, fp8_online_blockwise_kv_static; bs 64 128, in 512, out 256 and 1024: decode ratios vs BF16, issue 15's
#             targets, the load-time KV-scale recalibration vs a 1k-token rollout at bs 128; KV_ARGS (~5-6 min)
#   kv_fi     the same with --attention-backend flashinfer (SGLANG_FLASHINFER_USE_PAGED=1 for FP8 KV), merging the
#             kv stage's results so that BF16's fastest backend is the denominator; KV_FI_ARGS  (~6-9 min: own call)
#   kvcheck   scripts/gpu/check_kv.py: recalibrated FP8 KV scales == a fresh server's, graphs included (triton, flashinfer;
#             KVCHECK_ARGS="--backends fa3" for FlashAttention-3)
#   kv_acc    scripts/accuracy_regression.py on the toy policy (trained first if missing) and its drifted copy
#             (K/V range x powers of two): BF16 vs fp8 / fp8_kv_static / fp8_kv_calibrate; resumable: rc 3 = call the
#             stage again (records in ${WORK}_kv_acc_records); KV_ACC_ARGS        (8 engines: ~2 calls warm)
#   tail      scripts/bench_rollout.py on FA3: bf16, fp8_online_blockwise, fp8_online_blockwise_kv at bs 1 4 16 after
#             4k and 8k-token prompts (decode step per context and bs, speed-ups, the bs-1 8k target), with a decode
#             profile of bf16 and fp8_online_blockwise; TAIL_ARGS                       (~4-6 min)
#   eager     scripts/bench_rollout.py on FA3 with --disable-cuda-graph: bf16, fp8_online_blockwise, + FP8 KV at bs 64
#             256 384, output 128 (decode per token without graphs: verl's enforce_eager); EAGER_ARGS   (~3-4 min)
#   roofline  scripts/decode_roofline.py: the decode step at bs 1 8 32 128 384 x context 1k 4k 12k, bf16 /
#             fp8_online_blockwise / fp8_online_blockwise_kv on FA3 under decode CUDA graphs (prefill skipped, KV slots
#             allocated as by a real one), against its floor (bytes / measured copy bandwidth, FLOPs / dense peak):
#             efficiency, speed-ups over BF16, issue 35's per-step targets, a kernel breakdown of 8 x 4k and 128 x 1k;
#             ROOFLINE_ARGS                                                              (~4-7.5 min: own call)
#   gemm_ab   a GEMM candidate's share of the served decode step: scripts/decode_roofline.py twice, one after the
#             other, with every server candidate and then with --fp8rl-gemm-exclude for each name in GEMM_AB_EXCLUDE
#             (default fp8rl_n64_sk4_pdl), or with the flags GEMM_AB_CHANGE gives instead (e.g.
#             "--fp8rl-producer-quant on"); GEMM_AB_ARGS replaces the roofline's default here (FP8 weights, Triton
#             attention, bs 1 8 32 x 4k 12k, no profile); with TESTS="tests/gpu/test_block_gemm.py" and
#             GEMM_ARGS="--ms 1,8,16 --prefetch --no-triton": tests gemm gemm_ab          (~7-9 min: own call)
#   profile   scripts/bench_rollout.py --configs fp8_online_blockwise --profile-decode --batch-sizes 64 128
#             --output-len 256 (top decode kernels by CUDA time)                        (~1.5-2 min)
#   moe       scripts/bench_rollout.py --moe (Qwen3-30B-A3B shapes, bs 32 64, out 512, mem 0.88) (~6-9 min: own call)
#   server    scripts/gpu/check_server.py on qwen3-small: launch_server + weight updates over HTTP (bit-for-bit vs a
#             cold start, 12 refused bad updates, pre-quantized FP8 by tensor / bucket / disk, 9 updates during
#             generation); SERVER_ARGS e.g. "--moe" or "--tp-size 2"                              (~4-5 min)
#             Scale-out layouts (both servers get the same layout, scripts/gpu/scale_out.py), each on GPUs of its own
#             (CUDA_VISIBLE_DEVICES, WORK and --port per layout: two TP-2 layouts side by side on four GPUs); times of
#             docs/RESULTS.md 22 on H100s (cold machine), "-" where not run yet. MoE at TP > 1 without DP attention
#             needs F="--server-flags=--enforce-disable-flashinfer-allreduce-fusion" (SGLang's FlashInfer fusion JIT-
#             compiles at start and did not finish in 300 s; README "Scale-out"):
#               SERVER_ARGS="--moe --tp-size 2 $F"                                  MoE TP 2      ~3-6 min
#               SERVER_ARGS="--moe --tp-size 4 $F"                                  MoE TP 4      -
#               SERVER_ARGS="--moe --tp-size 2 --ep-size 2 $F"                      EP 2          ~5.5 min
#               SERVER_ARGS="--moe --tp-size 4 --ep-size 4 $F"                      EP 4          -
#               SERVER_ARGS="--moe --tp-size 2 --enable-dp-attention --dp-size 2"   DP attention  ~6.5 min
#               SERVER_ARGS="--moe --tp-size 4 --enable-dp-attention --dp-size 4"   DP attention  -
#               SERVER_ARGS="--moe --tp-size 4 --nnodes 2"   two 'nodes' of two GPUs on one host  >3.5 min (15/22 ran)
#             Add "--startup-timeout-s 300" where a start may be slow: the later sections then still run; a start
#             that times out leaves the Python stacks of its processes in its log (server_io.dump_stacks).
#   colocated scripts/gpu/check_colocated.py on qwen3-small: verl's colocated cycle on the stock server with
#             --enable-memory-saver and an FP8 KV cache (release kv_cache + weights, a refused push, resume weights, W1
#             pushed by tensor, resume kv_cache), without and with --enable-weights-cpu-backup, against a cold W1
#             start (checksums of every parameter, FP8 pointers, KV scales, greedy outputs); three server starts;
#             COLOCATED_ARGS e.g. "--passes backup"       (estimated ~3-4 min warm, ~6-7 min on a fresh machine: own call)
#   broadcast scripts/gpu/check_broadcast.py (two GPUs): update_weights_from_distributed over NCCL, BF16 and FP8
#             codes + scales, split pairs, refused broadcasts keep the group in step      (~3 min)
#             BROADCAST_ARGS for a server layout (issue 36; tp_size + 1 GPUs):
#               "--server-gpu 0,1 --trainer-gpu 2 --tp-size 2 --nnodes 2"   NCCL to both 'nodes' (11/11, 447 s: RESULTS 27e)
#               "--server-gpu 0,1 --trainer-gpu 2 --tp-size 2 --ep-size 2 --moe"    (not run on GPUs yet)
#   quant     scripts/bench_quant.py --json $WORK/bench_quant.json (quantization kernel micro-benchmark)
#   gemm      scripts/bench_gemm.py: per-shape block-FP8 GEMM candidates vs BF16 (Qwen3-8B shapes); GEMM_ARGS
#   startup   scripts/bench_startup.py: cold/warm launch_server start, BF16 vs fp8_online_blockwise (Qwen3-8B)
#   demo      python -m sglang_fp8rl.demo --keep $WORK/demo: start-up progress, scheme summary, one update, tokens
#             before/after, and the server's start-up time by phase (DEMO_ARGS, e.g. "--server-args --fp8rl-jit-workers 0")
#   update    $UPDATE_SCRIPT (default scripts/bench_update.py): full-model update of Qwen3-8B shapes, BF16 vs
#             fp8_online_blockwise server: by tensor, atomic step, its validate-only phase, pre-quantized FP8, from
#             disk; UPDATE_ARGS e.g. "--model qwen3-small" or "--skip-disk --repeats 3"  (~7-9 min: own call)
#             Issue 36 (Qwen3-30B-A3B shapes, 61 GB of BF16; MoE at TP > 1 starts with FlashInfer's all-reduce
#             fusion off, added by the plan). One engine per call: on a fresh four-H200 machine the BF16 engine took
#             179 s to start at TP 2, the FP8 one 119 s, and each FP8 push 10-16 s (docs/RESULTS.md 25e):
#               UPDATE_ARGS="--model qwen3-30b-a3b --tp-size 2 --paths tensor flattened broadcast prequant --engines fp8"
#                 (four GPUs: engine on GPUs 0-1, the broadcasting trainer and its payload on GPU 2), then the same
#                 with "--engines bf16"
#               UPDATE_ARGS="--model qwen3-30b-a3b --tp-size 4 --paths tensor prequant --repeats 2"
#                 (four GPUs: no broadcast at TP 4 there, NCCL needs a fifth GPU for the trainer)
#               ... "--paths disk --disk-repeats 1", and "--kv-cache-dtype fp8_e4m3" for the KV recalibration time;
#             check the plan first on CPU: python3 scripts/bench_update.py --model-dir M --out O --model
#             qwen3-30b-a3b --tp-size 4 --gpus 4 --dry-run
#   rl        scripts/rl_regression.py: GRPO on the toy policy, BF16 vs FP8 vs FP8+TIS rollouts from the stock
#             server, weights pushed every step; RL_ARGS e.g. "--arms bf16 fp8 fp8_tis fp8kv_tis"  (~6-9 min: own call)
#   rl_rollout  scripts/bench_rl_rollout.py --scale short: an RL-shaped rollout (256 prompts x 512 random ids, lognormal
#             outputs median 1000, cap 4096, temperature 1, ignore_eos, all submitted at once) through the stock server,
#             bf16 then fp8, each its own server: makespan, p50/p90 completion, tok/s, KV pool, peak running, decode
#             batches without CUDA graph, ratios vs the faster of bf16 / bf16_graphs512; RL_ROLLOUT_ARGS (RL_ARGS when
#             unset), e.g. "--configs bf16 fp8 fp8_kv", "--scale full", or "--scale long --configs bf16 bf16_graphs512
#             fp8 fp8_kv --gpus 0 1 2 3" (longer prompts, output cap 16384; one config per GPU)  (~7-9 min: own call)
#   server_step  scripts/gpu/profile_server_step.py: bf16 then fp8_kv on the stock server, 8 requests x 4k random ids
#             decoding, SGLang's /start_profile over 30 steps: step wall vs GPU busy, GPU idle gaps, GPU time by group,
#             top kernels and host ops; SERVER_STEP_ARGS e.g. "--configs fp8"   (estimated ~4-6 min, not yet measured)
# Expected times are estimates from shared/gpu/README.md's measurements (server import 24-34 s, bench_one_batch
# 40-110 s per config), not measured with these scripts.
#
# How to call it on the GPU machine (see scripts/gpu/env.sh; .gpu/ is built once on the CPU machine with
# shared/gpu/make_wheelhouse.sh .gpu):
#   call 1  carry [".gpu/bin", ".gpu/bundle1"]:  source scripts/gpu/env.sh; echo "env rc=$?"         (rc=3 expected)
#   call 2  IMMEDIATELY after, carry [".gpu/bin", ".gpu/bundle2"]:
#           source scripts/gpu/env.sh || exit 1; bash scripts/gpu/run_gpu_suite.sh tests accuracy
#   call 3  while warm, carry [".gpu/bin"]:
#           source scripts/gpu/env.sh || exit 1; bash scripts/gpu/run_gpu_suite.sh rollout
#   call 4  (optional, own call) ... bash scripts/gpu/run_gpu_suite.sh moe       /  ... profile update
# (The suite also sources scripts/gpu/env.sh itself when FP8RL_REPO is unset.)
#
# Output: everything under $WORK (/tmp/fp8rl_suite, kept between calls while the machine is warm; logs/STAGE.log
# per stage); into $OUT (at most 8 files come back): suite_summary.md, suite_logs_<time>.tgz, and the stage
# results made by this call (rollout_results.json, accuracy.json, accuracy.png, check_server.json, bench_quant.json,
# moe_results.json, profile_top_kernels.txt; the first 6 that exist, the rest only inside the tgz).
# stdout ends with the summary (stage table + each stage's own table).
# Env: OUT, WORK, DEADLINE (s from start; 570), TESTS, T_TESTS, TOY_SECONDS (training budget; 150), TOY_ARGS,
#      ROLLOUT_ARGS,
#      MOE_ARGS, PROFILE_ARGS, ACC_ARGS, KV_ARGS, KV_FI_ARGS, KV_ACC_ARGS, SERVER_ARGS, UPDATE_ARGS, GEMM_ARGS,
#      STARTUP_ARGS, DEMO_ARGS, RL_ARGS, RL_ROLLOUT_ARGS, ROOFLINE_ARGS, COLOCATED_ARGS, BROADCAST_ARGS, SERVER_STEP_ARGS,
#      GEMM_AB_ARGS, GEMM_AB_EXCLUDE, GEMM_AB_CHANGE
#      (extra args per script),
#      UPDATE_SCRIPT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
OUT=${OUT:-/tmp/fp8rl_out}
WORK=${WORK:-/tmp/fp8rl_suite}
GEMM_AB_EXCLUDE=${GEMM_AB_EXCLUDE:-fp8rl_n64_sk4_pdl}  # what gemm_ab's second roofline leaves out
GEMM_AB_CHANGE=${GEMM_AB_CHANGE:-$(for name in $GEMM_AB_EXCLUDE; do printf -- "--fp8rl-gemm-exclude %s " "$name"; done)}
MODELS=$WORK/models
LOGS=$WORK/logs
STAMP=$(date +%H%M%S)
mkdir -p "$OUT" "$WORK" "$LOGS"
[ $# -gt 0 ] || { sed -n '2,/^set -u/p' "$0" | grep '^#'; exit 2; }

if [ -z "${FP8RL_REPO:-}" ]; then
  # shellcheck disable=SC1091
  source scripts/gpu/env.sh || { echo "[suite] scripts/gpu/env.sh failed (machine cold? redo the two install calls)"; exit 1; }
fi
export PYTHONUNBUFFERED=1
PY=python3

say() { echo "[suite $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
STATUS=()
record() { STATUS+=("| $1 | $2 | $3 s | $4 |"); }

# run_stage NAME MIN_S MAX_S CMD...   (timeout = min(MAX_S, time left - 10); skipped below MIN_S)
run_stage() {
  local name=$1 min_s=$2 max_s=$3; shift 3
  local l; l=$(left)
  local to=$(( l - 10 )); [ "$to" -gt "$max_s" ] && to=$max_s
  if [ "$to" -lt "$min_s" ]; then
    say "SKIP $name: ${l} s left (needs ${min_s} s)"; record "$name" skipped 0 "only ${l} s left"; return 99
  fi
  say "start $name (timeout ${to} s): $*"
  local t=$(date +%s)
  timeout -k 15 "$to" "$@" >> "$LOGS/$name.log" 2>&1
  local rc=$? dt=$(( $(date +%s) - t ))
  local note=""; [ $rc = 124 ] || [ $rc = 137 ] && note="TIMEOUT"
  say "end $name rc=$rc ${dt} s $note"
  record "$name" "$rc" "$dt" "$note"
  if [ $rc != 0 ]; then
    say "$name: last lines of $LOGS/$name.log:"; grep -v "^\s*$" "$LOGS/$name.log" | tail -12 | cut -c1-300
  fi
  return $rc
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  $PY -c "import importlib.metadata as m; print(*[f'{p} {m.version(p)}' for p in ['sglang','sglang-kernel','sgl-deep-gemm','torch','triton','transformers','sglang-fp8rl']], sep=' | ')" 2>&1
} > "$LOGS/env.txt"
say "$(sed -n 2p "$LOGS/env.txt") | stages: $*"

# ensure_toy: train the toy policy into $TOY unless a warm machine already holds it (accuracy, kv_acc); TOY_ARGS
# (e.g. "--prefix-len 2048 --batch-size 128": long-context decodes) trains another one, in a folder of its own
TOY="$WORK/toy$(printf %s "${TOY_ARGS:-}" | tr -cs 'A-Za-z0-9' '_')"  # e.g. toy_prefix_len_2048_batch_size_128
ensure_toy() {
  if [ ! -f "$TOY/model.safetensors" ]; then
    # shellcheck disable=SC2086
    run_stage train_toy 120 $(( ${TOY_SECONDS:-150} + 90 )) \
      $PY scripts/train_toy_policy.py --out "$TOY" --max-seconds "${TOY_SECONDS:-150}" ${TOY_ARGS:-}
    tail -3 "$LOGS/train_toy.log"
  else
    say "toy policy already at $TOY (warm machine), not retrained"
  fi
  [ -f "$TOY/model.safetensors" ]
}

for st in "$@"; do
  case $st in
    tests)
      # shellcheck disable=SC2086
      run_stage tests 60 "${T_TESTS:-480}" $PY -m pytest ${TESTS:-tests/gpu tests/test_kv_scales.py} -q -m gpu \
        -p no:cacheprovider -rfEs
      rc=$?; [ $rc = 5 ] && say "tests: pytest collected no GPU test (rc 5)" ;;
    accuracy)
      if ensure_toy; then
        run_stage accuracy 120 420 $PY scripts/accuracy_regression.py --model "$TOY" --task addition \
          --out "$WORK/accuracy" ${ACC_ARGS:-}
        [ $? = 0 ] || for f in "$WORK"/accuracy/engine_*.log; do
          [ -f "$f" ] && { say "tail of $f:"; grep -v "^\s*$" "$f" | tail -15 | cut -c1-300; }; done
      else
        record accuracy skipped 0 "no toy checkpoint"
      fi ;;
    rollout)
      l=$(left); run_stage rollout 150 560 $PY scripts/bench_rollout.py --out "$WORK/rollout" --model-dir "$MODELS" \
        --deadline-s $(( l - 25 )) ${ROLLOUT_ARGS:-} ;;
    kv)  # FP8 KV cache, triton: BF16 / FP8 weights + FP8 KV calibrated / static, outputs 256 and 1024
      l=$(left); run_stage kv 150 560 $PY scripts/bench_rollout.py --out "$WORK/kv" --model-dir "$MODELS" \
        --configs bf16 fp8_online_blockwise_kv fp8_online_blockwise_kv_sglang_write fp8_online_blockwise_kv_static \
        --output-len 256 1024 --deadline-s $(( l - 25 )) ${KV_ARGS:-} ;;
    kv_fi)  # the same on FlashInfer; merges the kv stage's results (BF16 on its fastest backend)
      merge=(); [ -f "$WORK/kv/results.json" ] && merge=(--merge "$WORK/kv/results.json")
      l=$(left); run_stage kv_fi 150 560 $PY scripts/bench_rollout.py --out "$WORK/kv_fi" --model-dir "$MODELS" \
        --attention-backend flashinfer --configs bf16 fp8_online_blockwise_kv fp8_online_blockwise_kv_static \
        --output-len 256 1024 ${merge[@]+"${merge[@]}"} --deadline-s $(( l - 25 )) ${KV_FI_ARGS:-} ;;
    kv_acc)  # FP8-KV accuracy arms on the toy policy and its drifted copy; resumable: call again until rc 0
      if ensure_toy; then
        l=$(left); run_stage kv_acc 150 570 $PY scripts/accuracy_regression.py --model "$TOY" --task addition \
          --out "$WORK/kv_acc" --arms fp8 fp8_kv_static fp8_kv_calibrate --policies original drifted --reuse \
          --records-dir "${TOY}_kv_acc_records" --deadline-s $(( l - 30 )) ${KV_ACC_ARGS:-}
        rc=$?; [ $rc = 3 ] && say "kv_acc: not every engine ran in this call; run the kv_acc stage again (records kept)"
        [ $rc = 0 ] || [ $rc = 3 ] || for f in "$WORK"/kv_acc/engine_*.log; do
          [ -f "$f" ] && { say "tail of $f:"; grep -v "^\s*$" "$f" | tail -15 | cut -c1-300; }; done
      else
        record kv_acc skipped 0 "no toy checkpoint"
      fi ;;
    tail)  # the rollout's tail on FA3: decode at bs 1 4 16 after 4k / 8k-token prompts, BF16 vs FP8 (+ FP8 KV),
      # with a decode profile of BF16 and FP8 weights
      l=$(left); run_stage tail 150 560 $PY scripts/bench_rollout.py \
        --attention-backend fa3 --configs bf16 fp8_online_blockwise fp8_online_blockwise_kv --batch-sizes 1 4 16 \
        --input-len 4096 8192 --output-len 64 --mem-fraction-static 0.65 --profile-decode \
        --profile-configs bf16 fp8_online_blockwise --profile-steps 3 --out "$WORK/tail" --model-dir "$MODELS" \
        --deadline-s $(( l - 25 )) ${TAIL_ARGS:-} ;;
    eager)  # decode without CUDA graphs (verl's enforce_eager, or past the capture): BF16 vs FP8 per token on FA3
      l=$(left); run_stage eager 150 560 $PY scripts/bench_rollout.py --attention-backend fa3 \
        --configs bf16 fp8_online_blockwise fp8_online_blockwise_kv --batch-sizes 64 256 384 --output-len 128 \
        --extra-args=--disable-cuda-graph --out "$WORK/eager" --model-dir "$MODELS" --deadline-s $(( l - 25 )) \
        ${EAGER_ARGS:-} ;;
    roofline)  # the decode roofline: one bench_one_batch process per config, each given at most 240 s
      l=$(left); run_stage roofline 150 560 $PY scripts/decode_roofline.py --out "$WORK/roofline" \
        --model-dir "$MODELS" --deadline-s $(( l - 25 )) ${ROOFLINE_ARGS:-} ;;
    gemm_ab)  # a GEMM candidate's share of the served decode step: the roofline with every server candidate, then,
      # one after the other on the same GPU, with GEMM_AB_CHANGE (without the candidates named in GEMM_AB_EXCLUDE)
      ab=(--configs fp8_online_blockwise --batch-sizes 1 8 32 --contexts 4096 12288 --profile-cells --check-cells
          --attention-backend triton)
      # shellcheck disable=SC2206
      [ -n "${GEMM_AB_ARGS:-}" ] && ab=($GEMM_AB_ARGS)
      half=$(( ($(left) - 20) / 2 ))
      run_stage gemm_ab_all 120 "$half" $PY scripts/decode_roofline.py --out "$WORK/gemm_ab/all" \
        --model-dir "$MODELS" --deadline-s $(( half - 15 )) "${ab[@]}"
      l=$(left); run_stage gemm_ab_without 100 560 $PY scripts/decode_roofline.py --out "$WORK/gemm_ab/without" \
        --model-dir "$MODELS" --deadline-s $(( l - 25 )) "${ab[@]}" "--extra-args=${GEMM_AB_CHANGE% }" ;;
    profile)
      l=$(left); run_stage profile 120 400 $PY scripts/bench_rollout.py --configs fp8_online_blockwise --profile-decode \
        --batch-sizes 64 128 --output-len 256 --out "$WORK/profile" --model-dir "$MODELS" --deadline-s $(( l - 25 )) \
        ${PROFILE_ARGS:-} ;;
    moe)
      l=$(left); run_stage moe 200 560 $PY scripts/bench_rollout.py --moe --out "$WORK/moe" --model-dir "$MODELS" \
        --budget-s 240 --deadline-s $(( l - 25 )) ${MOE_ARGS:-} ;;
    kvcheck)  # FP8 KV scales: recalibrated in place == a fresh server with the same weights, per backend
      run_stage kvcheck 200 560 $PY scripts/gpu/check_kv.py --out "$WORK/kvcheck" ${KVCHECK_ARGS:-} ;;
    colocated)  # verl's colocated cycle (memory saver, FP8 KV), without and with the CPU weight backup
      l=$(left); run_stage colocated 200 560 $PY scripts/gpu/check_colocated.py --model-dir "$MODELS" \
        --out "$WORK/colocated" --deadline-s $(( l - 25 )) ${COLOCATED_ARGS:-} ;;
    broadcast)  # two GPUs: /update_weights_from_distributed over NCCL, BF16 and pre-quantized FP8, refusals
      run_stage broadcast 150 480 $PY scripts/gpu/check_broadcast.py --model-dir "$MODELS" --out "$WORK/broadcast" \
        ${BROADCAST_ARGS:-} ;;
    server)  # the script writes its model folder (qwen3-small, or qwen3-moe-small with --moe) into $MODELS
      run_stage server 150 560 $PY scripts/gpu/check_server.py --model-dir "$MODELS" --out "$WORK/server" \
        ${SERVER_ARGS:-} ;;
    quant)
      run_stage quant 60 240 $PY scripts/bench_quant.py --json "$WORK/bench_quant.json" ;;
    gemm)
      run_stage gemm 90 420 $PY scripts/bench_gemm.py --json "$WORK/bench_gemm.json" ${GEMM_ARGS:-} ;;
    startup)
      $PY scripts/gpu/make_models.py "$MODELS" qwen3-8b >/dev/null
      run_stage startup 150 560 $PY scripts/bench_startup.py --model-dir "$MODELS" --out "$WORK/startup" ${STARTUP_ARGS:-} ;;
    demo)
      run_stage demo 90 480 $PY -m sglang_fp8rl.demo --keep "$WORK/demo" ${DEMO_ARGS:-} ;;
    update)
      us=${UPDATE_SCRIPT:-scripts/bench_update.py}
      if [ -f "$us" ]; then
        $PY scripts/gpu/make_models.py "$MODELS" qwen3-8b qwen3-small >/dev/null
        l=$(left); run_stage update 120 560 $PY "$us" --model-dir "$MODELS" --out "$WORK/update" \
          --deadline-s $(( l - 30 )) ${UPDATE_ARGS:-}
      else
        say "update: $us not in this checkout, skipped"; record update skipped 0 "$us absent"
      fi ;;
    rl)
      l=$(left); run_stage rl 240 580 $PY scripts/rl_regression.py --out "$WORK/rl" --max-seconds $(( l - 40 )) \
        ${RL_ARGS:-} ;;
    rl_rollout)  # RL-shaped rollout through the stock server; RL_ROLLOUT_ARGS, or RL_ARGS when that is unset
      l=$(left); run_stage rl_rollout 200 570 $PY scripts/bench_rl_rollout.py --out "$WORK/rl_rollout" \
        --model-dir "$MODELS" --scale short --deadline-s $(( l - 25 )) ${RL_ROLLOUT_ARGS-${RL_ARGS:-}} ;;
    server_step)  # where a served decode step's time goes: GPU idle between steps vs GPU work beyond the roofline's
      l=$(left); run_stage server_step 200 570 $PY scripts/gpu/profile_server_step.py --out "$WORK/server_step" \
        --model-dir "$MODELS" --deadline-s $(( l - 25 )) ${SERVER_STEP_ARGS:-} ;;
    *) say "unknown stage $st"; record "$st" unknown 0 "" ;;
  esac
done

# ---- summary ------------------------------------------------------------------------------------------------
# fresh FILE: FILE was written by this call (after its env.txt), not left in $WORK by an earlier call of a warm machine
fresh() { [ -f "$1" ] && [ "$1" -nt "$LOGS/env.txt" ]; }
SUM=$WORK/suite_summary_$STAMP.md
{
  echo "# sglang-fp8rl GPU suite ($(date -u '+%Y-%m-%d %H:%M UTC'), stages: $*)"
  sed -n '2,3p' "$LOGS/env.txt"
  echo; echo "| stage | rc | time | note |"; echo "| --- | --- | --- | --- |"
  printf '%s\n' "${STATUS[@]}"
  for st in "$@"; do
    case $st in
      tests) fresh "$LOGS/tests.log" && { echo; echo "## tests (tail)"; grep -v "^\s*$" "$LOGS/tests.log" | tail -15 | cut -c1-250; } ;;
      accuracy) [ -f "$TOY/train_report.json" ] && { echo; $PY -c "import json; r=json.load(open('$TOY/train_report.json')); print(f\"toy policy: {r['steps']} steps, {r['train_seconds']} s, held-out EM (HF greedy, bf16) {r['heldout_exact_match_bf16_hf_greedy']:.4f}\")"; }
                fresh "$WORK/accuracy/summary.md" && { echo; cat "$WORK/accuracy/summary.md"; } ;;
      kv_acc) fresh "$WORK/kv_acc/summary.md" && { echo; cat "$WORK/kv_acc/summary.md"; } ;;
      kvcheck) fresh "$LOGS/kvcheck.log" && { echo; echo "## kvcheck"; grep -E "^\|" "$LOGS/kvcheck.log"; } ;;
      colocated) fresh "$WORK/colocated/summary.md" && { echo; cat "$WORK/colocated/summary.md"; } ;;
      broadcast) fresh "$LOGS/broadcast.log" && { echo; echo "## broadcast"; grep -E "^\||FAIL" "$LOGS/broadcast.log"; } ;;
      rollout|profile|moe|kv|kv_fi|tail|eager) fresh "$WORK/$st/summary.md" && { echo; echo "## $st"; cat "$WORK/$st/summary.md"; }
                [ "$st" = profile ] && fresh "$WORK/profile/profile_top_kernels.txt" && head -30 "$WORK/profile/profile_top_kernels.txt" ;;
      server) if fresh "$WORK/server/summary.md"; then echo; cat "$WORK/server/summary.md"
              elif fresh "$WORK/server/check_server.json"; then echo; echo "## server"; cat "$WORK/server/check_server.json"; fi ;;
      quant) fresh "$LOGS/quant.log" && { echo; echo "## quant"; tail -40 "$LOGS/quant.log"; } ;;
      update) fresh "$WORK/update/summary.md" && { echo; echo "## update"; cat "$WORK/update/summary.md"; } ;;
      startup) fresh "$WORK/startup/summary.md" && { echo; cat "$WORK/startup/summary.md"; } ;;
      rl) fresh "$WORK/rl/summary.md" && { echo; cat "$WORK/rl/summary.md"; } ;;
      rl_rollout) fresh "$WORK/rl_rollout/summary.md" && { echo; cat "$WORK/rl_rollout/summary.md"; } ;;
      server_step) fresh "$WORK/server_step/profile_server_step.md" && { echo; cat "$WORK/server_step/profile_server_step.md"; } ;;
      roofline) fresh "$WORK/roofline/roofline.md" && { echo; cat "$WORK/roofline/roofline.md"; } ;;
      demo) fresh "$LOGS/demo.log" && { echo; echo "## demo"; grep -E "^\[demo\] .*(healthy|FAILED)" "$LOGS/demo.log"
                sed -n '/^== \(scheme summary\|server start-up\)/,$p' "$LOGS/demo.log" | cut -c1-250; } ;;
      gemm) fresh "$LOGS/gemm.log" && { echo; echo "## gemm"; grep -E "^\||^copy" "$LOGS/gemm.log" | head -60; } ;;
      gemm_ab) for d in all without; do fresh "$WORK/gemm_ab/$d/roofline.md" || continue
                 echo; echo "## gemm_ab: $d (the second run: $GEMM_AB_CHANGE)"
                 grep -h "gemm_select" "$WORK/gemm_ab/$d"/raw/*.log 2>/dev/null | head -5
                 sed -n '/^### /,/^Cells/p' "$WORK/gemm_ab/$d/roofline.md" | head -24; done ;;
    esac
  done
} > "$SUM"

cp "$SUM" "$OUT/suite_summary.md"
NCOPY=0
for pair in rollout/results.json:rollout_results.json accuracy/accuracy.json:accuracy.json accuracy/accuracy.png:accuracy.png \
            server/check_server.json:check_server.json bench_quant.json:bench_quant.json moe/results.json:moe_results.json profile/profile_top_kernels.txt:profile_top_kernels.txt \
            update/update_results.json:update_results.json startup/startup_results.json:startup_results.json \
            bench_gemm.json:bench_gemm.json rl/rl_results.json:rl_results.json rl/rl_curves.png:rl_curves.png \
            kv/results.json:kv_results.json kv_fi/results.json:kv_fi_results.json kv_acc/accuracy.json:kv_acc.json \
            kvcheck/check_kv.json:check_kv.json colocated/check_colocated.json:check_colocated.json \
            broadcast/check_broadcast.json:check_broadcast.json rl_rollout/results.json:rl_rollout_results.json \
            rl_rollout/completion.png:rl_rollout.png rl_rollout/answers.json:rl_rollout_answers.json \
            tail/results.json:tail_results.json tail/profile_top_kernels.txt:tail_profile.txt \
            eager/results.json:eager_results.json roofline/roofline.json:roofline.json roofline/roofline.md:roofline.md \
            server_step/profile_server_step.json:profile_server_step.json gemm_ab/all/roofline.json:gemm_ab_all.json \
            gemm_ab/without/roofline.json:gemm_ab_without.json; do
  src=$WORK/${pair%%:*}
  if fresh "$src" && [ "$NCOPY" -lt 6 ]; then  # $OUT returns at most 8 files
    cp "$src" "$OUT/${pair##*:}" && NCOPY=$(( NCOPY + 1 ))
  fi
done
tar czf "$OUT/suite_logs_$STAMP.tgz" -C "$WORK" --exclude='models' --exclude='*.safetensors' --exclude='*.kapi_*' . 2>/dev/null
say "results -> $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo; cat "$SUM"
