#!/usr/bin/env bash
# The other supported SGLang releases (one requirements/sglang-<version>.txt each, the primary one excepted): build
# each pinned CPU env and run the tests that touch SGLang's internals there: the plugin and the demo, the update path
# (malformed requests, replayed writes, pre-quantized payloads, sessions, the step's lifecycle, the release and resume
# of GPU memory), the FP8 KV scales and the direct DeepGEMM call (whether the release's DeepGEMM linear is the two
# launches it makes).
# The full suite runs on the primary release (scripts/cpu_test.sh with no SGLANG_VERSION).
# The envs are built one at a time (pip); the tests then run MATRIX_JOBS releases at a time (default 2: most of a
# run is one single-threaded worker process per release). Each release's output goes to its own log, printed at the end.
set -uo pipefail
export FP8RL_TEST_JOBS=1  # two releases run at a time: one pytest process each
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
primary=$(sed -n 's/^SUPPORTED_SGLANG[^(]*("\([^"]*\)".*/\1/p' sglang_fp8rl/compat/versions.py)
# (test_weight_updates.py and test_client.py run on the primary release only: CI's 45-minute budget; the update
# path they share is covered here by the malformed-request suite, replayed writes, pre-quantized payloads and sessions)
MATRIX_TESTS=(
  tests/test_plugin.py tests/test_version_matrix.py tests/test_demo_cpu.py tests/test_gpu_flags.py
  tests/test_malformed_updates.py tests/test_replayed_writes.py tests/test_prequantized_updates.py
  tests/test_session_client.py tests/test_sessions.py tests/test_step_lifecycle.py tests/test_kv_engine.py
  tests/test_kv_scales.py tests/test_kv_tp_faults.py tests/test_deepgemm_direct.py tests/test_colocated.py
  tests/test_step_truth.py tests/test_decode_attention.py
)
[ -n "${MATRIX_EXTRA_TESTS:-}" ] && MATRIX_TESTS+=($MATRIX_EXTRA_TESTS)
# the trainers' own code, on the SGLang release each one pins (verl 0.9.1: 0.5.12; slime's image: 0.5.15.post1)
trainer_tests() {
  case $1 in
    0.5.12) echo tests/test_verl_integration.py tests/test_ignored_layers.py ;;
    0.5.15.post1) echo tests/test_slime_integration.py ;;
  esac
}
jobs=${MATRIX_JOBS:-2}
logs=$(mktemp -d)
versions=()
for pins in requirements/sglang-*.txt; do
  version=${pins#requirements/sglang-}; version=${version%.txt}
  [ "$version" = "$primary" ] || versions+=("$version")
done
status=0
for version in "${versions[@]}"; do  # build (or reuse) each env; collecting one small test module does it
  SGLANG_VERSION=$version bash scripts/cpu_test.sh -q --co tests/test_version_matrix.py >"$logs/$version.build" 2>&1 \
    || { echo "[cpu_matrix] SGLang $version: env build failed"; cat "$logs/$version.build"; status=1; }
done
run() {
  # shellcheck disable=SC2046
  SGLANG_VERSION=$1 bash scripts/cpu_test.sh -q -p no:cacheprovider "${MATRIX_TESTS[@]}" $(trainer_tests "$1") "${@:2}" \
    >"$logs/$1.log" 2>&1
  echo $? >"$logs/$1.rc"
}
i=0
for version in "${versions[@]}"; do
  echo "[cpu_matrix] SGLang $version: ${MATRIX_TESTS[*]} $(trainer_tests "$version")"
  run "$version" "$@" &
  i=$((i + 1))
  (( i % jobs == 0 )) && wait
done
wait
for version in "${versions[@]}"; do
  rc=$(cat "$logs/$version.rc" 2>/dev/null || echo 1)
  echo "=============================== SGLang $version (exit $rc) ==============================="
  grep -E "^(FAILED|ERROR) " "$logs/$version.log" | head -n 50
  tail -n 3 "$logs/$version.log"
  [ "$rc" = 0 ] || status=1
done
exit $status
