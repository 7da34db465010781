#!/usr/bin/env bash
# The one test command (README, .ci/run): build the pinned CPU env if needed, then run pytest.
# The env is real SGLang installed --no-deps on the local CPU torch 2.13.0 wheel, plus the small pinned
# dependencies in requirements/sglang-<version>.txt. Nothing here may pull a CUDA torch: every install is --no-deps.
# SGLANG_VERSION picks the release (default: the primary one, sglang_fp8rl/compat/versions.py); its env is .venv for
# the primary release and .venv-<version> for the others.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
primary=$(sed -n 's/^SUPPORTED_SGLANG[^(]*("\([^"]*\)".*/\1/p' sglang_fp8rl/compat/versions.py)
version=${SGLANG_VERSION:-$primary}
pins=requirements/sglang-$version.txt
[ -f "$pins" ] || { echo "[cpu_test] no pin file $pins: SGLang $version is not in the tested matrix" >&2; exit 2; }
if [ "$version" = "$primary" ]; then venv=.venv; else venv=.venv-$version; fi
stamp="$venv/.fp8rl-env-$(cat requirements/*.txt pyproject.toml | sha256sum | cut -c1-16)"
# a pin file that includes a trainer's pins (requirements/verl-0.9.1.txt) makes that trainer's integration tests
# mandatory in this env: skipping them for a missing import would hide a broken install
grep -q "^-r verl-" "$pins" && export FP8RL_REQUIRE_VERL=1

if [ ! -f "$stamp" ]; then
  t0=$(date +%s)
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # one resolver-free call: every pin is a wheel; torch==2.13.0 resolves to the local CPU wheel (pip find-links)
  "$venv/bin/pip" install --quiet --no-cache-dir --no-deps -r "$pins" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is not None)" 2>/dev/null; then
    # PyPI's Linux torch wheel is a CUDA build: take the same version from PyTorch's CPU index instead
    "$venv/bin/pip" install --quiet --no-cache-dir --no-deps --force-reinstall \
      --index-url https://download.pytorch.org/whl/cpu "$(grep -E '^torch==' "$pins")"
  fi
  "$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e .
  "$venv/bin/python" - <<'PY'
import torch
assert torch.version.cuda is None, f"a CUDA torch got into the CPU env: {torch.__version__}"
PY
  rm -f "$venv"/.fp8rl-env-*
  touch "$stamp"
  echo "[cpu_test] SGLang $version environment built in $(( $(date +%s) - t0 )) s"
fi

# FP8RL_TEST_JOBS pytest-xdist workers (default 2: most tests wait on a single-threaded SGLang worker process, so two
# at a time keep both cores busy; 1 runs in this process, as scripts/cpu_matrix.sh does with two releases at a time).
# pytest exits 5 when no test ran; that must fail CI, and it does because of set -e.
jobs=${FP8RL_TEST_JOBS:-2}
if [ "$jobs" -gt 1 ]; then set -- -n "$jobs" "$@"; fi
# a test still running after 15 minutes prints every thread's stack (the SGLang worker processes print their own)
exec "$venv/bin/python" -m pytest -o faulthandler_timeout=900 "$@"
