# Source on the GPU machine, from the repo root:
#     [SGLANG_VERSION=0.5.12] source scripts/gpu/env.sh || exit 1
# 1. installs the trimmed SGLang wheelhouse of SGLANG_VERSION (default 0.5.17) with scripts/gpu/device_env.sh: .gpu/
#    into /tmp/site for 0.5.17 (scripts/gpu/make_wheelhouse.sh 0.5.17 .gpu), .gpu-VERSION/ into /tmp/site-VERSION for
#    the others (scripts/gpu/make_wheelhouse.sh VERSION .gpu-VERSION); see docs/GPU.md
# 2. installs this package there (non-editable, so that its sglang.srt.plugins entry point is visible to every
#    spawned process)
# Returns non-zero if a wheelhouse bundle is still missing (the machine went cold: redo the two install calls).
# One version per shell: device_env.sh puts its site on PYTHONPATH, so a second version sourced later would be shadowed.
if [ "${SGLANG_VERSION:-0.5.17}" = 0.5.17 ]; then
  _fp8rl_wh=.gpu; export GPUWH_SITE=/tmp/site  # .gpu/bin/device_env.sh's own default: one site either way
else
  _fp8rl_wh=.gpu-$SGLANG_VERSION; export GPUWH_SITE=/tmp/site-$SGLANG_VERSION  # one site per release: no mixing
fi
# scripts/gpu/make_wheelhouse.sh records the release it built for (a wheelhouse without the record is taken as asked)
_fp8rl_built=$(cat "$_fp8rl_wh/bin/SGLANG_VERSION" 2>/dev/null || echo "${SGLANG_VERSION:-0.5.17}")
if [ "$_fp8rl_built" != "${SGLANG_VERSION:-0.5.17}" ]; then
  echo "[fp8rl env] $_fp8rl_wh holds SGLang $_fp8rl_built, not ${SGLANG_VERSION:-0.5.17}"; return 1
fi
unset _fp8rl_built
# without the manifest, device_env.sh could not tell that a bundle is missing
if [ ! -f "$_fp8rl_wh/bin/MANIFEST.txt" ]; then
  echo "[fp8rl env] no $_fp8rl_wh/bin/MANIFEST.txt: name $_fp8rl_wh/bin in the call's carry"; return 1
fi
source scripts/gpu/device_env.sh "$_fp8rl_wh" "$GPUWH_SITE" || return $?
unset _fp8rl_wh
# system libraries a release's kernels need that the image may lack (make_wheelhouse.sh step 5: libnuma.so.1 for
# sglang-kernel 0.4.2.post2): used only where the image's loader cache has none
for _fp8rl_lib in "${GPUWH_STUBS:-/nonexistent}"/_syslibs/*; do
  [ -e "$_fp8rl_lib" ] || continue
  if ! ldconfig -p 2>/dev/null | grep -qF "$(basename "$_fp8rl_lib") ("; then
    export LD_LIBRARY_PATH="$GPUWH_STUBS/_syslibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "[fp8rl env] the image has no $(basename "$_fp8rl_lib"): using the wheelhouse's copy"
    break
  fi
done
unset _fp8rl_lib
python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "$GPUWH_SITE" . \
  >/tmp/fp8rl_install.log 2>&1 || { cat /tmp/fp8rl_install.log; return 1; }
rm -rf "$GPUWH_SITE"/build 2>/dev/null
export PYTHONUNBUFFERED=1
export FP8RL_REPO="$(pwd)"
python3 - <<'PY' || return 1
from importlib.metadata import entry_points, version
eps = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
assert "fp8_online_blockwise" in eps, eps
print("[fp8rl env] sglang", version("sglang"), "plugin entry point:", eps)
PY
