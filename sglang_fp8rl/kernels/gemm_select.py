"""Per-shape block-FP8 GEMM selection: measure at load, cache on disk, look up at apply time.

For a block-FP8 linear (weight [N, K] e4m3fn, ``weight_scale_inv`` [N/128, K/128] float32, 1x128 activation groups
quantized inside the candidate) and an M bucket it picks one named candidate:

* ``deepgemm_default``: SGLang's ``dispatch_w8a8_block_fp8_linear()`` (DeepGEMM ``sm90_fp8_gemm_1d2d`` on H100),
  i.e. exactly SGLang's path; also the fallback whenever nothing valid is cached;
* ``deepgemm_sms_{n}``: the same call inside SGLang's ``deep_gemm_wrapper.configure_deep_gemm_num_sms(n)``. DeepGEMM's
  heuristic then picks another tile: for gate_up (N=24576, K=4096) at M 96-128 its own choice is a register-spilling
  128x192 tile without multicast (101 us), while with ``num_sms <= 124`` it picks 128x112 / 128x128 (42 us;
  ``shared/research/gpu_gemm_micro.md``). ``num_sms`` is host state read when the launch is built, so a captured CUDA
  graph keeps the launch it recorded;
* ``fp8rl_n64_sk4``: our decode kernel (:mod:`sglang_fp8rl.kernels.block_gemm`, swap-AB, deterministic split-K)
  after SGLang's 1x128 activation quantization, tried at M <= 16 only;
* ``triton_default`` (SGLang's ``triton_w8a8_block_fp8_linear``) and our other kernel configurations are candidates
  of ``scripts/bench_gemm.py`` but not of the server: on H100 they never won a bucket (docs/RESULTS.md, sec. 7b).

When: :func:`prepare_model` runs once after the model is loaded and before CUDA graphs are captured. It looks up
every (N, K) of the model's blockwise layers on this rank in the cache (keyed by GPU, SM count and the versions of
torch / triton / sglang / deep_gemm), measures what is missing (mode ``auto``) within a wall budget, writes the
cache, and logs the table once. Shapes are measured largest weight first, so a budget cut leaves the small shapes
on the default (see :func:`autotune` for the two phases). Each measurement: a first eager call (JIT), a float64
check of the block-scaled product on one column per 16, then a CUDA-graph timing with the weights rotated out of
L2. A candidate that fails the check or raises is rejected for that entry; a non-default one must beat the default
by ``MIN_GAIN``.

Modes (``--fp8rl-gemm-select``): ``auto`` (default) tune what is missing at load; ``cache`` only use cached choices;
``off`` always SGLang's dispatch.

Buckets (``m_bucket``): 1, 2, 4, 8, then multiples of 16 up to 256, then 320, 384, 448, 512, then powers of two.
SGLang's decode CUDA graphs use bs 1, 2, 4, 8, 12, 16, 24, ..., 256, so every captured bs maps to one bucket and the
128 / 129 DeepGEMM edge is a bucket edge. A bucket is measured at its upper edge (``points="upper"``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sglang_fp8rl.server_args import DEFAULT_GEMM_TUNE_BUDGET_S

logger = logging.getLogger(__name__)

ENV_CACHE = "FP8RL_GEMM_SELECT_CACHE"  # path of the JSON cache (default ~/.cache/sglang_fp8rl/gemm_select.json)

SCHEMA = 2
DEFAULT = "deepgemm_default"
TRITON = "triton_default"
SMS_PREFIX = "deepgemm_sms_"
OURS_PREFIX = "fp8rl_"
DEFAULT_SMS = (124, 112)  # num_sms variants: 124 / 112 fix gate_up at M 80-128 (x2.3); fewer SMs never won
# (block_n, split_k) of block_gemm kept as candidates, and the largest M they are tried at: on H100 (docs/RESULTS.md,
# bench_gemm) split-K 4 beat DeepGEMM only at M <= 8 (o_proj / down / qkv at M=1: x1.16 / x1.16 / x1.05) and every
# config lost above M=16, so the others are left out of the load-time measurement (bench_gemm.py measures them all)
OURS_CONFIGS = ((64, 4),)
ALL_OURS_CONFIGS = ((64, 1), (64, 2), (64, 4), (128, 1))
OURS_MAX_M = 16
DEFAULT_MAX_M = 256
DEFAULT_BUDGET_S = DEFAULT_GEMM_TUNE_BUDGET_S
REL_TOL = 1e-2  # rel. Frobenius error vs the float64 block-scaled product; measured 1.7e-3 for DeepGEMM/Triton
MIN_GAIN = 0.03
ALT_BELOW = 0.70  # alternatives are measured where the default moves less than this fraction of copy bandwidth
# ... and DeepGEMM num_sms variants (a JIT compile each) only below this: on H100 the variants won by x2.3 where the
# default reached 33-35 % (gate_up, M 80-128) and by <= 6.5 % anywhere else (docs/RESULTS.md, sec. 7c)
VARIANT_BELOW = 0.50
BLOCK = (128, 128)
WARMUP_LOG = "[fp8rl] DeepGEMM JIT warm-up for %s: %s"  # parsed by scripts/bench_startup.py

# process state: the cached entries of this environment, the registry, the valid choice per shape key (derived from
# both once, for the apply path), SGLang's default linear
_STATE: dict[str, Any] = {"entries": None, "info": None, "registry": None, "choices": None, "default_linear": None}

_SMALL = (1, 2, 4, 8)
_BUCKETS = _SMALL + tuple(range(16, 257, 16)) + (320, 384, 448, 512)


# ---------------------------------------------------------------------------------------------------------------------
# buckets


def m_bucket(m: int) -> int:
    """The bucket of ``m`` tokens: the smallest bucket >= m (powers of two above 512)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    for b in _BUCKETS:
        if m <= b:
            return b
    return 1 << (m - 1).bit_length()


def buckets_upto(max_m: int) -> list[int]:
    """All buckets <= m_bucket(max_m), ascending."""
    top = m_bucket(max_m)
    out = [b for b in _BUCKETS if b <= top]
    b = 1024
    while b <= top:
        out.append(b)
        b *= 2
    return out


def bucket_points(bucket: int, points: str = "upper") -> tuple[int, ...]:
    """The M values measured for a bucket: its upper edge, or (previous bucket + 1, upper edge)."""
    if points not in ("upper", "both"):
        raise ValueError(f"points must be 'upper' or 'both', got {points!r}")
    lower = max([b for b in buckets_upto(bucket) if b < bucket], default=0) + 1
    return (bucket,) if points == "upper" or lower == bucket else (lower, bucket)


# ---------------------------------------------------------------------------------------------------------------------
# mode, environment


def mode() -> str:
    """``--fp8rl-gemm-select`` of this process: auto (default), cache or off."""
    from sglang_fp8rl.server_args import get_options

    return get_options().gemm_select


def cache_path() -> str:
    return os.environ.get(ENV_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "sglang_fp8rl",
                                                     "gemm_select.json")


def _dist_version(*names: str) -> str:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "none"


def env_info(device=None) -> dict[str, str]:
    """What a measurement depends on: GPU name, capability, SM count, torch/triton/sglang/deep_gemm versions."""
    import torch

    info = {"gpu": "cpu", "capability": "none", "sms": "0"}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        info = {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": str(props.multi_processor_count)}
    info.update({
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "sglang": _dist_version("sglang"),
        "sgl_kernel": _dist_version("sgl-kernel", "sgl_kernel"),
        "deep_gemm": _dist_version("sgl-deep-gemm", "deep_gemm", "deep-gemm"),
        "sglang_fp8rl": _dist_version("sglang-fp8rl"),
        "schema": str(SCHEMA),
    })
    return info


def env_key(info: dict[str, str]) -> str:
    """Stable string of an ``env_info`` dict: any change (GPU, versions, schema) gives a new key."""
    return "|".join(f"{k}={info[k]}" for k in sorted(info))


def shape_key(n: int, k: int, bucket: int) -> str:
    return f"N={n},K={k},M={bucket}"


def parse_shape_key(key: str) -> tuple[int, int, int]:
    d = dict(part.split("=") for part in key.split(","))
    return int(d["N"]), int(d["K"]), int(d["M"])


# ---------------------------------------------------------------------------------------------------------------------
# cache: {"schema": 2, "envs": {env_key: {"info": {...}, "entries": {shape_key: entry}}}}
# entry: {"choice": name, "candidates": [names of the registry], "us": {name: us}, "rejected": {name: reason},
#         "skipped": {name: reason}, "first_call_s": {name: s}, "rel_err": {name: err}, "points": [M],
#         "default_frac_copy_bw": fraction, "copy_GBs": GB/s, "time": unix}


def load_cache(path: str | None = None) -> dict:
    """The whole cache file; an empty cache if missing, unreadable or of another schema."""
    path = path or cache_path()
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {"schema": SCHEMA, "envs": {}}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("envs"), dict):
        return {"schema": SCHEMA, "envs": {}}
    return data


def write_json_atomic(path: str, data: Any) -> str:
    """Write ``data`` as JSON through a temp file and a rename: readers see the old file or the new one, whole."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


def save_cache(data: dict, path: str | None = None) -> str:
    """Atomic write of the whole cache."""
    return write_json_atomic(path or cache_path(), data)


def env_entries(data: dict, info: dict[str, str]) -> dict[str, dict]:
    """The entries of one environment (created empty if absent)."""
    env = data.setdefault("envs", {}).setdefault(env_key(info), {"info": dict(info), "entries": {}})
    return env["entries"]


def merge_entries(path: str | None, info: dict[str, str], entries: dict[str, dict]) -> str:
    """Re-read the file, add/replace ``entries`` of this environment, write it back."""
    data = load_cache(path)
    env_entries(data, info).update(entries)
    return save_cache(data, path)


def valid_choice(entry: dict | None, names: Iterable[str]) -> str | None:
    """The entry's choice if it was measured against exactly the current candidate set, else None (stale)."""
    if not entry or sorted(entry.get("candidates", [])) != sorted(names):
        return None
    choice = entry.get("choice")
    return choice if choice in set(names) else None


def select(m: int, n: int, k: int, entries: dict | None = None, names: Iterable[str] | None = None) -> str:
    """Candidate name for (m, n, k): the cached choice of m's bucket, else ``deepgemm_default``.

    Without ``entries`` and ``names`` it reads this process's choices, validated once against the registry (the
    linear apply calls it for every block GEMM it runs eagerly)."""
    key = shape_key(n, k, m_bucket(m))
    if entries is None and names is None:
        return _choices().get(key, DEFAULT)
    entries = _state_entries() if entries is None else entries
    names = list(registry()) if names is None else list(names)
    return valid_choice(entries.get(key), names) or DEFAULT


def choose(us: dict[str, float], rejected: dict[str, str], min_gain: float = MIN_GAIN) -> str:
    """Fastest non-rejected candidate; a non-default one must beat the default by ``min_gain`` (fraction)."""
    ok = {c: t for c, t in us.items() if c not in rejected and t is not None and math.isfinite(t)}
    if not ok:
        return DEFAULT
    best = min(ok, key=ok.get)
    base = ok.get(DEFAULT)
    if best != DEFAULT and base is not None and ok[best] > base * (1.0 - min_gain):
        return DEFAULT
    return best


def format_table(entries: dict[str, dict]) -> str:
    """Markdown table of a set of entries (one row per (N, K, M bucket)), for the one-time log."""
    rows = sorted(entries.items(), key=lambda kv: parse_shape_key(kv[0]))
    names: list[str] = []
    for _, e in rows:
        for c in list(e.get("us", {})) + list(e.get("rejected", {})):
            if c not in names:
                names.append(c)
    names.sort(key=lambda c: (c != DEFAULT, c))
    head = "| N | K | M bucket | choice | gain vs default | " + " | ".join(f"{c} us" for c in names) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, e in rows:
        n, k, b = parse_shape_key(key)
        us, rej = e.get("us", {}), e.get("rejected", {})
        base, pick = us.get(DEFAULT), us.get(e.get("choice"))
        gain = f"x{base / pick:.2f}" if base and pick else "-"
        cells = ["REJ" if c in rej else (f"{us[c]:.1f}" if us.get(c) is not None else "-") for c in names]
        lines.append(f"| {n} | {k} | {b} | {e.get('choice', DEFAULT)} | {gain} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# float64 reference of the block-scaled product


def block_scaled_reference(xq, xs, wq, ws, block: tuple[int, int] = BLOCK, cols=None):
    """float64 ``(xq * xs) @ (wq * ws)^T``: xq [M, K] fp8 with 1 x block[1] scales xs [M, ceil(K/b1)], wq [N, K] fp8
    with block scales ws [ceil(N/b0), ceil(K/b1)]. ``cols`` (LongTensor) restricts to those output columns."""
    import torch

    k = xq.shape[1]
    x = xq.to(torch.float64) * xs.to(torch.float64).repeat_interleave(block[1], dim=1)[:, :k]
    rows = torch.arange(wq.shape[0], device=wq.device) if cols is None else cols
    # only the needed rows are expanded: a full float64 gate_up weight would be 805 MB
    w_scale = ws.to(torch.float64)[rows // block[0]].repeat_interleave(block[1], dim=1)[:, :k]
    return x @ (wq[rows].to(torch.float64) * w_scale).t()


def rel_error(out, ref) -> float:
    """Relative Frobenius error in float64; inf when ``out`` has a NaN/Inf."""
    import torch

    o = out.to(torch.float64)
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float((o - ref).norm() / ref.norm().clamp_min(1e-300))


def check_columns(n: int, stride: int = 16, generator=None, device=None):
    """One random column per ``stride`` columns, plus the last one: every output tile (>= 16 wide) is checked."""
    import torch

    base = torch.arange(0, n, stride, device=device)
    off = torch.randint(0, stride, base.shape, generator=generator, device=device)
    cols = torch.minimum(base + off, torch.full_like(base, n - 1))
    return torch.unique(torch.cat([cols, torch.tensor([n - 1], device=device)]))


# ---------------------------------------------------------------------------------------------------------------------
# candidates: callables (x, weight, weight_scale_inv, bias) -> out


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    fn: Callable  # (x [.., K] bf16, weight [N, K] fp8, weight_scale_inv [N/128, K/128] fp32, bias | None) -> [.., N]
    needs_deepgemm: bool = False
    num_sms: int | None = None
    max_m: int | None = None  # largest M it is measured / used for


def _sglang_block_call(fn, x, weight, scale, bias):
    return fn(input=x, weight=weight, block_size=list(BLOCK), weight_scale=scale, input_scale=None, bias=bias)


def _default_fn(x, weight, scale, bias):
    if _STATE.get("default_linear") is None:  # resolved once, as the linear method does
        from sglang.srt.layers.quantization.fp8_utils import dispatch_w8a8_block_fp8_linear

        _STATE["default_linear"] = dispatch_w8a8_block_fp8_linear()
    return _sglang_block_call(_STATE["default_linear"], x, weight, scale, bias)


def _sms_fn(num_sms: int):
    def fn(x, weight, scale, bias):
        from sglang.srt.layers import deep_gemm_wrapper
        from sglang.srt.layers.quantization.fp8_utils import deepgemm_w8a8_block_fp8_linear_with_fallback

        with deep_gemm_wrapper.configure_deep_gemm_num_sms(num_sms):  # set, call, restore (host-side only)
            return _sglang_block_call(deepgemm_w8a8_block_fp8_linear_with_fallback, x, weight, scale, bias)

    fn.__name__ = f"{SMS_PREFIX}{num_sms}"
    return fn


def _triton_fn(x, weight, scale, bias):
    from sglang.srt.layers.quantization.fp8_utils import triton_w8a8_block_fp8_linear

    return _sglang_block_call(triton_w8a8_block_fp8_linear, x, weight, scale, bias)


def _ours_fn(block_n: int, split_k: int):
    def fn(x, weight, scale, bias):
        from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8

        from sglang_fp8rl.kernels.block_gemm import block_fp8_gemm

        x2d = x.reshape(-1, x.shape[-1])
        xq, xs = sglang_per_token_group_quant_fp8(x2d.contiguous(), BLOCK[1])  # row-major [M, K/128] scales
        out = block_fp8_gemm(xq, xs, weight, scale, x.dtype, bias, block_n=block_n, split_k=split_k)
        return out.view(*x.shape[:-1], weight.shape[0])

    fn.__name__ = f"{OURS_PREFIX}n{block_n}_sk{split_k}"
    return fn


def make_candidates(sms: Sequence[int] = DEFAULT_SMS, triton: bool = False,
                    ours: Sequence[tuple[int, int]] = OURS_CONFIGS) -> dict[str, Candidate]:
    """The registry: default first (the autotune relies on that order), num_sms variants, Triton (off by default:
    SGLang's untuned Triton block GEMM never won a bucket on H100), ours."""
    reg = {DEFAULT: Candidate(DEFAULT, _default_fn)}
    for n in sms:
        reg[f"{SMS_PREFIX}{n}"] = Candidate(f"{SMS_PREFIX}{n}", _sms_fn(int(n)), needs_deepgemm=True, num_sms=int(n))
    if triton:
        reg[TRITON] = Candidate(TRITON, _triton_fn)
    for block_n, split_k in ours:
        name = f"{OURS_PREFIX}n{block_n}_sk{split_k}"
        reg[name] = Candidate(name, _ours_fn(block_n, split_k), max_m=OURS_MAX_M)
    return reg


def candidate_names() -> list[str]:
    return list(make_candidates())


def deepgemm_takes_shape(n: int, k: int) -> bool:
    """Whether SGLang runs DeepGEMM for an [N, K] block weight (else it silently runs its Triton block GEMM)."""
    return n % 64 == 0 and k % 128 == 0


def unsupported_reason(c: Candidate, n: int, k: int, device_sms: int, deepgemm_ok: bool, ue8m0: bool,
                       m: int | None = None) -> str | None:
    """Why ``c`` cannot run (m, n, k) as itself, or None. DeepGEMM variants need SGLang's DeepGEMM path to be taken
    (N % 64 == 0, K % 128 == 0; otherwise SGLang silently runs Triton) and fp32 scales."""
    if c.max_m is not None and m is not None and m > c.max_m:
        return f"M {m} above this candidate's {c.max_m}"
    if c.name.startswith(OURS_PREFIX) and k % BLOCK[1]:
        return f"K {k} not a multiple of {BLOCK[1]}"
    if not c.needs_deepgemm:
        return None
    if not deepgemm_ok:
        return "DeepGEMM disabled or missing"
    if ue8m0:
        return "DeepGEMM wants UE8M0 scales on this GPU"
    if not deepgemm_takes_shape(n, k):
        return "shape not supported by DeepGEMM (SGLang falls back to Triton)"
    if c.num_sms is not None and not 0 < c.num_sms < device_sms:
        return f"num_sms {c.num_sms} not below the device's {device_sms}"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# timing (CUDA graph replay, weights rotated out of L2, as gemm_micro.py)


def time_graph(call: Callable[[int], Any], nrot: int, calls: int = 48, reps: int = 7) -> float:
    """Median us per call of a CUDA graph of ``calls`` calls ``call(j)`` (j rotating over ``nrot`` operand sets)."""
    import torch

    calls = nrot * max(1, math.ceil(calls / nrot))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for j in range(nrot):
            call(j)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(calls):
            call(j)
    g.replay()
    g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del g
    times.sort()
    return times[len(times) // 2] * 1e3 / calls


def random_block_weight(n: int, k: int, device, generator=None, std: float = 0.02):
    """A random bf16 weight quantized blockwise by sglang_fp8rl.quant: (wq [N, K] fp8, ws [N/128, K/128] fp32)."""
    import torch

    from sglang_fp8rl.kernels.dispatch import quantize_blockwise_into  # Triton on CUDA (light), quant.py elsewhere
    from sglang_fp8rl.quant import FP8_DTYPE, blockwise_scale_shape

    w = (torch.randn(n, k, device=device, generator=generator) * std).to(torch.bfloat16)
    q = torch.empty(n, k, dtype=FP8_DTYPE, device=device)
    s = torch.empty(blockwise_scale_shape((n, k), BLOCK), dtype=torch.float32, device=device)
    quantize_blockwise_into(w, q, s, BLOCK)
    return q, s


def _deepgemm_flags() -> tuple[bool, bool]:
    """(DeepGEMM enabled, DeepGEMM wants UE8M0 scales) as SGLang decided them; (False, False) without DeepGEMM."""
    try:
        from sglang.srt.layers import deep_gemm_wrapper
    except ImportError:
        return False, False
    return bool(getattr(deep_gemm_wrapper, "ENABLE_JIT_DEEPGEMM", False)), bool(
        getattr(deep_gemm_wrapper, "DEEPGEMM_SCALE_UE8M0", False))


def candidate_errors() -> tuple[type[BaseException], ...]:
    """What a failing candidate raises (JIT/compile failures, bad launches, shape asserts): it is then rejected."""
    errors: list[type[BaseException]] = [RuntimeError, ValueError, AssertionError, TypeError, NotImplementedError]
    try:
        from triton.compiler.errors import CompilationError

        errors.append(CompilationError)
    except ImportError:
        pass
    try:
        from triton.runtime.errors import OutOfResources

        errors.append(OutOfResources)
    except ImportError:
        pass
    return tuple(errors)


def measure_copy_gbs(device, nbytes: int = 256 << 20) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second, GB/s): the bound a GEMM is compared with."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * src.element_size() / (start.elapsed_time(end) * 1e-3) / 1e9


def linear_bytes(m: int, n: int, k: int) -> int:
    """Bytes a block-FP8 linear must move at least: FP8 weight + fp32 block scales + BF16 input and output."""
    return n * k + math.ceil(n / BLOCK[0]) * math.ceil(k / BLOCK[1]) * 4 + 2 * m * k + 2 * m * n


def autotune(
    shapes: Sequence[tuple[int, int]],
    max_m: int = DEFAULT_MAX_M,
    candidates: dict[str, Candidate] | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    rot_bytes: float = 200e6,
    calls: int = 24,
    reps: int = 5,
    points: str = "upper",
    rel_tol: float = REL_TOL,
    min_gain: float = MIN_GAIN,
    alt_below: float = ALT_BELOW,
    variant_below: float = VARIANT_BELOW,
    skip: dict[str, dict] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = logger.info,
    device=None,
    timer: Callable | None = None,
    copy_gbs: float | None = None,
    before_alternatives: Callable[[list[tuple[int, int, int, list[str]]]], None] | None = None,
) -> dict[str, dict]:
    """Measure the candidates for each (N, K) in ``shapes`` and each bucket <= ``max_m``; return new entries.

    Two phases, both by measurement. Phase 1 times ``deepgemm_default`` at every bucket of every shape (largest
    weight first; its kernels are the ones CUDA-graph capture needs anyway) and its efficiency: ``linear_bytes`` /
    time / copy bandwidth (``copy_gbs``, measured here if not given). Phase 2 measures, least efficient entry first,
    the other candidates where that efficiency is low: a DeepGEMM ``num_sms`` variant below ``variant_below`` (each
    new variant configuration costs a JIT compile of seconds), any other candidate below ``alt_below``; an entry
    efficient enough is complete without them. ``before_alternatives`` gets [(N, K, bucket, names)] of phase 2 once
    before it starts (the caller compiles those kernels in parallel). Entries the budget cut are not returned.

    Each measurement: fresh x ~ N(0, 1) per (N, K, bucket point) and its float64 block-scaled reference on one column
    per 16; per candidate a first eager call (JIT; wall time kept as ``first_call_s``), the check (rel. Frobenius
    error <= ``rel_tol``, finite; a failure or an exception from ``candidate_errors()`` rejects the candidate for that
    entry), then a CUDA-graph timing. ``skip``: entries already valid. No new measurement starts after ``budget_s``.
    ``device``/``timer``/``copy_gbs`` exist for the CPU test of this loop (timer(call, nrot, calls, reps) -> us).
    """
    import torch

    cands = candidates if candidates is not None else make_candidates()
    names = list(cands)
    if names[0] != DEFAULT:
        raise ValueError(f"autotune: {DEFAULT} must be the first candidate, got {names[0]}")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    on_cuda = dev.type == "cuda"
    ctx = {
        "dev": dev, "timer": timer or time_graph, "calls": calls, "reps": reps, "rel_tol": rel_tol,
        "sms": torch.cuda.get_device_properties(dev).multi_processor_count if on_cuda else 0,
        "flags": _deepgemm_flags() if on_cuda else (False, False), "errors": candidate_errors(),
        "sync": torch.cuda.synchronize if on_cuda else (lambda: None),
        "gen": torch.Generator(device=dev).manual_seed(seed),
    }
    if copy_gbs is None:
        copy_gbs = measure_copy_gbs(dev) if on_cuda else float("inf")
    t0 = time.time()

    def spent() -> bool:
        return time.time() - t0 > budget_s

    out: dict[str, dict] = {}
    ops: dict[tuple[int, int], dict] = {}
    pending: list[tuple[float, tuple[int, int], str, dict, list[str]]] = []  # phase 2: (eff, shape, key, entry, names)
    waiting = 0
    for n, k in sorted(set(shapes), key=lambda s: -s[0] * s[1]):  # largest weights (most time) first
        todo = [b for b in buckets_upto(max_m) if shape_key(n, k, b) not in (skip or {})]
        for b in todo:
            if spent():
                waiting += 1
                continue
            if (n, k) not in ops:
                ops[(n, k)] = _operands(n, k, rot_bytes, ctx)
            entry = {"choice": DEFAULT, "candidates": names, "us": {}, "rejected": {}, "skipped": {},
                     "first_call_s": {}, "rel_err": {}, "points": list(bucket_points(b, points)),
                     "time": round(time.time()), "copy_GBs": round(copy_gbs, 1)}
            entry["inputs"] = [_inputs(m, k, ops[(n, k)], ctx) for m in entry["points"]]
            _run_candidate(cands[DEFAULT], n, k, entry, ops[(n, k)], ctx)
            entry.pop("inputs")
            us = entry["us"].get(DEFAULT)
            eff = sum(linear_bytes(m, n, k) for m in entry["points"]) / (us * 1e-6) / 1e9 / copy_gbs if us else 0.0
            entry["default_frac_copy_bw"] = round(eff, 3)
            tried = _alternatives(cands, eff, alt_below, variant_below, entry)
            if tried:
                pending.append((eff, (n, k), shape_key(n, k, b), entry, tried))
            else:
                out[shape_key(n, k, b)] = _finish(entry, min_gain)
    pending.sort(key=lambda p: p[0])  # least efficient default first
    if before_alternatives is not None and pending and not spent():
        before_alternatives([(*shape, parse_shape_key(key)[2], tried) for _, shape, key, _, tried in pending])
    for _, (n, k), key, entry, tried in pending:
        if spent():
            waiting += 1
            continue
        entry["inputs"] = [_inputs(m, k, ops[(n, k)], ctx) for m in entry["points"]]
        for name in tried:
            _run_candidate(cands[name], n, k, entry, ops[(n, k)], ctx)
        out[key] = _finish(entry, min_gain)
    del ops, pending
    if on_cuda:
        torch.cuda.empty_cache()
    if waiting:
        log(f"gemm_select: budget {budget_s:.0f}s spent; {waiting} entries wait for a later start")
    log(f"gemm_select: measured {len(out)} (N, K, M bucket) entries in {time.time() - t0:.1f}s")
    return out


def _alternatives(cands: dict[str, Candidate], eff: float, alt_below: float, variant_below: float,
                  entry: dict) -> list[str]:
    """The non-default candidates phase 2 measures for an entry whose default reached ``eff`` of copy bandwidth;
    the others are recorded in ``entry["skipped"]`` with the reason."""
    tried = []
    for c in list(cands.values())[1:]:
        below = variant_below if c.num_sms is not None else alt_below
        if eff < below:
            tried.append(c.name)
        else:
            entry["skipped"][c.name] = f"default at {eff:.0%} of copy bandwidth (>= {below:.0%})"
    return tried


def _operands(n: int, k: int, rot_bytes: float, ctx: dict) -> dict:
    """nrot copies of one random block-FP8 weight (>= rot_bytes in all: read from HBM, not L2) and check columns."""
    nrot = int(min(16, max(2, math.ceil(rot_bytes / (n * k)))))
    ws = [random_block_weight(n, k, ctx["dev"], ctx["gen"])]
    ws += [(ws[0][0].clone(), ws[0][1].clone()) for _ in range(nrot - 1)]
    return {"ws": ws, "nrot": nrot, "cols": check_columns(n, generator=ctx["gen"], device=ctx["dev"])}


def _inputs(m: int, k: int, ops: dict, ctx: dict) -> dict:
    """Activations for one M and the float64 reference of the first one (shared by every candidate)."""
    import torch

    from sglang_fp8rl.quant import quantize_activation_groups

    xs = [torch.randn(m, k, device=ctx["dev"], generator=ctx["gen"], dtype=torch.bfloat16) for _ in range(ops["nrot"])]
    xq, xsc = quantize_activation_groups(xs[0], BLOCK[1])
    ref = block_scaled_reference(xq, xsc, ops["ws"][0][0], ops["ws"][0][1], BLOCK, ops["cols"])
    return {"m": m, "xs": xs, "ref": ref}


def _run_candidate(c: Candidate, n: int, k: int, entry: dict, ops: dict, ctx: dict) -> None:
    """Measure one candidate at every point of the entry (summed), or record why it is rejected."""
    for inp in entry["inputs"]:
        why = unsupported_reason(c, n, k, ctx["sms"], *ctx["flags"], inp["m"])
        if why:
            entry["rejected"][c.name] = why
            entry["us"].pop(c.name, None)
            return
        try:
            us = _measure(c, inp["xs"], ops["ws"], ops["cols"], inp["ref"], ops["nrot"], ctx["calls"], ctx["reps"],
                          ctx["rel_tol"], ctx["timer"], ctx["sync"], entry, inp["m"])
        except ctx["errors"] as e:
            entry["rejected"][c.name] = f"{type(e).__name__}: {e}"[:300]
            entry["us"].pop(c.name, None)
            ctx["sync"]()
            return
        entry["us"][c.name] = entry["us"].get(c.name, 0.0) + us


def _finish(entry: dict, min_gain: float) -> dict:
    entry.pop("inputs", None)
    entry["choice"] = choose(entry["us"], entry["rejected"], min_gain)
    return entry


def _measure(c: Candidate, xs, ws, cols, ref, nrot, calls, reps, rel_tol, timer, sync, entry, m) -> float:
    """First call (timed wall, JIT), float64 check, then the graph timing of one candidate at one M."""
    t1 = time.time()
    o = c.fn(xs[0], ws[0][0], ws[0][1], None)
    sync()
    entry["first_call_s"][c.name] = round(max(entry["first_call_s"].get(c.name, 0), time.time() - t1), 3)
    err = rel_error(o[:, cols], ref)
    entry["rel_err"][c.name] = max(err, entry["rel_err"].get(c.name, 0.0))
    if not err <= rel_tol:
        raise ValueError(f"rel. error {err:.3g} > {rel_tol} at M={m}")

    def call(j):
        c.fn(xs[j % nrot], ws[j % nrot][0], ws[j % nrot][1], None)

    return timer(call, nrot, calls, reps)


# ---------------------------------------------------------------------------------------------------------------------
# process state: tuned once at load (prepare_model), looked up by the linear apply


def _state_entries() -> dict[str, dict]:
    if _STATE["entries"] is None:
        info = env_info()
        _STATE["info"] = info
        _STATE["entries"] = dict(env_entries(load_cache(), info))
    return _STATE["entries"]


def _choices() -> dict[str, str]:
    """Shape key -> chosen candidate, for the cached entries valid against this process's registry."""
    if _STATE["choices"] is None:
        names = list(registry())
        choices = {key: valid_choice(e, names) for key, e in _state_entries().items()}
        _STATE["choices"] = {key: c for key, c in choices.items() if c is not None}
    return _STATE["choices"]


def reset_state() -> None:
    """Forget the in-memory cache and registry (tests, or after writing the cache file)."""
    _STATE.update({"entries": None, "info": None, "registry": None, "choices": None, "default_linear": None})


def registry() -> dict[str, Candidate]:
    """This process's candidates."""
    if _STATE["registry"] is None:
        _STATE["registry"] = make_candidates()
    return _STATE["registry"]


def model_block_shapes(model, device_type: str = "cuda") -> list[tuple[int, int]]:
    """(N, K) of every blockwise FP8 linear of ``model`` on this rank (128x128 blocks, weights on ``device_type``)."""
    shapes = set()
    for module in model.modules():
        state = getattr(module, "_fp8rl", None)
        weight = getattr(module, "weight", None)
        if state is None or not getattr(state, "is_block", False) or weight is None or weight.dim() != 2:
            continue
        if tuple(state.block_size) == BLOCK and weight.device.type == device_type:
            shapes.add((int(weight.shape[0]), int(weight.shape[1])))
    return sorted(shapes)


def prepare_model(model, budget_s: float | None = None, max_m: int = DEFAULT_MAX_M, capture_ms: Sequence[int] = (),
                  ranks_on_node: int = 1) -> dict[str, dict]:
    """Compile what CUDA-graph capture (``capture_ms``: its token counts) will launch, look up (and in mode ``auto``
    measure what is missing for) the model's block shapes; log the table once.

    Runs after loading, before CUDA-graph capture. DeepGEMM kernels are compiled by a :class:`jit_warmup.WarmupPool`
    in two rounds: the default at every captured M and measured bucket, then (in auto mode) the num_sms variants
    phase 2 of :func:`autotune` will measure. Returns this model's entries ({} when off or nothing to do)."""
    from sglang_fp8rl.server_args import get_options

    options = get_options()
    shapes = model_block_shapes(model)
    if not shapes:
        return {}
    budget = options.gemm_tune_budget_s if budget_s is None else budget_s
    entries = _state_entries()
    names = list(registry())
    wanted = {shape_key(n, k, b) for n, k in shapes for b in buckets_upto(max_m)}
    valid = {key: e for key, e in entries.items() if key in wanted and valid_choice(e, names)}
    selecting = options.gemm_select != "off"
    tune = options.gemm_select == "auto" and len(valid) < len(wanted) and budget > 0
    choices = {key: e["choice"] for key, e in valid.items()} if selecting else {}
    with _warmup_pool(options.jit_workers, ranks_on_node) as pool:
        light = _start_light_warmup(ours=selecting)
        _jit_round(pool, warmup_streams(shapes, capture_ms, choices, wanted - set(valid) if tune else set(), max_m),
                   f"{len(capture_ms)} CUDA-graph token counts")
        light.join()
        if not selecting:
            return {}
        if tune:
            new = _tune(shapes, max_m, budget, valid, pool, capture_ms)
            entries.update(new)
            _STATE["choices"] = None  # derived from the entries: rebuilt at the next lookup
            valid.update(new)
    missing = len(wanted) - len(valid)
    logger.info("[fp8rl] gemm_select (%s, cache %s): %d shapes x %d M buckets, %d on %s for lack of a measurement\n%s",
                options.gemm_select, cache_path(), len(shapes), len(buckets_upto(max_m)), missing, DEFAULT,
                format_table(valid))
    return valid


def _tune(shapes, max_m: int, budget: float, valid: dict[str, dict], pool, capture_ms) -> dict[str, dict]:
    """The load-time autotune (variants compiled on ``pool`` before phase 2), cached on disk, logged in one line."""
    t0 = time.time()

    def compile_alternatives(todo: list[tuple[int, int, int, list[str]]]) -> None:
        _jit_round(pool, variant_streams(todo, capture_ms, registry()), "the num_sms variants to measure")

    # autotune's own progress lines go to debug: the one summary and table of prepare_model are the decision log
    new = autotune(shapes, max_m=max_m, candidates=registry(), budget_s=budget, skip=valid, log=logger.debug,
                   before_alternatives=compile_alternatives)
    try:
        merge_entries(None, _STATE["info"], new)
    except OSError as e:
        logger.warning("[fp8rl] gemm_select: could not write the cache %s (%s); choices kept for this process",
                       cache_path(), e)
    logger.info("[fp8rl] gemm_select: measured %d entries for %d shapes in %.1f s (budget %.0f s)",
                len(new), len(shapes), time.time() - t0, budget)
    return new


def warmup_streams(shapes: Sequence[tuple[int, int]], capture_ms: Sequence[int], choices: dict[str, str],
                   to_measure: set[str], max_m: int = DEFAULT_MAX_M,
                   cands: dict[str, Candidate] | None = None) -> dict[tuple[int, int, int | None], set[int]]:
    """(N, K, num_sms or None) -> the M values DeepGEMM launches before serving, as far as known before measuring:
    the default at every captured M and at the measured points of the entries ``to_measure``; a chosen num_sms
    variant at the captured M of its bucket. Shapes DeepGEMM does not take (SGLang runs Triton) are left out."""
    cands = registry() if cands is None else cands
    sms_of = {c.name: c.num_sms for c in cands.values() if c.num_sms is not None}
    streams: dict[tuple[int, int, int | None], set[int]] = {}
    for n, k in shapes:
        if not deepgemm_takes_shape(n, k):
            continue
        default_ms = set(capture_ms)
        for b in buckets_upto(max_m):
            key = shape_key(n, k, b)
            if key in to_measure:
                default_ms.update(bucket_points(b))
            elif choices.get(key) in sms_of:
                streams.setdefault((n, k, sms_of[choices[key]]), set()).update(_captured_in(b, capture_ms))
        streams[(n, k, None)] = default_ms
    return {key: ms for key, ms in streams.items() if ms}


def variant_streams(todo: Sequence[tuple[int, int, int, Sequence[str]]], capture_ms: Sequence[int],
                    cands: dict[str, Candidate]) -> dict[tuple[int, int, int | None], set[int]]:
    """(N, K, num_sms) -> M values for the num_sms variants phase 2 measures: each entry's measured points and the
    captured M of its bucket (what capture launches if the variant wins)."""
    streams: dict[tuple[int, int, int | None], set[int]] = {}
    for n, k, bucket, names in todo:
        if not deepgemm_takes_shape(n, k):
            continue
        ms = set(bucket_points(bucket)) | _captured_in(bucket, capture_ms)
        for name in names:
            if cands[name].num_sms is not None:
                streams.setdefault((n, k, cands[name].num_sms), set()).update(ms)
    return streams


def _captured_in(bucket: int, capture_ms: Sequence[int]) -> set[int]:
    """The captured token counts that fall in ``bucket``: what capture launches with that bucket's choice."""
    return {m for m in capture_ms if m_bucket(m) == bucket}


def _deepgemm_takes_default() -> bool:
    """Whether SGLang's block-FP8 dispatch on this GPU is DeepGEMM with float32 scales (what the warm-up launches)."""
    enabled, ue8m0 = _deepgemm_flags()
    if not enabled or ue8m0:
        return False
    from sglang.srt.layers.quantization.fp8_utils import (
        deepgemm_w8a8_block_fp8_linear_with_fallback,
        dispatch_w8a8_block_fp8_linear,
    )

    return dispatch_w8a8_block_fp8_linear() is deepgemm_w8a8_block_fp8_linear_with_fallback


@contextlib.contextmanager
def _warmup_pool(workers_option: int, ranks_on_node: int):
    """A :class:`jit_warmup.WarmupPool` on this rank's GPU (None when the warm-up is off or DeepGEMM is not used)."""
    from sglang_fp8rl.kernels import jit_warmup
    from sglang_fp8rl.server_args import AUTO_JIT_WORKERS

    if workers_option == 0 or not _deepgemm_takes_default():
        yield None
        return
    import torch

    workers = jit_warmup.default_workers(ranks_on_node) if workers_option == AUTO_JIT_WORKERS else workers_option
    free, _ = torch.cuda.mem_get_info()
    workers = max(1, min(workers, free // jit_warmup.WORKER_GPU_BYTES))
    with jit_warmup.WarmupPool(workers, torch.cuda.current_device(), env=jit_warmup.worker_env()) as pool:
        yield pool


def _jit_round(pool, streams: dict[tuple[int, int, int | None], set[int]], what: str) -> None:
    """One warm-up round on ``pool`` (nothing without a pool); one log line when it launched anything."""
    from sglang_fp8rl.kernels import jit_warmup

    if pool is None:
        return
    result = jit_warmup.warm_up(pool, streams, env_key(_STATE["info"] or env_info()))
    if result.jobs:
        (logger.warning if result.failed else logger.info)(WARMUP_LOG, what, result.summary())


def _start_light_warmup(ours: bool) -> threading.Thread:
    """Compile, in a thread while the DeepGEMM round runs, the small JIT kernels of the block path: SGLang's 1x128
    activation quantizers (tvm-ffi JIT in SGLang 0.5.17, ~8 s each on a cold cache) and, if ``ours``, our Triton
    GEMM at M=1 and M=16. Their shapes are tiny: these kernels take N and K at run time."""
    def run() -> None:
        import torch

        if not torch.cuda.is_available():
            return
        x = torch.randn(16, 4 * BLOCK[1], device="cuda", dtype=torch.bfloat16)
        w, scale = random_block_weight(2 * BLOCK[0], 4 * BLOCK[1], x.device)
        try:
            from sglang.kernels.ops.quantization.fp8_kernel import sglang_per_token_group_quant_fp8

            sglang_per_token_group_quant_fp8(x, BLOCK[1], column_major_scales=True, scale_tma_aligned=True,
                                             scale_ue8m0=False)
            if ours:
                for m in (1, 16):
                    for c in registry().values():
                        if c.name.startswith(OURS_PREFIX):
                            c.fn(x[:m], w, scale, None)
            torch.cuda.synchronize()
        except candidate_errors() as e:  # the first real call compiles it instead
            logger.debug("[fp8rl] light JIT warm-up: %s", e)

    thread = threading.Thread(target=run, name="fp8rl-light-jit", daemon=True)
    thread.start()
    return thread


def apply_selected(x, weight, weight_scale_inv, bias, default_fn: Callable, block_size=BLOCK):
    """The linear apply with selection: ``default_fn`` is SGLang's dispatched block linear (keyword signature).
    Blocks other than 128x128 always take ``default_fn`` (the candidates and the cache assume 128x128)."""
    if tuple(block_size) != BLOCK:
        return default_fn(input=x, weight=weight, block_size=list(block_size), weight_scale=weight_scale_inv,
                          input_scale=None, bias=bias)
    k = x.shape[-1]
    name = select(x.numel() // k if x.numel() else 1, weight.shape[0], k)
    if name == DEFAULT:
        return _sglang_block_call(default_fn, x, weight, weight_scale_inv, bias)
    return registry()[name].fn(x, weight, weight_scale_inv, bias)
