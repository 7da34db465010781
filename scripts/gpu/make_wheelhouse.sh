#!/usr/bin/env bash
# make_wheelhouse.sh VERSION TARGET_DIR [--cache DIR]
#
# Builds, on a CPU machine with PyPI access, the trimmed wheelhouse that lets SGLang VERSION (0.5.17 or 0.5.12; others
# are tried but untested) run on the lent GPU machine (image: Python 3.12, torch 2.11.0+cu130, no network, no
# sglang). docs/GPU.md says why each wheel is carried and why each dropped file is safe. Output:
#   TARGET_DIR/bundle1/*.whl, TARGET_DIR/bundle2/*.whl, ...  (each <= BUNDLE_MIB MiB; the repo's convention is
#                                   .gpu for 0.5.17 and .gpu-VERSION for the others, both git-ignored)
#   TARGET_DIR/bundle1/stubs/IPython/...  (tiny stub: sglang/utils.py imports IPython.display for notebooks only)
#   TARGET_DIR/bin/                 MANIFEST.txt (which bundle holds which wheel), SGLANG_VERSION, and copies of
#                                   scripts/gpu/device_env.sh and fa3_parts.sh (so that .gpu/bin/device_env.sh installs
#                                   SGLang alone, without this checkout's scripts)
# scripts/gpu/env.sh installs it on the GPU machine: SGLANG_VERSION=VERSION source scripts/gpu/env.sh (docs/GPU.md).
#
# Versions: sglang==VERSION's own METADATA pins sglang-kernel (or sgl-kernel), flashinfer-python, apache-tvm-ffi,
# xgrammar, transformers, sgl-deep-gemm, openai and soundfile; the small dependencies take the versions of
# requirements/sglang-VERSION.txt (the CPU CI pins of that release), else the defaults below.
# Nothing here is committed: wheels are downloaded from PyPI and repacked.
set -euo pipefail

VERSION=${1:?usage: make_wheelhouse.sh VERSION TARGET_DIR [--cache DIR]}
TARGET=${2:?usage: make_wheelhouse.sh VERSION TARGET_DIR [--cache DIR]}
CACHE=${WHEEL_CACHE:-/tmp/sglang_wheel_cache}
if [ "${3:-}" = "--cache" ]; then CACHE=${4:?}; fi
BUNDLE_MIB=${BUNDLE_MIB:-55}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-python3}
PINS="$ROOT/requirements/sglang-$VERSION.txt"
[ -f "$PINS" ] || PINS=/dev/null
case "$VERSION" in
  0.5.17|0.5.12) ;;
  *) echo ">> warning: SGLang $VERSION is not one of the tested wheelhouses (0.5.17, 0.5.12)" >&2 ;;
esac

PLAT=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64
      --platform manylinux1_x86_64 --platform linux_x86_64)
download() {  # cp312 wheels for x86_64 Linux, no dependencies (the list below is the dependency set)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --abi cp312 --abi abi3 --abi none "${PLAT[@]}" -d "$CACHE" "$@" 2>&1 \
    | { grep -v "is ignored: it is neither" || true; }
}
mkdir -p "$CACHE"
download "sglang==$VERSION"

# ---------------------------------------------------------------------------
# 1. What to carry. Everything else sglang imports on the serving path
#    (--attention-backend triton|flashinfer, --sampling-backend pytorch, --grammar-backend none,
#     --skip-tokenizer-init, --load-format dummy) is already in the GPU image (KINDS.md).
# ---------------------------------------------------------------------------
PKG_LIST=$("$PY" - "$CACHE" "$VERSION" "$PINS" <<'PYEOF'
import glob, os, re, sys, zipfile
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
cache, version, pins_file = sys.argv[1:]
whl = [f for f in glob.glob(os.path.join(cache, f"sglang-{version}-*.whl")) if "cp312" in f]
if not whl:
    sys.exit(f"no cp312 sglang-{version} wheel in {cache}")
meta = zipfile.ZipFile(whl[0]).read(f"sglang-{version}.dist-info/METADATA").decode()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython", "extra": ""}
declared = {}
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    pins = [s.version for s in req.specifier if s.operator == "=="]
    declared[canonicalize_name(req.name)] = pins[0] if pins else None
# the image's torch is 2.11.0+cu130; a release pinning another torch needs a different image
if declared.get("torch") not in (None, "2.11.0"):
    print(f"warning: sglang {version} pins torch=={declared['torch']}, the image has 2.11.0", file=sys.stderr)
# carried at the release's own pin (sglang-kernel was called sgl-kernel in older releases)
FROM_SGLANG = ["sglang-kernel", "sgl-kernel", "flashinfer-python", "apache-tvm-ffi", "xgrammar", "transformers",
               "sgl-deep-gemm", "openai", "soundfile"]
# carried at requirements/sglang-<version>.txt's version when listed there, else at these (resolved on 2026-11-22)
DEFAULTS = {
    # transformers (5.6.0 and 5.12.1 alike) checks tokenizers<=0.23.0 at import; the image has 0.23.2
    "tokenizers": "0.22.2",
    # HTTP server stack
    "fastapi": "0.165.0", "starlette": "1.10.0", "opentelemetry-api": "1.45.2", "uvicorn": "0.54.0",
    "python-multipart": "0.0.34", "pydantic": "2.14.3", "pydantic-core": "2.50.4", "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    # sglang runtime imports (openai's own: distro, jiter, sniffio)
    "orjson": "3.13.0", "pybase64": "1.5.1", "pyzmq": "27.3.0", "msgspec": "0.22.0", "setproctitle": "1.3.8",
    "partial-json-parser": "0.2.1.1.post7", "interegular": "0.3.3", "distro": "1.9.0", "easydict": "1.14",
    "jiter": "0.19.0", "sniffio": "1.3.1", "compressed-tensors": "0.20.0", "loguru": "0.7.3", "gguf": "0.19.0",
    "jsonschema": "4.26.0", "jsonschema-specifications": "2025.9.1", "referencing": "0.37.0", "rpds-py": "2026.9.1",
    "cffi": "2.1.1", "pycparser": "3.12", "dill": "0.4.1",
    # only for sglang.bench_offline_throughput (datasets is imported by sglang's benchmark datasets module)
    "multiprocess": "0.70.19", "datasets": "5.2.0",
    # RL: --enable-memory-saver (release/resume_memory_occupation)
    "torch-memory-saver": "0.0.9.post1",
}
# carried only where the release declares them: 0.5.17's HTTP request decompression imports zstandard
IF_DECLARED = {"zstandard": "0.25.0"}
ci_pins = {}
for line in open(pins_file):
    m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
    if m:
        ci_pins[canonicalize_name(m.group(1))] = m.group(2)
out = [f"sglang=={version}"]
for name in FROM_SGLANG:
    if name in declared:
        if declared[name] is None:
            sys.exit(f"sglang {version} declares {name} without a == pin: pick a version by hand")
        if name in ci_pins and ci_pins[name] != declared[name]:
            sys.exit(f"{pins_file} pins {name}=={ci_pins[name]}, sglang {version} declares =={declared[name]}")
        out.append(f"{name}=={declared[name]}")
if not any(o.startswith(("sglang-kernel==", "sgl-kernel==")) for o in out):
    sys.exit(f"sglang {version} declares neither sglang-kernel nor sgl-kernel")
for name, default in DEFAULTS.items():
    out.append(f"{name}=={ci_pins.get(name, default)}")
for name, default in IF_DECLARED.items():
    if name in declared:
        out.append(f"{name}=={ci_pins.get(name, default)}")
# flashinfer 0.6.11.post1 (0.5.12's pin) imports cuda.tile at module level (flashinfer/comm/all_gather_matmul),
# which SGLang reaches through its MoE token dispatchers; 0.6.15.post1 no longer does. 1.7.0 installs into the
# image's `cuda` namespace package beside cuda-bindings.
if declared.get("flashinfer-python", "").startswith("0.6.11"):
    out.append("cuda-tile==1.7.0")
print("\n".join(out))
PYEOF
)  # an assignment, so that set -e stops the script when the pin resolution fails
mapfile -t PKGS <<< "$PKG_LIST"
# Optional extras: EXTRA_PKGS="name==ver ..." make_wheelhouse.sh ...
read -r -a EXTRA <<< "${EXTRA_PKGS:-}"
echo ">> sglang $VERSION: downloading ${#PKGS[@]} wheels (+${#EXTRA[@]} extra) for cp312 into $CACHE"
printf '   %s\n' "${PKGS[@]}"
for spec in "${PKGS[@]}" "${EXTRA[@]}"; do
  [ -n "$spec" ] || continue
  download "$spec"
done

# ---------------------------------------------------------------------------
# 2. Repack: drop big files that the Hopper/triton path never loads. Patterns that match nothing in a release's wheel
#    drop nothing, so one table serves both layouts (checked for sglang-kernel 0.4.5 and 0.4.2.post2).
# ---------------------------------------------------------------------------
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
"$PY" - "$CACHE" "$STAGE" "${PKGS[@]}" "${EXTRA[@]}" <<'PYEOF'
import sys, os, re, glob, zipfile, fnmatch, shutil
try:
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # pip always vendors packaging
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
cache, stage, *specs = sys.argv[1:]
want = {}
for s in specs:
    if not s: continue
    n, v = re.split(r"==", s, 1)
    want[canonicalize_name(n)] = v

KERNEL = [
    "sgl_kernel/flash_ops.abi3.so",          # ~1 GB FA3; only sgl_kernel.flash_attn imports it (fa3 backend, lazily)
    "sgl_kernel/sm100/*",                    # load_utils.py loads sm100/ only when compute capability != 90
    "sgl_kernel/infllm_ops*.so",             # 0.4.5: InfLLM-v2 attention, loaded lazily by infllm_v2/_loader.py
    "sgl_kernel/flashmla_ops.abi3.so",       # FlashMLA (DeepSeek MLA); flash_mla.py's import is try/except
    # 0.4.2.post2: mscclpp's own files beside sgl_kernel/: its Python binding is built for CPython 3.10 only
    # (_mscclpp.cpython-310-*.so, unimportable on 3.12), with its shared/static libraries and headers; nothing in
    # sgl_kernel or sglang loads them (common_ops links mscclpp statically; its NEEDED list has no mscclpp)
    "_mscclpp.cpython-*.so", "lib/*mscclpp*", "include/*", "lib64/*",
]
# name -> patterns of archive members to drop (docs/GPU.md, "Notes on the trimmed wheelhouse")
DROP = {
    "sglang-kernel": KERNEL,
    "sgl-kernel": KERNEL,
    "sglang": [
        "sglang/srt/server/_core*.so",           # embedded Rust server, only with SGLANG_RUST_SERVER=1 (0.5.17)
        "sglang/srt/grpc/_core*.so",             # native gRPC, only with --grpc-port
        "sglang/srt/multimodal/_core*.so",       # Rust image preprocess, SGLANG_INKLING_RS_MM_PREPROCESS=1 (0.5.17)
        "sglang/multimodal_gen/*",               # diffusion server (sglang[diffusion]); never imported by srt
    ],
    "xgrammar": [
        "xgrammar/lib/libxgrammar.a",            # static library for C++ builds; Python uses libxgrammar_bindings.so
    ],
}
found = {}
def _ok(tags):  # a wheel usable by CPython 3.12 on x86_64 Linux
    return any((t.interpreter in ("cp312", "py312", "py3", "py2.py3") or t.abi == "abi3"
                or t.interpreter.startswith("py3")) and (t.platform == "any" or "x86_64" in t.platform) for t in tags)
for f in sorted(glob.glob(os.path.join(cache, "*.whl"))):
    name, ver, _, tags = parse_wheel_filename(os.path.basename(f))
    name = canonicalize_name(name)
    if name in want and str(ver) == want[name] and _ok(tags):
        if any(t.interpreter in ("cp311", "py311") for t in tags): continue
        found[name] = f
missing = sorted(set(want) - set(found))
if missing:
    sys.exit(f"missing wheels for: {missing}")
for name, f in sorted(found.items()):
    out = os.path.join(stage, os.path.basename(f))
    pats = DROP.get(name)
    if not pats:
        shutil.copy2(f, out); continue
    zin = zipfile.ZipFile(f)
    dropped = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        record_name = None
        for info in zin.infolist():
            fn = info.filename
            if fn.endswith(".dist-info/RECORD"):
                record_name = fn; continue
            if any(fnmatch.fnmatch(fn, p) for p in pats):
                dropped.append((fn, info.file_size)); continue
            zout.writestr(info, zin.read(fn))
        # RECORD stays consistent: drop the lines of removed files
        gone = {d[0] for d in dropped}
        rec = zin.read(record_name).decode().splitlines()
        rec = [l for l in rec if l.split(",", 1)[0] not in gone]
        zout.writestr(record_name, "\n".join(rec) + "\n")
    print(f"repacked {os.path.basename(f)}: dropped {len(dropped)} files, "
          f"{sum(d[1] for d in dropped)/2**20:.1f} MiB uncompressed; "
          f"{os.path.getsize(f)/2**20:.1f} -> {os.path.getsize(out)/2**20:.1f} MiB")
PYEOF

# ---------------------------------------------------------------------------
# 3. Split into bundles of at most BUNDLE_MIB MiB (first-fit decreasing).
# ---------------------------------------------------------------------------
rm -rf "$TARGET"/bundle[0-9]* "$TARGET/bin"
mkdir -p "$TARGET/bin"
"$PY" - "$STAGE" "$TARGET" "$BUNDLE_MIB" <<'PYEOF'
import sys, os, shutil
stage, target, cap = sys.argv[1], sys.argv[2], float(sys.argv[3]) * 2**20
ws = sorted(((os.path.getsize(os.path.join(stage, f)), f) for f in os.listdir(stage)), reverse=True)
reserve = 64 * 1024  # room for stubs/ in bundle1
n = 1
while True:  # fewest bundles, balanced (largest wheel into the lightest bundle)
    bins = [[reserve if i == 0 else 0, []] for i in range(n)]
    for size, f in ws:
        b = min(bins, key=lambda b: b[0]); b[0] += size; b[1].append(f)
    if max(b[0] for b in bins) <= cap: break
    n += 1
    if n > 20: sys.exit("a single wheel is larger than the bundle cap")
lines = []
for i, (tot, fs) in enumerate(bins, 1):
    d = os.path.join(target, f"bundle{i}"); os.makedirs(d, exist_ok=True)
    for f in fs:
        shutil.move(os.path.join(stage, f), os.path.join(d, f))
        lines.append(f"bundle{i}\t{os.path.getsize(os.path.join(d, f))/2**20:8.2f} MiB\t{f}")
    lines.append(f"bundle{i}\tTOTAL {tot/2**20:.2f} MiB")
open(os.path.join(target, "bin", "MANIFEST.txt"), "w").write("\n".join(lines) + "\n")
print("\n".join(l for l in lines if "TOTAL" in l))
PYEOF

# ---------------------------------------------------------------------------
# 4. Stub for a module that sglang imports unconditionally but never uses on a server: sglang/utils.py does
#    `from IPython.display import HTML, display` (notebook helpers only, 0.5.12 and 0.5.17). Real IPython would
#    add ~10 wheels.
# ---------------------------------------------------------------------------
S="$TARGET/bundle1/stubs/IPython"
mkdir -p "$S"
cat > "$S/__init__.py" <<'EOF'
"""Stub of IPython for sglang on the lent GPU machine (docs/GPU.md).
sglang/utils.py imports IPython.display at module level for notebook helpers only."""
__version__ = "0.0.0+sglang-stub"
def get_ipython():  # what real IPython returns outside a notebook
    return None
EOF
cat > "$S/display.py" <<'EOF'
"""Stub: sglang only uses these in notebook helpers (sglang/utils.py)."""
class HTML:
    def __init__(self, data=None, *a, **k): self.data = data
    def __repr__(self): return f"HTML({self.data!r})"
def display(*objs, **kw):
    for o in objs: print(o)
EOF

# ---------------------------------------------------------------------------
# 5. sglang-kernel 0.4.2.post2 (SGLang 0.5.12) links its sm90/common_ops against libnuma.so.1; 0.4.5's does not, so
#    the 0.5.17 runs never showed whether the GPU image has it. A copy of this machine's (52 KB, needs glibc >= 2.33)
#    travels in bundle1/stubs/_syslibs; scripts/gpu/env.sh puts it on LD_LIBRARY_PATH only where ldconfig lacks it.
# ---------------------------------------------------------------------------
KWHL=
for f in "$TARGET"/bundle*/sglang_kernel-*.whl "$TARGET"/bundle*/sgl_kernel-*.whl; do [ -f "$f" ] && KWHL=$f; done
if [ -n "$KWHL" ] && "$PY" - "$KWHL" <<'PYEOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
# the NEEDED entries are strings of the ELF's .dynstr: their presence is what matters here
sys.exit(0 if any(b"libnuma.so.1" in z.read(n) for n in z.namelist() if n.endswith("common_ops.abi3.so")) else 1)
PYEOF
then
  NUMA=$(ldconfig -p 2>/dev/null | awk '/libnuma\.so\.1 .*x86-64/ {print $NF; exit}')
  if [ -n "$NUMA" ]; then
    mkdir -p "$TARGET/bundle1/stubs/_syslibs" && cp -L "$NUMA" "$TARGET/bundle1/stubs/_syslibs/libnuma.so.1"
    echo ">> $(basename "$KWHL") needs libnuma.so.1: carried a copy of $NUMA"
  else
    echo ">> warning: $(basename "$KWHL") needs libnuma.so.1 and this machine has none to carry" >&2
  fi
fi

# copies in bin/: `source .gpu/bin/device_env.sh` installs SGLang alone (without this package), and FA3 parts packed
# earlier (fa3_parts.sh; a rebuild rewrites only bundle*/ and bin/) are still received by `.gpu/bin/fa3_parts.sh`
cp "$HERE/device_env.sh" "$HERE/fa3_parts.sh" "$TARGET/bin/"
echo "$VERSION" > "$TARGET/bin/SGLANG_VERSION"
echo ">> done: $(du -sh "$TARGET" | cut -f1) in $TARGET"
cat "$TARGET/bin/MANIFEST.txt"
