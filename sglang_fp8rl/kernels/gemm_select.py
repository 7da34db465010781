"""Per-shape block-FP8 GEMM selection (issue 8): measure, cache on disk, look up at apply time. OPT-IN, UNVERIFIED.

Status: written without GPU time. Nothing here has run on a GPU yet; the CPU tests cover bucketing, the cache,
the lookup, the float64 reference and the autotune loop with fake candidates and a fake timer. The real candidates,
``time_graph`` and everything said below about DeepGEMM and CUDA graphs are unverified. The whole module is inert
unless ``FP8RL_GEMM_SELECT=1`` (the linear method then consults it; ``FP8RL_GEMM_SELECT_AUTOTUNE=1`` additionally
lets it tune missing shapes in-process).

What it does. For a block-FP8 linear (weight [N, K] e4m3fn, ``weight_scale_inv`` [N/128, K/128] float32, 1x128
activation groups quantized inside the candidate) and an M bucket it picks one named candidate:

* ``deepgemm_default``: SGLang's ``dispatch_w8a8_block_fp8_linear()`` (DeepGEMM ``sm90_fp8_gemm_1d2d`` on H100),
  i.e. exactly the unchanged path; also the fallback whenever nothing valid is cached;
* ``deepgemm_sms_{n}``: the same SGLang call inside SGLang's own ``deep_gemm_wrapper.configure_deep_gemm_num_sms(n)``
  (``deep_gemm.set_num_sms(n)`` before, the previous value restored after). Measured on H100
  (``shared/research/gpu_gemm_micro.md``): gate_up N=24576 K=4096 at M=128 runs 101 us with DeepGEMM's own choice
  (a register-spilling 128x192, no-multicast tile) and 42 us with ``set_num_sms(<=124)`` (128x112 / 128x128);
* ``triton_default``: SGLang's ``triton_w8a8_block_fp8_linear`` (default config unless SGLang ships a tuned one).

Why ``set_num_sms`` is safe inside CUDA-graph capture (reasoning, not yet tested): in DeepGEMM ``num_sms`` is a
host-side int of its device runtime (``set_num_sms`` asserts ``0 <= n <= multiProcessorCount`` and stores it); it is
read on the host when ``fp8_gemm_nt`` picks its config, JIT-compiles/loads the cubin (``num_sms`` is a template
argument) and sets the persistent grid. Capture records that launch; replay never re-reads host state. SGLang itself
wraps captured DeepGEMM calls in the same context manager (masked grouped GEMM with overlap args). Two conditions:
the set/restore must bracket each call (the context manager does, also on exceptions), and the cubin for the
(config, num_sms) must already be compiled before capture: the autotune runs every candidate eagerly at the bucket
M, and SGLang's eager warm-up runs before each capture compile any other M lazily, as on the default path.
Ordering trap: with ``SGLANG_JIT_DEEPGEMM_PRECOMPILE=1`` SGLang's first DeepGEMM call for an (N, K) precompiles all
Ms under the *current* ``num_sms``; the autotune therefore always runs ``deepgemm_default`` first for each shape.

Buckets (``m_bucket``): the smallest of 1, 2, 4, 8, 16, 32, 48, ..., 256 (multiples of 16), 320, 384, 448, 512, then
powers of two, that is >= m. SGLang's decode CUDA graphs use bs 1, 2, 4, 8, 12, 16, 24, ..., 256 (step 8), so every
captured bs maps to one bucket and the 128 / 129 DeepGEMM cliff is a bucket edge. A bucket is measured at its upper
edge M only (``points="upper"``) unless ``points="both"`` also measures lower edge + 1 and sums the two.

Startup budget (estimate, unverified). Default autotune: the model's own (N, K) set, buckets up to
``FP8RL_GEMM_SELECT_MAX_M`` (256: 20 buckets), 5 candidates. One measurement = eager warm calls, a float64 check
(~1-3 ms), a graph capture of ~48 calls (host ~3-5 ms) and 9 replays of 48 x 10-100 us: ~10-50 ms. Qwen3-8B at TP 1
(4 shapes) = 400 measurements ~= 5-20 s: inside 30 s only with warm JIT caches. JIT is extra and dominates a cold
start: DeepGEMM 2-6 s per new cubin (one per distinct tile config x num_sms; the micro-benchmark saw 15 cubins for the
default path on 4 shapes x 6 Ms, so the 3 num_sms variants over 20 buckets could add tens of cubins = minutes), Triton
~9 s per kernel config. Both persist on disk (``SGLANG_DG_CACHE_DIR``, the Triton cache), and so do this module's
entries. Hence: (1) tune offline once per machine/version with ``scripts/bench_gemm.py --tune`` (that also fills the
JIT caches), so a server start only reads the JSON; (2) the in-server lazy autotune (``FP8RL_GEMM_SELECT_AUTOTUNE=1``)
has a hard wall budget ``FP8RL_GEMM_SELECT_BUDGET_S`` (25 s): no new (shape, bucket) starts after it (one bucket
with cold JITs may overshoot), unmeasured entries fall back to the default and are measured on a later start;
(3) once measured, prune ``FP8RL_GEMM_SELECT_SMS`` to the variants that ever win.

Selection rule: among candidates that passed the float64 check, the fastest; a non-default candidate must beat
``deepgemm_default`` by ``min_gain`` (3 %) or the default stays (noise guard).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

ENV_ENABLE = "FP8RL_GEMM_SELECT"  # "1": use the cached selection in the linear apply (default: off)
ENV_AUTOTUNE = "FP8RL_GEMM_SELECT_AUTOTUNE"  # "1": tune missing shapes lazily at their first eager call
ENV_CACHE = "FP8RL_GEMM_SELECT_CACHE"  # path of the JSON cache
ENV_MAX_M = "FP8RL_GEMM_SELECT_MAX_M"  # largest bucket tuned (default 256)
ENV_BUDGET = "FP8RL_GEMM_SELECT_BUDGET_S"  # wall budget of one autotune call (default 25)
ENV_SMS = "FP8RL_GEMM_SELECT_SMS"  # comma list of num_sms candidates (default 124,112,96)

SCHEMA = 1
DEFAULT = "deepgemm_default"
TRITON = "triton_default"
SMS_PREFIX = "deepgemm_sms_"
DEFAULT_SMS = (124, 112, 96)
DEFAULT_MAX_M = 256
DEFAULT_BUDGET_S = 25.0
REL_TOL = 1e-2  # rel. Frobenius error vs the float64 block-scaled product; measured 1.7e-3 for DeepGEMM/Triton
MIN_GAIN = 0.03
BLOCK = (128, 128)

# process state: the cached entries of this environment, shapes tuned here, the registry, SGLang's default linear
_STATE: dict[str, Any] = {"entries": None, "info": None, "tuned": set(), "logged": False, "registry": None,
                          "default_linear": None}

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
# environment, flags


def enabled() -> bool:
    """``FP8RL_GEMM_SELECT=1``: the linear apply consults the selection (read per call; default off)."""
    return os.environ.get(ENV_ENABLE, "0").strip() == "1"


def autotune_enabled() -> bool:
    return os.environ.get(ENV_AUTOTUNE, "0").strip() == "1"


def sms_from_env() -> tuple[int, ...]:
    raw = os.environ.get(ENV_SMS, "").strip()
    if not raw:
        return DEFAULT_SMS
    return tuple(int(v) for v in raw.split(",") if v.strip())


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
# cache: {"schema": 1, "envs": {env_key: {"info": {...}, "entries": {shape_key: entry}}}}
# entry: {"choice": name, "candidates": [names measured], "us": {name: us}, "rejected": {name: reason},
#         "first_call_s": {name: s}, "rel_err": {name: err}, "time": unix}


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


def save_cache(data: dict, path: str | None = None) -> str:
    """Atomic write (temp file + rename) of the whole cache."""
    path = path or cache_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".gemm_select.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path


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
    """Candidate name for (m, n, k): the cached choice of m's bucket, else ``deepgemm_default``."""
    entries = _state_entries() if entries is None else entries
    names = list(registry()) if names is None else list(names)
    return valid_choice(entries.get(shape_key(n, k, m_bucket(m))), names) or DEFAULT


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


def make_candidates(sms: Sequence[int] = DEFAULT_SMS, triton: bool = True) -> dict[str, Candidate]:
    """The registry: default first (the autotune relies on that order), then num_sms variants, then Triton."""
    reg = {DEFAULT: Candidate(DEFAULT, _default_fn)}
    for n in sms:
        reg[f"{SMS_PREFIX}{n}"] = Candidate(f"{SMS_PREFIX}{n}", _sms_fn(int(n)), needs_deepgemm=True, num_sms=int(n))
    if triton:
        reg[TRITON] = Candidate(TRITON, _triton_fn)
    return reg


def candidate_names(sms: Sequence[int] | None = None) -> list[str]:
    return list(make_candidates(sms_from_env() if sms is None else sms))


def unsupported_reason(c: Candidate, n: int, k: int, device_sms: int, deepgemm_ok: bool, ue8m0: bool) -> str | None:
    """Why ``c`` cannot run (n, k) as itself, or None. DeepGEMM variants need SGLang's DeepGEMM path to be taken
    (N % 64 == 0, K % 128 == 0; otherwise SGLang silently runs Triton) and fp32 scales."""
    if not c.needs_deepgemm:
        return None
    if not deepgemm_ok:
        return "DeepGEMM disabled or missing"
    if ue8m0:
        return "DeepGEMM wants UE8M0 scales on this GPU"
    if n % 64 or k % 128:
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
    try:
        from sglang.srt.layers import deep_gemm_wrapper

        return bool(deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM), bool(deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0)
    except Exception:  # noqa: BLE001 - any import problem means: no DeepGEMM variants
        return False, False


def autotune(
    shapes: Sequence[tuple[int, int]],
    max_m: int = DEFAULT_MAX_M,
    candidates: dict[str, Candidate] | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    rot_bytes: float = 200e6,
    calls: int = 48,
    reps: int = 7,
    points: str = "upper",
    rel_tol: float = REL_TOL,
    min_gain: float = MIN_GAIN,
    skip: dict[str, dict] | None = None,
    seed: int = 0,
    log: Callable[[str], None] = logger.info,
    device=None,
    timer: Callable | None = None,
) -> dict[str, dict]:
    """Measure every candidate for each (N, K) in ``shapes`` and each bucket <= ``max_m``; return new entries.

    Per (N, K): nrot weight copies (>= ``rot_bytes`` in all, so weights are read from HBM, not L2) and activation
    sets. Per (N, K, bucket, candidate): a first eager call on a fresh x ~ N(0, 1) (JIT; wall time kept as
    ``first_call_s``), a float64 check of that output (rel. Frobenius error on one column per 16 <= ``rel_tol``,
    finite; a failure or an exception rejects the candidate for that entry), then a CUDA-graph timing.
    ``skip``: entries already valid (not re-measured). Stops starting new (shape, bucket) after ``budget_s``.
    ``device``/``timer`` exist for the CPU test of this loop (timer(call, nrot, calls, reps) -> us per call).
    """
    import torch

    from sglang_fp8rl.quant import quantize_activation_groups

    cands = candidates if candidates is not None else make_candidates(sms_from_env())
    names = list(cands)
    assert names[0] == DEFAULT, "deepgemm_default must run first (SGLang's DeepGEMM precompile uses num_sms)"
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    on_cuda = dev.type == "cuda"
    timer = timer or time_graph
    device_sms = torch.cuda.get_device_properties(dev).multi_processor_count if on_cuda else 0
    deepgemm_ok, ue8m0 = _deepgemm_flags() if on_cuda else (False, False)

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    gen = torch.Generator(device=dev).manual_seed(seed)
    t0 = time.time()
    out: dict[str, dict] = {}
    for n, k in sorted(set(shapes), key=lambda s: -s[0] * s[1]):  # largest weights first
        todo = [b for b in buckets_upto(max_m) if shape_key(n, k, b) not in (skip or {})]
        if not todo:
            continue
        if time.time() - t0 > budget_s:
            log(f"gemm_select: budget {budget_s:.0f}s spent, N={n} K={k} left to a later start")
            continue
        nrot = int(min(16, max(2, math.ceil(rot_bytes / (n * k)))))
        ws = [random_block_weight(n, k, dev, gen)]
        ws += [(ws[0][0].clone(), ws[0][1].clone()) for _ in range(nrot - 1)]
        cols = check_columns(n, generator=gen, device=dev)
        for b in todo:
            if time.time() - t0 > budget_s:
                log(f"gemm_select: budget {budget_s:.0f}s spent at N={n} K={k} M={b}")
                break
            entry = {"choice": DEFAULT, "candidates": names, "us": {}, "rejected": {}, "first_call_s": {},
                     "rel_err": {}, "points": list(bucket_points(b, points)), "time": round(time.time())}
            for name, c in cands.items():
                why = unsupported_reason(c, n, k, device_sms, deepgemm_ok, ue8m0)
                if why:
                    entry["rejected"][name] = why
                    continue
                try:
                    total = 0.0
                    for m in entry["points"]:
                        xs = [torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(nrot)]
                        t1 = time.time()
                        o = c.fn(xs[0], ws[0][0], ws[0][1], None)
                        sync()
                        entry["first_call_s"][name] = round(max(entry["first_call_s"].get(name, 0), time.time() - t1), 3)
                        xq, xsc = quantize_activation_groups(xs[0], BLOCK[1])
                        err = rel_error(o[:, cols], block_scaled_reference(xq, xsc, ws[0][0], ws[0][1], BLOCK, cols))
                        entry["rel_err"][name] = max(err, entry["rel_err"].get(name, 0.0))
                        if not err <= rel_tol:
                            raise ValueError(f"rel. error {err:.3g} > {rel_tol} at M={m}")
                        del o

                        def call(j, xs=xs, c=c, ws=ws, nrot=nrot):
                            c.fn(xs[j % nrot], ws[j % nrot][0], ws[j % nrot][1], None)

                        total += timer(call, nrot, calls, reps)
                    entry["us"][name] = total
                except Exception as e:  # noqa: BLE001 - a failing candidate is rejected, never fatal
                    entry["rejected"][name] = f"{type(e).__name__}: {e}"[:300]
                    entry["us"].pop(name, None)
                    sync()
            entry["choice"] = choose(entry["us"], entry["rejected"], min_gain)
            out[shape_key(n, k, b)] = entry
        del ws
        if on_cuda:
            torch.cuda.empty_cache()
    log(f"gemm_select: autotuned {len(out)} entries in {time.time() - t0:.1f}s")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# process state and the apply hook used by the linear method (only when FP8RL_GEMM_SELECT=1)


def _state_entries() -> dict[str, dict]:
    if _STATE["entries"] is None:
        info = env_info()
        _STATE["info"] = info
        _STATE["entries"] = dict(env_entries(load_cache(), info))
    return _STATE["entries"]


def reset_state() -> None:
    """Forget the in-memory cache and registry (tests, or after writing the cache file)."""
    _STATE.update({"entries": None, "info": None, "tuned": set(), "logged": False, "registry": None,
                   "default_linear": None})


def registry() -> dict[str, Candidate]:
    """This process's candidates (``FP8RL_GEMM_SELECT_SMS`` read once)."""
    if _STATE["registry"] is None:
        _STATE["registry"] = make_candidates(sms_from_env())
    return _STATE["registry"]


def _maybe_autotune(n: int, k: int) -> None:
    """Tune (n, k) once per process when FP8RL_GEMM_SELECT_AUTOTUNE=1, never during CUDA-graph capture."""
    import torch

    if (n, k) in _STATE["tuned"] or not autotune_enabled() or torch.cuda.is_current_stream_capturing():
        return
    _STATE["tuned"].add((n, k))
    entries = _state_entries()
    names = list(registry())
    valid = {key: e for key, e in entries.items() if valid_choice(e, names)}
    try:
        new = autotune([(n, k)], max_m=int(os.environ.get(ENV_MAX_M, DEFAULT_MAX_M)), candidates=registry(),
                       budget_s=float(os.environ.get(ENV_BUDGET, DEFAULT_BUDGET_S)), skip=valid)
    except Exception as e:  # noqa: BLE001 - tuning must never break serving: keep the default
        logger.warning("gemm_select: autotune of N=%d K=%d failed (%r); keeping %s", n, k, e, DEFAULT)
        return
    if new:
        entries.update(new)
        try:
            merge_entries(None, _STATE["info"], new)
        except OSError as e:
            logger.warning("gemm_select: could not write %s (%r)", cache_path(), e)
        logger.info("gemm_select: N=%d K=%d\n%s", n, k, format_table(new))


def apply_selected(x, weight, weight_scale_inv, bias, default_fn: Callable, block_size=BLOCK):
    """The linear apply with selection: ``default_fn`` is SGLang's dispatched block linear (keyword signature).
    Blocks other than 128x128 always take ``default_fn`` (the candidates and the cache assume 128x128)."""
    if tuple(block_size) != BLOCK:
        return default_fn(input=x, weight=weight, block_size=list(block_size), weight_scale=weight_scale_inv,
                          input_scale=None, bias=bias)
    k = x.shape[-1]
    n = weight.shape[0]
    _maybe_autotune(n, k)
    if not _STATE["logged"]:
        _STATE["logged"] = True
        logger.info("gemm_select: enabled, cache %s\n%s", cache_path(), format_table(_state_entries()))
    name = select(x.numel() // k if x.numel() else 1, n, k, names=list(registry()))
    if name == DEFAULT:
        return _sglang_block_call(default_fn, x, weight, weight_scale_inv, bias)
    return registry()[name].fn(x, weight, weight_scale_inv, bias)
