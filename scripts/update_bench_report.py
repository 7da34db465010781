"""The CPU-side part of scripts/bench_update.py: the payload's statistics, the bytes an FP8 engine's apply step
moves and their rate against the copy bandwidth, the per-bucket telemetry summed over one push, the issue-16 target
lines and ratios, and the Markdown summary (table and target lines), with the constants they use. No GPU, no server
(tests/test_demo_cpu.py)."""

from __future__ import annotations

import math
from typing import Any, Optional

import update_scaleout
from update_bench_profile import format_profile

GB = 1e9
PATHS = update_scaleout.PATHS
FP8_ONLY_PATHS = ("atomic", "validate_only", "prequant")
# FP8 path -> (the BF16 path it is compared with, the largest allowed ratio)
RATIO_TARGETS = {"tensor": ("tensor", 1.10), "prequant": ("tensor", 0.80), "disk": ("disk", 1.30)}
APPLY_BW_TARGET = 0.5  # apply traffic per second, as a fraction of the device-to-device copy
ALLOC_BLOCK = 2 << 20  # the CUDA caching allocator rounds large blocks up to 2 MiB
BLOCK = 128


# ---------------------------------------------------------------------------------------------------------------------
# pure helpers (CPU-testable)


def linear_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The HF tensors that become FP8 linear layers (2-D, not embeddings / lm_head)."""
    return [n for n, s in shapes.items() if len(s) == 2 and "embed_tokens" not in n and "lm_head" not in n]


def apply_bytes(shapes: dict[str, tuple[int, ...]], block: int = BLOCK, prequant: bool = False) -> dict[str, int]:
    """Bytes the apply step moves on an FP8 engine. BF16 in: quantized linears read BF16 and write FP8 + fp32 block
    scales. Pre-quantized: the codes and scales are copied (read + write). Either way the other parameters
    (embeddings, lm_head, norms) are BF16 copies (read + write)."""
    lin = set(linear_names(shapes))
    quant_read = quant_write = copy_bytes = 0
    for name, s in shapes.items():
        numel = math.prod(s)
        if name in lin:
            scales = 4 * math.ceil(s[0] / block) * math.ceil(s[1] / block)
            quant_read += (numel + scales) if prequant else 2 * numel
            quant_write += numel + scales
        else:
            copy_bytes += 2 * 2 * numel
    return {"quant_read": quant_read, "quant_write": quant_write, "bf16_copy_rw": copy_bytes,
            "total": quant_read + quant_write + copy_bytes}


def payload_stats(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """Tensor count, BF16 bytes, and the largest tensor of the payload."""
    sizes = {n: 2 * math.prod(s) for n, s in shapes.items()}
    largest = max(sizes, key=sizes.get)
    return {"tensors": len(sizes), "bytes": sum(sizes.values()), "largest_name": largest,
            "largest_bytes": sizes[largest]}


def sum_bucket_stats(stats: list[dict]) -> dict[str, Any]:
    """Sum the per-bucket last_update records of one push."""
    out = {"buckets": len(stats), "ok": all(s.get("ok") for s in stats), "tensors": 0, "bytes": 0,
           "validate_s": 0.0, "apply_s": 0.0, "fp8_layers_written": {}, "bf16_params_written": 0,
           "replayed_tensors": 0}
    for s in stats:
        out["tensors"] += s.get("tensors", 0)
        out["bytes"] += s.get("bytes", 0)
        out["validate_s"] += s.get("validate_s", 0.0)
        out["apply_s"] += s.get("apply_s", 0.0)
        out["bf16_params_written"] += s.get("bf16_params_written", 0)
        out["replayed_tensors"] += s.get("replayed_tensors", 0)
        if s.get("peak_extra_bytes") is not None:  # server-side allocator peak (exact, per bucket)
            out["server_peak_extra_bytes"] = max(out.get("server_peak_extra_bytes", 0), s["peak_extra_bytes"])
        for k, v in (s.get("fp8_layers_written") or {}).items():
            out["fp8_layers_written"][k] = out["fp8_layers_written"].get(k, 0) + v
    return out


def apply_bandwidth(rec: dict, moved: dict[str, int], d2d_GBps: Optional[float]) -> None:
    """Add the apply step's traffic, its rate, and that rate against the copy bandwidth to a path's record."""
    apply_s = (rec.get("server_telemetry") or {}).get("apply_s")
    if not apply_s:
        return
    rec["apply_bytes"] = moved
    rec["apply_GBps"] = moved["total"] / GB / apply_s
    if d2d_GBps:
        rec["apply_vs_d2d"] = rec["apply_GBps"] / d2d_GBps


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _gb(x: Optional[float]) -> Optional[float]:
    return None if x is None else x / GB


def _mean(res: dict, eng: str, path: str) -> Optional[float]:
    return res.get("engines", {}).get(eng, {}).get(path, {}).get("mean_s")


def ratios(res: dict) -> dict[str, Optional[float]]:
    """FP8 path time over its BF16 baseline (RATIO_TARGETS), and the atomic step over by tensor (FP8 engine)."""
    out: dict[str, Optional[float]] = {}
    for path, (base, _) in RATIO_TARGETS.items():
        f, b = _mean(res, "fp8", path), _mean(res, "bf16", base)
        out[path] = f / b if f and b else None
    a, t = _mean(res, "fp8", "atomic"), _mean(res, "fp8", "tensor")
    out["atomic_vs_fp8_tensor"] = a / t if a and t else None
    return out


def peak_extra(rec: dict) -> tuple[Optional[int], str]:
    """The larger of the server's allocator peak and the device-wide polled peak of a path, and where it came from."""
    server = (rec.get("server_telemetry") or {}).get("server_peak_extra_bytes")
    polled = [x for x in (rec.get("peak_extra_first_bytes"), rec.get("peak_extra_timed_bytes")) if x is not None]
    found = {"server allocator": server, "device-wide polling": max(polled) if polled else None}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return None, ""
    source = max(found, key=found.get)
    return found[source], source


def targets(res: dict) -> list[str]:
    """The issue's targets as PASS/FAIL/UNKNOWN lines, plus the atomic step's cost."""
    out = []
    eng = res.get("engines", {})
    r = ratios(res)
    for path, (base, limit) in RATIO_TARGETS.items():
        what = f"FP8 {path} <= {limit:.2f}x BF16 {base}"
        if r[path] is None:
            out.append(f"{what}: UNKNOWN (not measured on both engines)")
            continue
        f, b = _mean(res, "fp8", path), _mean(res, "bf16", base)
        out.append(f"{what}: {f:.2f} s / {b:.2f} s = {r[path]:.2f}x -> {'PASS' if r[path] <= limit else 'FAIL'}")
    largest = res["payload"]["largest_bytes"]
    bound = math.ceil(largest / ALLOC_BLOCK) * ALLOC_BLOCK
    for path in ("tensor", "atomic", "prequant", "disk"):
        peak, source = peak_extra(eng.get("fp8", {}).get(path, {}))
        what = f"FP8 peak extra memory <= largest BF16 tensor ({path})"
        if peak is None:
            out.append(f"{what}: UNKNOWN")
            continue
        out.append(f"{what}: {peak / GB:.3f} GB vs {largest / GB:.3f} GB -> {'PASS' if peak <= bound else 'FAIL'} "
                   f"({source}; bound rounded up to the allocator's 2 MiB blocks: {bound / GB:.4f} GB)")
    for path in ("tensor", "prequant"):
        frac = eng.get("fp8", {}).get(path, {}).get("apply_vs_d2d")
        what = f"FP8 apply >= {APPLY_BW_TARGET:.0%} of copy bandwidth ({path})"
        out.append(f"{what}: UNKNOWN" if frac is None else
                   f"{what}: {frac:.0%} -> {'PASS' if frac >= APPLY_BW_TARGET else 'FAIL'}")
    a, t, v = _mean(res, "fp8", "atomic"), _mean(res, "fp8", "tensor"), _mean(res, "fp8", "validate_only")
    if a and t:
        out.append(f"FP8 atomic step (no target): {a:.2f} s vs {t:.2f} s by tensor = +{a - t:.2f} s "
                   f"({r['atomic_vs_fp8_tensor']:.2f}x); validate-only phase alone {_fmt(v)} s")
    return out


def render(res: dict) -> str:
    """Markdown summary: the table and the target lines."""
    lines = [f"## weight update: {res.get('model')} ({res.get('device', '?')})", "",
             f"payload: {res['payload']['tensors']} tensors, {res['payload']['bytes'] / GB:.2f} GB BF16, "
             f"bucket {res['bucket_mb']} MB; largest tensor {res['payload']['largest_name']} "
             f"{res['payload']['largest_bytes'] / GB:.3f} GB; d2d copy {_fmt(res.get('d2d_copy_GBps'), '.0f')} GB/s "
             "(read + write)", "",
             "| engine | path | warm-up s | timed s | mean s | payload GB/s | peak extra first GB | "
             "peak extra timed GB | server peak extra GB | validate s | apply s | apply GB moved | "
             "apply GB/s (x d2d) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for eng in ("bf16", "fp8"):
        e = res.get("engines", {}).get(eng, {})
        for path in PATHS:
            p = e.get(path)
            if not p:
                continue
            if p.get("status") and p.get("status") != "ok" and not p.get("timed_s"):
                lines.append(f"| {eng} | {path} | {p['status']} | | | | | | | | | | |")
                continue
            tele = p.get("server_telemetry") or {}
            bw = p.get("apply_GBps")
            bw_col = "n/a" if bw is None else f"{bw:.0f} ({p.get('apply_vs_d2d', 0):.2f}x)"
            moved = (p.get("apply_bytes") or {}).get("total")
            timed = ", ".join(f"{t:.2f}" for t in p.get("timed_s", []))
            lines.append(
                f"| {eng} | {path} | {_fmt(p.get('warmup_s'))} | {timed} | {_fmt(p.get('mean_s'))} | "
                f"{_fmt(p.get('payload_GBps'), '.1f')} | {_fmt(_gb(p.get('peak_extra_first_bytes')), '.3f')} | "
                f"{_fmt(_gb(p.get('peak_extra_timed_bytes')), '.3f')} | "
                f"{_fmt(_gb(tele.get('server_peak_extra_bytes')), '.3f')} | {_fmt(tele.get('validate_s'), '.3f')} | "
                f"{_fmt(tele.get('apply_s'), '.3f')} | {_fmt(_gb(moved), '.1f')} | {bw_col} |")
    lines.append("")
    for eng_path, tele in ((f"fp8 {path}", (res.get("engines", {}).get("fp8", {}).get(path) or {})
                            .get("server_telemetry")) for path in PATHS):
        if tele and tele.get("tensors"):
            lines.append(f"- {eng_path}: {tele.get('replayed_tensors', 0)} of {tele['tensors']} tensors written at "
                         "their dry-run placement (grouped quantizer launches), the rest through load_weights")
    for t in res.get("targets", []):
        lines.append(f"- {t}")
    for eng in ("bf16", "fp8"):
        for key, rec in (res.get("engines", {}).get(eng) or {}).items():
            if key.startswith("profile_") and isinstance(rec, dict):
                lines += ["", *format_profile(eng, key[len("profile_"):], rec)]
    for note in res.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"
