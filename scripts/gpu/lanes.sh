#!/usr/bin/env bash
# lanes.sh : independent GPU jobs side by side in one call, one lane per GPU (run from the repository root, after the
# wheelhouse and FA3 install calls):
#   bash scripts/gpu/lanes.sh "CMD for GPU 0" "CMD for GPU 1" ...
# Lane i runs `bash -c CMD` with CUDA_VISIBLE_DEVICES=i, WORK=ROOT/i (its scratch) and LANE_OUT=ROOT/i/out (where
# it leaves results), its output in ROOT/lane_i.log; ROOT is a new folder /tmp/lanes.XXXXXX per call. A lane command
# may be several commands joined by `;` (run in order on that GPU). A script that picks its GPUs itself
# (bench_rl_rollout.py --gpus: physical indices) overrides the lane's CUDA_VISIBLE_DEVICES: give it GPUs no other lane
# uses (e.g. lane 2 with `--gpus 2 3` and no lane 3). Env: DEADLINE (s, default 560): every lane still running then
# is stopped.
# $OUT gets lanes.tgz (every lane's results and logs; models, weights and raw profiler traces left out) and
# lanes_summary.md (each lane's command, exit status, time and last lines, then any *.md its results hold).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
[ -n "${FP8RL_REPO:-}" ] || { source scripts/gpu/env.sh || exit 1; }
export FP8RL_REPO=${FP8RL_REPO:-$PWD}
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-/tmp/fp8rl_out}
mkdir -p "$OUT"
ROOT=$(mktemp -d /tmp/lanes.XXXXXX)
T0=$(date +%s)
pids=()
i=0
for cmd in "$@"; do
  mkdir -p "$ROOT/$i/out"
  (
    t=$(date +%s)
    CUDA_VISIBLE_DEVICES=$i WORK=$ROOT/$i LANE_OUT=$ROOT/$i/out LANE=$i timeout -k 15 "$DEADLINE" bash -c "$cmd"
    echo "[lane $i] rc=$? in $(( $(date +%s) - t )) s"
  ) >"$ROOT/lane_$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
for p in "${pids[@]}"; do wait "$p"; done

tar czf "$OUT/lanes.tgz" -C "$ROOT" --exclude='models' --exclude='toy' --exclude='*.safetensors' \
  --exclude='*.trace.json.gz' --exclude='*.pt' . 2>/dev/null
{
  echo "## lanes on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u '+%F %H:%M UTC'), $(( $(date +%s) - T0 )) s"
  i=0
  for cmd in "$@"; do
    echo; echo "### lane $i: \`$cmd\`"; echo '```'; tail -n 15 "$ROOT/lane_$i.log" | cut -c1-300; echo '```'
    find "$ROOT/$i/out" -name '*.md' -size -200k 2>/dev/null | sort | while read -r f; do echo; echo "#### $f"; cat "$f"; done
    i=$((i + 1))
  done
} >"$OUT/lanes_summary.md"
ls -la "$OUT"
grep -E "^### lane|rc=" "$OUT/lanes_summary.md"
