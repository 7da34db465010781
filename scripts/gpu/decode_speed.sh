#!/usr/bin/env bash
# decode_speed.sh : the FP8 decode-speed measurements of one card kind in one call, side by side on four GPUs
# (issue 35; run from the repository root on a four-GPU machine, after the wheelhouse and FA3 install calls):
#   GPU 0     the decode roofline (scripts/decode_roofline.py): bf16, fp8_online_blockwise_kv_splitkv (the plugin's
#             split-KV decode attention at every batch), fp8_online_blockwise_kv_fa3 (FA3's FP8 decode), under decode
#             CUDA graphs
#   GPU 1     scripts/gpu/bench_decode_attention.py: split-KV vs FA3 per cell, its sweep, accuracy vs float64 (ATTN_S
#             seconds, default 120); then the rollout configs of RL_AFTER_ATTN (e.g. fp8_kv_fa3), if set
#   GPU 2, 3  scripts/bench_rl_rollout.py --scale long: bf16 and fp8_kv side by side (one config per GPU)
# Env: DEADLINE (s, default 560), ROOFLINE_CONFIGS, ATTN_ARGS, ATTN_S, RL_CONFIGS (default "bf16 fp8_kv"),
#      RL_AFTER_ATTN, RL_SCALE (long).
# $OUT gets at most 8 files: roofline.{json,md}, decode_attention.{json,md}, rl_rollout_answers.json (GPUs 2-3),
# rl_rollout_gpu1_answers.json.gz, decode_speed_logs.tgz (every log and result), decode_speed_summary.md.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
[ -n "${FP8RL_REPO:-}" ] || { source scripts/gpu/env.sh || exit 1; }
export FP8RL_REPO=${FP8RL_REPO:-$PWD}
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-/tmp/fp8rl_out}
W=${WORK:-/tmp/decode_speed}
mkdir -p "$OUT" "$W"
T0=$(date +%s)
say() { echo "[decode_speed +$(( $(date +%s) - T0 ))s] $*"; }

CUDA_VISIBLE_DEVICES=0 DEADLINE=$DEADLINE WORK=$W/roofline_suite OUT=$W/roofline_out \
  ROOFLINE_ARGS="--configs ${ROOFLINE_CONFIGS:-bf16 fp8_online_blockwise_kv_splitkv fp8_online_blockwise_kv_fa3}" \
  bash scripts/gpu/run_gpu_suite.sh roofline >"$W/roofline.log" 2>&1 &
P_ROOF=$!
# GPU 1: the kernel bench, then (if RL_AFTER_ATTN names configs) those rollout configs on the same GPU
(
  CUDA_VISIBLE_DEVICES=1 timeout ${ATTN_S:-120} python3 scripts/gpu/bench_decode_attention.py --out "$W/attention" \
    --deadline-s $(( ${ATTN_S:-120} - 30 )) ${ATTN_ARGS:-} >"$W/attention.log" 2>&1
  echo "attention rc=$?" >>"$W/attention.log"
  if [ -n "${RL_AFTER_ATTN:-}" ]; then
    DEADLINE=$(( DEADLINE - ${ATTN_S:-120} )) WORK=$W/rl1_suite OUT=$W/rl1_out \
      RL_ROLLOUT_ARGS="--scale ${RL_SCALE:-long} --configs $RL_AFTER_ATTN --gpus 1 --min-s 200" \
      bash scripts/gpu/run_gpu_suite.sh rl_rollout >"$W/rl1.log" 2>&1
  fi
) &
P_ATTN=$!
# GPUs 2 and 3: bench_rl_rollout's --gpus are physical indices (it sets CUDA_VISIBLE_DEVICES per server itself)
DEADLINE=$DEADLINE WORK=$W/rl_suite OUT=$W/rl_out \
  RL_ROLLOUT_ARGS="--scale ${RL_SCALE:-long} --configs ${RL_CONFIGS:-bf16 fp8_kv} --gpus 2 3 --min-s 200" \
  bash scripts/gpu/run_gpu_suite.sh rl_rollout >"$W/rl.log" 2>&1 &
P_RL=$!
wait $P_ATTN; say "attention bench (+ GPU 1 rollout) rc=$?"
wait $P_ROOF; say "roofline rc=$?"
wait $P_RL; say "rl_rollout rc=$?"

cp "$W/roofline_suite/roofline/roofline.json" "$OUT/roofline.json" 2>/dev/null
cp "$W/roofline_suite/roofline/roofline.md" "$OUT/roofline.md" 2>/dev/null
cp "$W/attention/decode_attention.json" "$OUT/decode_attention.json" 2>/dev/null
cp "$W/attention/decode_attention.md" "$OUT/decode_attention.md" 2>/dev/null
cp "$W/rl_suite/rl_rollout/answers.json" "$OUT/rl_rollout_answers.json" 2>/dev/null
[ -f "$W/rl1_suite/rl_rollout/answers.json" ] && gzip -c "$W/rl1_suite/rl_rollout/answers.json" >"$OUT/rl_rollout_gpu1_answers.json.gz"
tar czf "$OUT/decode_speed_logs.tgz" -C "$W" --exclude='models' --exclude='*.safetensors' . 2>/dev/null
{
  echo "## decode_speed $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u '+%F %H:%M UTC')"
  for f in "$W/attention/decode_attention.md" "$W/roofline_suite/roofline/roofline.md" "$W/rl_suite/rl_rollout/summary.md" \
           "$W/rl1_suite/rl_rollout/summary.md"; do
    [ -f "$f" ] && { echo; cat "$f"; }
  done
  echo; echo "### log tails"; for f in attention roofline rl rl1; do echo "-- $f"; tail -n 5 "$W/$f.log"; done
} >"$OUT/decode_speed_summary.md"
ls -la "$OUT"
grep -E "^\|" "$W/attention/decode_attention.md" 2>/dev/null
sed -n '/Step speed-up/,/Targets/p' "$W/roofline_suite/roofline/roofline.md" 2>/dev/null | head -30
grep -E "^\| |makespan" "$W/rl_suite/rl_rollout/summary.md" "$W/rl1_suite/rl_rollout/summary.md" 2>/dev/null | head -30
