# Source on the GPU machine (device tool), from the repo root:  source scripts/gpu/env.sh || exit 1
# 1. installs SGLang 0.5.17's trimmed wheelhouse (.gpu/, built by ../shared/gpu/make_wheelhouse.sh; see docs/GPU.md)
# 2. installs this package (non-editable, so its sglang.srt.plugins entry point is visible to every spawned process)
# Returns non-zero if a wheelhouse bundle is still missing (the machine went cold: redo the two install calls).
source .gpu/bin/device_env.sh || return $?
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "${GPUWH_SITE:-/tmp/site}" . \
  >/tmp/fp8rl_install.log 2>&1 || { cat /tmp/fp8rl_install.log; return 1; }
rm -rf "${GPUWH_SITE:-/tmp/site}"/build 2>/dev/null
export PYTHONUNBUFFERED=1
export FP8RL_REPO="$(pwd)"
python3 - <<'PY' || return 1
from importlib.metadata import entry_points
eps = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
assert "fp8_online_blockwise" in eps, eps
print("[fp8rl env] plugin entry point:", eps)
PY
