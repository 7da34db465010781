# device_env.sh — installs a trimmed SGLang wheelhouse (scripts/gpu/make_wheelhouse.sh) on the GPU machine. Sourced
# by scripts/gpu/env.sh; make_wheelhouse.sh also copies it to TARGET_DIR/bin, so that, from the repository root,
#
#     source .gpu/bin/device_env.sh || exit 1
#
# installs SGLang alone (without this package). Name `.gpu/bin` and the bundle(s) of this call, e.g. `.gpu/bundle1`,
# in the call's `carry` (docs/GPU.md).
#
# Installs every WHEELHOUSE/bundleN/*.whl present into $GPUWH_SITE (default /tmp/site) with pip --target (no network,
# no deps), copies the stubs, and exports PYTHONPATH. A bundle already installed on this machine (marker file) is
# skipped, so the bundles can arrive over several consecutive calls while the machine stays warm.
# Returns 0 when every bundle listed in WHEELHOUSE/bin/MANIFEST.txt is installed, 3 when some are still missing (carry
# them in the next call), 1 on an install error.
#
# Optional args: source device_env.sh [WHEELHOUSE_DIR] [SITE_DIR]   (WHEELHOUSE_DIR defaults to this file's bin/'s
# parent, i.e. .gpu for .gpu/bin/device_env.sh)

_sgl_wh=${1:-$(dirname "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)")}
export GPUWH_SITE=${2:-${GPUWH_SITE:-/tmp/site}}
export GPUWH_STUBS=${GPUWH_SITE}-stubs
mkdir -p "$GPUWH_SITE" "$GPUWH_STUBS"

_sgl_rc=0
for _b in "$_sgl_wh"/bundle*/; do
  [ -d "$_b" ] || continue
  _n=$(basename "$_b")
  ls "$_b"/*.whl >/dev/null 2>&1 || continue
  _sig=$(cd "$_b" && ls *.whl | sort | md5sum | cut -c1-12)
  if [ -f "$GPUWH_SITE/.installed-$_n-$_sig" ]; then
    echo "[device_env] $_n already installed in $GPUWH_SITE"
  else
    _t0=$(date +%s)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
         --upgrade --target "$GPUWH_SITE" "$_b"/*.whl > "$GPUWH_SITE/.pip-$_n.log" 2>&1
    if [ $? != 0 ]; then
      echo "[device_env] pip failed for $_n:"; tail -20 "$GPUWH_SITE/.pip-$_n.log"; _sgl_rc=1; continue
    fi
    touch "$GPUWH_SITE/.installed-$_n-$_sig"
    echo "[device_env] installed $_n ($(ls "$_b"/*.whl | wc -l) wheels) in $(( $(date +%s) - _t0 )) s"
  fi
  [ -d "$_b/stubs" ] && cp -r "$_b/stubs/." "$GPUWH_STUBS/"
done

# a bundle not carried yet leaves no marker: the manifest is what says the install is complete
if [ -f "$_sgl_wh/bin/MANIFEST.txt" ]; then
  for _n in $(cut -f1 "$_sgl_wh/bin/MANIFEST.txt" | sort -u); do
    if ! ls "$GPUWH_SITE"/.installed-"$_n"-* >/dev/null 2>&1; then
      echo "[device_env] MISSING $_n: carry it in this call or the one just before (machine must stay warm)"
      [ $_sgl_rc = 0 ] && _sgl_rc=3
    fi
  done
fi

case ":${PYTHONPATH:-}:" in
  *":$GPUWH_SITE:"*) ;;
  *) export PYTHONPATH="$GPUWH_SITE:$GPUWH_STUBS${PYTHONPATH:+:$PYTHONPATH}"
     export PATH="$GPUWH_SITE/bin:$PATH" ;;
esac
# sglang checks sglang-kernel's version through its dist-info (present: pip --target keeps it).
# The machine has no network: the HF hub must not try.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1
# flashinfer / triton JIT caches in /tmp (a fresh machine each lease)
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
unset _b _n _sig _t0 _sgl_wh
return $_sgl_rc 2>/dev/null || exit $_sgl_rc
