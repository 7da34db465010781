#!/usr/bin/env bash
# The other supported SGLang releases (one requirements/sglang-<version>.txt each, the primary one excepted): build
# each pinned CPU env and run the tests that touch SGLang's internals there. The full suite runs on the primary
# release (scripts/cpu_test.sh with no SGLANG_VERSION). Here, in tiers that keep CI inside its 45 minutes:
# - every release: the plugin and the demo, the version adapters, malformed requests, the step's lifecycle, the
#   direct DeepGEMM call, the decode-attention dispatcher and its query adapter, and the weight-update sessions of the releases that have
#   them (skipped on the others) (CORE_TESTS);
# - the oldest and the newest release also replayed writes against the model's own loaders (the primary release runs
#   them too, so the loaders of the releases between are bracketed: ENDS_TESTS);
# - the oldest release (verl's) also the FP8 KV cache and its scales and verl's colocated release/resume cycle;
# - the newest release the whole update path as well (pre-quantized payloads, the release and resume of GPU memory,
#   KV faults across TP ranks: FULL_TESTS);
# - the trainers' own code on the release each pins (verl 0.9.1: 0.5.12; slime's image: 0.5.15.post1).
# `cpu_matrix.sh build` only builds the envs (.ci/run starts it beside the README's test command); then
# `cpu_matrix.sh` runs the tests, MATRIX_JOBS releases at a time (default 2, longest first: one single-threaded
# pytest process per release). Each release's output goes to its own log, printed at the end.
set -uo pipefail
export FP8RL_TEST_JOBS=1  # two releases run at a time: one pytest process each
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
primary=$(sed -n 's/^SUPPORTED_SGLANG[^(]*("\([^"]*\)".*/\1/p' sglang_fp8rl/compat/versions.py)
# (test_weight_updates.py and test_client.py run on the primary release only: CI's 45-minute budget; the update
# path they share is covered here by the malformed-request suite, replayed writes, pre-quantized payloads and sessions)
CORE_TESTS=(
  tests/test_plugin.py tests/test_version_matrix.py tests/test_demo_cpu.py tests/test_gpu_flags.py
  tests/test_malformed_updates.py tests/test_step_lifecycle.py
  tests/test_deepgemm_direct.py tests/test_decode_attention.py tests/test_decode_query.py
  tests/test_sessions.py tests/test_session_client.py tests/test_step_truth.py
)
ENDS_TESTS=(tests/test_replayed_writes.py)
OLDEST_TESTS=("${ENDS_TESTS[@]}" tests/test_kv_engine.py tests/test_kv_scales.py tests/test_colocated.py)
FULL_TESTS=(
  "${CORE_TESTS[@]}" "${OLDEST_TESTS[@]}" tests/test_prequantized_updates.py tests/test_kv_tp_faults.py
)
[ -n "${MATRIX_EXTRA_TESTS:-}" ] && CORE_TESTS+=($MATRIX_EXTRA_TESTS) && FULL_TESTS+=($MATRIX_EXTRA_TESTS)
# the trainers' own code, on the SGLang release each one pins (verl 0.9.1: 0.5.12; slime's image: 0.5.15.post1)
trainer_tests() {
  case $1 in
    0.5.12) echo tests/test_verl_integration.py tests/test_ignored_layers.py ;;
    0.5.15.post1) echo tests/test_slime_integration.py ;;
  esac
}
jobs=${MATRIX_JOBS:-2}
logs=$(mktemp -d)
versions=()  # oldest first
for version in $(ls requirements/sglang-*.txt | sed 's|requirements/sglang-||; s|\.txt$||' | sort -V); do
  [ "$version" = "$primary" ] || versions+=("$version")
done
oldest=${versions[0]}
newest=${versions[${#versions[@]}-1]}
tests_for() {  # the tier of a release (the header)
  if [ "$1" = "$newest" ]; then echo "${FULL_TESTS[@]}"
  elif [ "$1" = "$oldest" ]; then echo "${CORE_TESTS[@]}" "${OLDEST_TESTS[@]}"
  else echo "${CORE_TESTS[@]}"; fi
  trainer_tests "$1"
}
status=0
for version in "${versions[@]}"; do  # build (or reuse) each env; collecting one small test module does it
  SGLANG_VERSION=$version bash scripts/cpu_test.sh -q --co tests/test_version_matrix.py >"$logs/$version.build" 2>&1 \
    || { echo "[cpu_matrix] SGLang $version: env build failed"; cat "$logs/$version.build"; status=1; }
done
[ "${1:-}" = build ] && exit $status
run() {
  # shellcheck disable=SC2046
  SGLANG_VERSION=$1 bash scripts/cpu_test.sh -q -p no:cacheprovider $(tests_for "$1") "${@:2}" >"$logs/$1.log" 2>&1
  echo $? >"$logs/$1.rc"
}
# longest first (the newest release's full tier, then the oldest's), each next release as soon as a slot frees
order=("$newest" "$oldest")
for version in "${versions[@]}"; do
  [ "$version" = "$newest" ] || [ "$version" = "$oldest" ] || order+=("$version")
done
running=0
for version in "${order[@]}"; do
  if (( running >= jobs )); then wait -n; running=$((running - 1)); fi
  echo "[cpu_matrix] SGLang $version: $(tests_for "$version")"
  run "$version" "$@" &
  running=$((running + 1))
done
wait
for version in "${order[@]}"; do
  rc=$(cat "$logs/$version.rc" 2>/dev/null || echo 1)
  echo "=============================== SGLang $version (exit $rc) ==============================="
  grep -E "^(FAILED|ERROR) " "$logs/$version.log" | head -n 50
  tail -n 3 "$logs/$version.log"
  [ "$rc" = 0 ] || status=1
done
exit $status
