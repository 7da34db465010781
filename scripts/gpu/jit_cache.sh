#!/usr/bin/env bash
# jit_cache.sh — carries the first launch's kernel compilations (Triton, DeepGEMM, SGLang's JIT kernels) from one GPU
# machine to the next, which starts bare: a first FP8 process spends 90-180 s compiling what an earlier machine of the
# same card generation (sm90) already compiled. Every cache is keyed by its kernel's source and its compiler, so a
# stale entry is never used, only recompiled.
#
#   On the GPU machine, at the end of a call:    bash scripts/gpu/jit_cache.sh save "$OUT"
#     -> $OUT/jit_cache.tgz.0 .. (parts of at most 15 MB each, at most JIT_CACHE_MAX_PARTS); copy them here into
#        .gpu/jit_cache/ (git-ignored)
#   At the start of a later call, carrying ".gpu/jit_cache":   bash scripts/gpu/jit_cache.sh restore .gpu/jit_cache
set -euo pipefail
cmd=${1:?save|restore}; dir=${2:?folder}
PART=15000000
MAX_PARTS=${JIT_CACHE_MAX_PARTS:-3}
# the compilation caches device_env.sh and SGLang set: Triton's under /tmp, DeepGEMM's where the benchmarks put it
# (SGLANG_DG_CACHE_DIR=/tmp/dg_cache: bench_rollout.py, decode_roofline.py) or SGLang's default under ~/.cache, tvm-ffi's
CACHES=("${TRITON_CACHE_DIR:-/tmp/triton_cache}" "${SGLANG_DG_CACHE_DIR:-/tmp/dg_cache}" "$HOME/.cache/deep_gemm"
        "$HOME/.cache/tvm-ffi")
case $cmd in
save)
  have=(); for c in "${CACHES[@]}"; do [ -d "$c" ] && have+=("${c#/}"); done
  [ ${#have[@]} -gt 0 ] || { echo "[jit_cache] nothing to save"; exit 0; }
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  tar -C / -czf "$tmp/c.tgz" "${have[@]}"
  split -b $PART -d -a 1 "$tmp/c.tgz" "$tmp/jit_cache.tgz."
  n=$(ls "$tmp"/jit_cache.tgz.* | wc -l)
  if [ "$n" -gt "$MAX_PARTS" ]; then
    echo "[jit_cache] $(du -h "$tmp/c.tgz" | cut -f1) is more than $MAX_PARTS parts: not saved"; exit 0
  fi
  mkdir -p "$dir"; mv "$tmp"/jit_cache.tgz.* "$dir/"
  echo "[jit_cache] saved ${have[*]} ($(du -h "$tmp/c.tgz" | cut -f1), $n parts) into $dir"
  ;;
restore)
  ls "$dir"/jit_cache.tgz.* >/dev/null 2>&1 || { echo "[jit_cache] no parts in $dir"; exit 0; }
  cat "$dir"/jit_cache.tgz.* | tar -C / -xzf -
  echo "[jit_cache] restored $(ls "$dir"/jit_cache.tgz.* | wc -l) parts"
  ;;
*) echo "usage: jit_cache.sh save|restore FOLDER"; exit 2 ;;
esac
