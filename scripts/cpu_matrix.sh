#!/usr/bin/env bash
# The other supported SGLang releases (one requirements/sglang-<version>.txt each, the primary one excepted): build
# each pinned CPU env and run the tests that touch SGLang's internals there: the plugin and the demo, the update path
# (malformed requests, replayed writes, pre-quantized payloads, sessions) and the FP8 KV scales.
# The full suite runs on the primary release (scripts/cpu_test.sh with no SGLANG_VERSION).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
primary=$(sed -n 's/^SUPPORTED_SGLANG[^(]*("\([^"]*\)".*/\1/p' sglang_fp8rl/compat/versions.py)
MATRIX_TESTS=(
  tests/test_plugin.py tests/test_version_matrix.py tests/test_demo_cpu.py
  tests/test_malformed_updates.py tests/test_replayed_writes.py tests/test_prequantized_updates.py
  tests/test_weight_updates.py tests/test_kv_scales.py
)
[ -n "${MATRIX_EXTRA_TESTS:-}" ] && MATRIX_TESTS+=($MATRIX_EXTRA_TESTS)
status=0
for pins in requirements/sglang-*.txt; do
  version=${pins#requirements/sglang-}; version=${version%.txt}
  [ "$version" = "$primary" ] && continue
  echo "[cpu_matrix] SGLang $version: ${MATRIX_TESTS[*]}"
  SGLANG_VERSION=$version bash scripts/cpu_test.sh -q "${MATRIX_TESTS[@]}" "$@" || status=1
done
exit $status
