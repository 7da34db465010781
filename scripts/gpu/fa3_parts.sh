#!/usr/bin/env bash
# fa3_parts.sh — brings FlashAttention-3 (sglang-kernel's flash_ops.abi3.so, 1.12 GB) to a GPU machine that takes at
# most 64 MiB per call. The trimmed wheelhouse of make_wheelhouse.sh drops that file; SGLang's FA3 attention backend
# (`--attention-backend fa3`, SGLang's default on Hopper) needs it.
#
#   On the CPU machine, once (after make_wheelhouse.sh filled its cache), from the repository root:
#     bash scripts/gpu/fa3_parts.sh pack .gpu      # -> .gpu/fa3_1 .. .gpu/fa3_N (each <= 50 MB) + .gpu/fa3_1/bin/zstd
#   On the GPU machine, one call per part, back to back (the machine stays warm 30 s), after the wheelhouse install:
#     call k, carry [".gpu/bin", ".gpu/fa3_k"]:   bash scripts/gpu/fa3_parts.sh receive .gpu
#   The call that brings the last part assembles, checks the sha256 and installs flash_ops.abi3.so into
#   $GPUWH_SITE/sgl_kernel/ (default /tmp/site); it prints "[fa3] installed". Check: python3 -c
#   "from sgl_kernel.flash_attn import flash_attn_with_kvcache".
#   FA3_WHEEL picks the sglang-kernel wheel of the cache (default: the newest there), FA3_ZSTD_LEVEL the level (19).
#
# Measured once (one H100, 2026-11-25): zstd -19 turned the 1.12 GB file into 155 MB (about 15-20 min on 2 busy cores;
# -12 is much faster and a little larger); 4 parts; the first FA3 server start then spent ~100 s in its first
# prefill-graph capture (module load), the next start was normal. The GPU image has no zstd, so pack carries the
# CPU machine's zstd binary and the libraries it links (Debian's zstd links libzstd statically).
set -euo pipefail
cmd=${1:?pack|receive}; dir=${2:?folder (.gpu)}
PART=50000000
case $cmd in
pack)
  cache=${WHEEL_CACHE:-/tmp/sglang_wheel_cache}
  # FA3_WHEEL names the sglang-kernel wheel (the cache may hold several releases' kernels); else the newest there
  whl=${FA3_WHEEL:-$(ls "$cache"/sglang_kernel-*.whl 2>/dev/null | sort -V | tail -n 1)} || true
  [[ -n ${whl:-} ]] || { echo "no sglang_kernel wheel in $cache (run scripts/gpu/make_wheelhouse.sh first)"; exit 1; }
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && unzip -q -o "$whl" sgl_kernel/flash_ops.abi3.so)
  zstd -q "-${FA3_ZSTD_LEVEL:-19}" -T0 "$tmp/sgl_kernel/flash_ops.abi3.so" -o "$tmp/fo.zst"
  sum=$(sha256sum "$tmp/fo.zst" | cut -d' ' -f1)
  split -b $PART -d -a 1 "$tmp/fo.zst" "$tmp/part."
  n=$(ls "$tmp"/part.* | wc -l)
  rm -rf "$dir"/fa3_*; mkdir -p "$dir/bin"
  for p in "$tmp"/part.*; do k=$(( ${p##*.} + 1 )); mkdir -p "$dir/fa3_$k"; mv "$p" "$dir/fa3_$k/"; done
  mkdir -p "$dir/fa3_1/bin"; cp "$(command -v zstd)" "$dir/fa3_1/bin/"
  ldd "$(command -v zstd)" | awk '/=>/{print $3}' | grep -E 'zstd|lzma|lz4|libz' | xargs -r -I{} cp {} "$dir/fa3_1/bin/"
  printf 'parts=%s\nsha256=%s\nwheel=%s\n' "$n" "$sum" "$(basename "$whl")" >"$dir/fa3_1/MANIFEST"
  cp "$0" "$dir/bin/fa3_parts.sh"  # `.gpu/bin/fa3_parts.sh receive .gpu` works as well as the checkout's copy
  echo "[fa3] packed $n parts into $dir/fa3_1..$n (sha256 $sum); carry each with $dir/bin in its own call"
  ;;
receive)
  site=${GPUWH_SITE:-/tmp/site}; store=/tmp/fa3parts; mkdir -p "$store"
  for d in "$dir"/fa3_*/; do [[ -d $d ]] && cp -r "$d". "$store/"; done
  [[ -f $store/MANIFEST ]] || { echo "[fa3] part 1 (with MANIFEST) not received yet"; exit 3; }
  # shellcheck disable=SC1091
  source "$store/MANIFEST"
  have=$(ls "$store"/part.* 2>/dev/null | wc -l)
  if (( have < parts )); then echo "[fa3] have $have of $parts parts; carry the next"; exit 3; fi
  cat $(ls "$store"/part.* | sort -t. -k2 -n) >"$store/fo.zst"
  [[ $(sha256sum "$store/fo.zst" | cut -d' ' -f1) == "$sha256" ]] || { echo "[fa3] sha256 mismatch"; exit 1; }
  mkdir -p "$site/sgl_kernel"
  LD_LIBRARY_PATH="$store/bin" "$store/bin/zstd" -q -d -f "$store/fo.zst" -o "$site/sgl_kernel/flash_ops.abi3.so"
  rm -f "$store/fo.zst"
  echo "[fa3] installed $site/sgl_kernel/flash_ops.abi3.so ($wheel)"
  ;;
*) echo "usage: fa3_parts.sh pack|receive DIR"; exit 2 ;;
esac
