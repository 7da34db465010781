#!/usr/bin/env python3
"""Full-model weight update, side by side: BF16 engine vs FP8-online engine, same payload, every update path.

Per engine (`bf16` = no --quantization, `fp8` = --quantization fp8_online_blockwise), one server at a time
(`python -m sglang.launch_server`, `--load-format dummy`, the flags of scripts/gpu/check_server.py), CUDA IPC,
``--bucket-mb`` buckets (default 512 MB). Paths (one warm-up push, then ``--repeats`` timed pushes each):
  tensor         by tensor, ``push_state_dict(..., atomic=False)``: one request per bucket (the old behaviour; the
                 only one a BF16 server takes)                                                     (both engines)
  atomic         by tensor, ``atomic=True``: every bucket validated first (requests that write nothing), then
                 applied                                                                                (fp8)
  validate_only  the validate-only phase of the atomic step alone (load_format "fp8rl.validate")       (fp8)
  prequant       pre-quantized FP8: every linear as float8_e4m3fn codes + power-of-two weight_scale_inv,
                 ``atomic=False``                                                                       (fp8)
  disk           ``push_from_disk`` of the BF16 payload saved as safetensors (``--disk-repeats``)       (both engines)
Measured per path:
  * wall time (client-side clock around the push);
  * peak extra GPU memory: a client thread samples device-wide used memory (``torch.cuda.mem_get_info``, every
    ``--poll-ms``) minus the level right before the push; and, on the FP8 engine, the server's own allocator peak
    (``last_update.peak_extra_bytes``);
  * FP8 engine: the validate / apply split from ``/get_server_info`` internal_states[0]["fp8rl"]["last_update"]
    (summed over the buckets of one extra push, read after each bucket; the disk path's last_update), the bytes the
    apply step moves (BF16 read + FP8 written + scales, or codes copied, plus BF16 params read + written), and that
    traffic per apply second as a fraction of a device-to-device copy measured in the client (1 GiB, read + write).
Targets (issue 16), FP8 engine against the BF16 engine: by tensor <= 1.10x BF16 by tensor; pre-quantized <= 0.80x
BF16 by tensor; disk <= 1.30x BF16 disk; peak extra memory <= the largest single BF16 tensor (rounded up to the
allocator's 2 MiB blocks); apply >= 50% of copy bandwidth. The atomic step's cost is reported against by tensor.

The payload (random BF16, every HF tensor of the shape) is generated once on the GPU in this process and reused for
both engines; it is also saved once as safetensors under OUT/tmp/w1 for the disk path (in a background thread while
the first server starts; deleted at the end unless --keep-tmp). The pre-quantized payload is built from it on the
GPU before the FP8 engine's prequant path and freed after it.

Scale-out (issue 36; scripts/update_scaleout.py): ``--tp-size N`` runs both engines at TP N on GPUs 0..N-1;
  broadcast      ``push_distributed`` from this process as the trainer (rank 0 of an update group over NCCL, on a GPU
                 outside the engine's: ``--trainer-gpu``), ``init_update_group`` once per engine       (both engines)
``--paths`` picks the paths, ``--kv-cache-dtype fp8_e4m3`` reports the FP8 engine's KV recalibration per step (its
kv_scales telemetry), ``--dry-run`` prints the plan (GPUs, payload per GPU, launch flags, targets) without a GPU.
Each path with engine telemetry gets a breakdown line: validate + quantize and write + transfer and the rest.
Targets (issue 36), Qwen3-30B-A3B shapes at TP 4: FP8 engine <= 1.0 s per full update by tensor and by broadcast, and
no slower than the BF16 engine's own update of that path in the same run.

Caveat on memory: the server's PyTorch caching allocator keeps what it once reserved, so device-wide polling sees
only *new* reservations; the first push after startup is the most informative polled number.

usage (GPU machine, after `source scripts/gpu/env.sh`):
  python3 scripts/bench_update.py --model-dir /tmp/fp8rl_suite/models --out /tmp/fp8rl_suite/update     (Qwen3-8B)
  python3 scripts/bench_update.py --model-dir ... --out ... --skip-disk --repeats 3
  python3 scripts/bench_update.py --model-dir ... --out ... --model qwen3-small                         (fast)
  python3 scripts/bench_update.py --model-dir ... --out ... --model qwen3-30b-a3b --tp-size 2 --paths tensor broadcast
  python3 scripts/bench_update.py --model-dir m --out o --model qwen3-30b-a3b --tp-size 4 --gpus 4 --dry-run   (CPU)
Writes OUT/update_results.json (after every step) and OUT/summary.md; prints the table and the target lines.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional, Sequence

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import update_scaleout

GB = 1e9
ENGINES = {"bf16": [], "fp8": ["--quantization", "fp8_online_blockwise"]}
PATHS = update_scaleout.PATHS
FP8_ONLY_PATHS = ("atomic", "validate_only", "prequant")
# FP8 path -> (the BF16 path it is compared with, the largest allowed ratio)
RATIO_TARGETS = {"tensor": ("tensor", 1.10), "prequant": ("tensor", 0.80), "disk": ("disk", 1.30)}
APPLY_BW_TARGET = 0.5  # apply traffic per second, as a fraction of the device-to-device copy
ALLOC_BLOCK = 2 << 20  # the CUDA caching allocator rounds large blocks up to 2 MiB
TIME_SHARE = {"bf16": 2, "fp8": 3}  # of the deadline, per engine (unused time passes on to the next engine)
BLOCK = 128


def say(msg: str) -> None:
    """A timestamped progress line."""
    print(f"[bench_update {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
    for note in res.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# GPU side


class MemPoller:
    """Device-wide used memory sampled in a thread (torch.cuda.mem_get_info sees every process on the device)."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def used() -> int:
        import torch

        free, total = torch.cuda.mem_get_info()
        return total - free

    @staticmethod
    def baseline(n: int = 5) -> int:
        vals = []
        for _ in range(n):
            vals.append(MemPoller.used())
            time.sleep(0.01)
        return int(statistics.median(vals))

    def __enter__(self) -> MemPoller:
        self.peak = self.used()

        def loop() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self.used())
                self.samples += 1
                time.sleep(self.period_s)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(3 * self.period_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.peak = max(self.peak, self.used())


def measure_d2d_copy(nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth, (read + write) bytes per second."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    secs = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / secs


def launch_command(model: str, port: int, engine: str, mem: float, extra: Sequence[str] = ()) -> list[str]:
    """The stock launcher's command line for one engine (``extra``: the plan's server flags, TP and KV dtype)."""
    from server_io import COMMON

    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--load-format", "dummy", "--mem-fraction-static", str(mem), *ENGINES[engine], *COMMON, *extra]


def launch(model: str, port: int, log: str, engine: str, mem: float, extra: Sequence[str] = ()) -> subprocess.Popen:
    """The stock launcher (the plugin arrives through SGLang's entry-point loader), in its own process group."""
    env = dict(os.environ, SGLANG_JIT_DEEPGEMM_PRECOMPILE="0")
    cmd = launch_command(model, port, engine, mem, extra)
    say(f"launch {engine}: {' '.join(cmd[3:])}")
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen, baseline_used: int, timeout: float = 60) -> None:
    """Terminate the server's process group (ours) and wait until its GPU memory is released."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
    else:
        try:  # children may outlive a crashed launcher
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    t0 = time.time()
    while time.time() - t0 < 30 and MemPoller.used() > baseline_used + (1 << 30):
        time.sleep(0.5)


def fp8rl_info(url: str) -> dict:
    import requests

    info = requests.get(url + "/get_server_info", timeout=60).json()
    states = info.get("internal_states") or [{}]
    return states[0].get("fp8rl") or {}


def generate_ids(url: str, ids=(1, 2, 3, 4, 5, 6, 7, 8), n: int = 8) -> list[int]:
    import requests

    r = requests.post(url + "/generate", json={"input_ids": list(ids), "sampling_params": {
        "max_new_tokens": n, "temperature": 0}}, timeout=120).json()
    return r["output_ids"]


def save_payload(sd: dict, model_src: str, w1_dir: str, box: dict) -> None:
    """Copy to host and write OUT/tmp/w1 (config + tokenizer + model.safetensors); runs in a thread."""
    try:
        from safetensors.torch import save_file

        t0 = time.time()
        os.makedirs(w1_dir, exist_ok=True)
        for f in os.listdir(model_src):
            if f.endswith(".json") or f.startswith("tokenizer"):
                shutil.copy(os.path.join(model_src, f), w1_dir)
        cpu = {k: v.to("cpu", non_blocking=False).contiguous() for k, v in sd.items()}
        save_file(cpu, os.path.join(w1_dir, "model.safetensors"), metadata={"format": "pt"})
        del cpu
        box["save_s"] = time.time() - t0
        box["ok"] = True
    except (OSError, RuntimeError, ValueError) as e:  # reported; the disk path is then skipped
        box["error"] = f"{type(e).__name__}: {e}"


def validate_only_push(url: str, weights: dict, bucket_bytes: int) -> int:
    """The first phase of an atomic step alone: every bucket sent with load_format "fp8rl.validate" (the engine
    validates and writes nothing); returns the number of buckets. Raises WeightPushError on a refusal."""
    import requests

    from sglang_fp8rl.trainer import WeightPushError
    from sglang_fp8rl.weight_sync.client import buckets, serialize_for_ranks  # the client's bucketing, sent by hand
    from sglang_fp8rl.weight_sync.protocol import VALIDATE_ONLY

    tp_size = int(requests.get(url + "/get_server_info", timeout=60).json().get("tp_size", 1))
    n = 0
    for n, bucket in enumerate(buckets(weights, bucket_bytes), 1):
        body = {"serialized_named_tensors": serialize_for_ranks(bucket, tp_size), "load_format": VALIDATE_ONLY,
                "flush_cache": False}
        r = requests.post(url + "/update_weights_from_tensor", json=body, timeout=600)
        if r.status_code != 200 or not r.json().get("success"):
            raise WeightPushError(f"validate-only bucket {n} ({bucket[0][0]} ...): HTTP {r.status_code} {r.text[:500]}")
    return n


def telemetry_of(last: Optional[dict]) -> Optional[dict]:
    """One update's last_update record in the form of sum_bucket_stats (the disk path is one streaming update)."""
    return None if not last else sum_bucket_stats([last])


class Bench:
    """One run: the engines one after the other, every path of each, the results saved after every step."""

    def __init__(self, args: argparse.Namespace, argv: Optional[list[str]], plan: update_scaleout.Plan):
        self.args = args
        self.argv = list(argv or [])
        self.t0 = time.time()
        self.res: dict[str, Any] = {"engines": {}, "notes": [], "targets": []}
        self.plan = plan  # on this machine's GPUs
        self.url = ""  # the engine running now

    def left(self) -> float:
        """Seconds left of the deadline."""
        return self.args.deadline_s - (time.time() - self.t0)

    def save(self) -> None:
        """Targets and ratios recomputed, OUT/update_results.json rewritten."""
        self.res["elapsed_s"] = time.time() - self.t0
        if "payload" in self.res:
            self.res["targets"] = targets(self.res) + update_scaleout.scale_targets(self.res)
            self.res["ratios"] = ratios(self.res)
        with open(os.path.join(self.args.out, "update_results.json"), "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def timed(self, fn: Callable[[], Any], poller_period: float) -> tuple[float, int, Any]:
        """(wall s, peak extra bytes over the pre-push level, answer) of one update."""
        import torch

        torch.cuda.synchronize()
        base = MemPoller.baseline()
        with MemPoller(poller_period) as poll:
            t = time.perf_counter()
            answer = fn()
            wall = time.perf_counter() - t
        return wall, max(0, poll.peak - base), answer

    def run_path(self, eng: str, path: str, push: Callable[[], Any], phase_end: float) -> dict:
        """Warm-up + repeats of one path, within this engine's share of the deadline."""
        a = self.args
        if path not in self.plan.paths:
            return {"status": f"skipped ({self.plan.skipped.get(path, 'not planned')})"}
        rec: dict[str, Any] = {"status": "ok", "timed_s": [], "peak_extra_timed_bytes": None}
        kv_before = update_scaleout.kv_writes(fp8rl_info(self.url)) if a.kv_cache_dtype else None
        period = a.poll_ms / 1e3
        reps = a.disk_repeats if path == "disk" else a.repeats
        warm = a.disk_warmup if path == "disk" else a.warmup
        # first guess without a measurement: 2 GB/s by tensor, 1 GB/s from disk
        est = self.res.setdefault("est_s", {}).get(path) or \
            self.res["payload"]["bytes"] / GB / (1.0 if path == "disk" else 2.0)
        for i in range(warm + reps):
            if time.time() + est * 1.2 + 5 > phase_end:
                rec["status"] = f"deadline: stopped after {i} of {warm + reps} pushes"
                say(f"{eng}/{path}: {rec['status']}")
                break
            wall, extra, _ = self.timed(push, period)
            est = wall
            label = "warm-up" if i < warm else f"timed {i - warm + 1}/{reps}"
            say(f"{eng}/{path} {label}: {wall:.2f} s, peak extra {extra / GB:.3f} GB")
            if i == 0:
                rec["peak_extra_first_bytes"] = extra
            if i < warm:
                rec["warmup_s"] = wall
            else:
                rec["timed_s"].append(wall)
                rec["peak_extra_timed_bytes"] = max(rec["peak_extra_timed_bytes"] or 0, extra)
        if rec["timed_s"]:
            rec["mean_s"] = statistics.mean(rec["timed_s"])
            rec["payload_GBps"] = self.res["payload"]["bytes"] / GB / rec["mean_s"]
            self.res["est_s"].setdefault(path, rec["timed_s"][0])
        if kv_before is not None:
            rec["kv_recalibration"] = update_scaleout.kv_since(kv_before, fp8rl_info(self.url))
        self.save()
        return rec

    def telemetry_push(self, url: str, weights: dict) -> Optional[dict]:
        """One extra push bucket by bucket (atomic=False), reading last_update after each (FP8 engine only)."""
        from sglang_fp8rl.trainer import push_state_dict
        from sglang_fp8rl.weight_sync.client import buckets

        per = []
        for bucket in buckets(weights, self.args.bucket_mb << 20):
            push_state_dict(url, bucket, bucket_bytes=1 << 62, atomic=False)
            last = fp8rl_info(url).get("last_update")
            if last is None:
                return None
            per.append(last)
        return sum_bucket_stats(per)

    def add_telemetry(self, rec: dict, url: str, weights: dict, prequant: bool, phase_end: float) -> None:
        """The validate / apply split and the apply bandwidth of one path (FP8 engine), if time allows."""
        if time.time() + (rec.get("mean_s") or 30) * 2 + 5 >= phase_end:
            return
        rec["server_telemetry"] = self.telemetry_push(url, weights)
        apply_bandwidth(rec, apply_bytes(self.shapes, prequant=prequant), self.res.get("d2d_copy_GBps"))
        self.save()

    def fp8_paths(self, e: dict, url: str, sd: dict, push: Callable[..., Any], phase_end: float) -> None:
        """The FP8 engine's own paths: telemetry of by tensor, the atomic step, its validate-only phase, and the
        pre-quantized update (payload built here and freed after)."""
        import torch
        from server_payloads import prequantize

        a = self.args
        if "tensor" in self.plan.paths:
            self.add_telemetry(e["tensor"], url, sd, False, phase_end)
        e["atomic"] = self.run_path("fp8", "atomic", lambda: push(sd, True), phase_end)
        e["validate_only"] = self.run_path("fp8", "validate_only",
                                           lambda: validate_only_push(url, sd, a.bucket_mb << 20), phase_end)
        if "prequant" not in self.plan.paths:
            return
        t = time.time()
        held = {"pq": update_scaleout.prequant_payload(sd, self.plan, prequantize)}  # codes + scales
        torch.cuda.synchronize()
        e["prequant_build_s"] = time.time() - t
        try:
            e["prequant"] = self.run_path("fp8", "prequant", lambda: push(held["pq"], False), phase_end)
            self.add_telemetry(e["prequant"], url, held["pq"], True, phase_end)
        finally:
            held.clear()
            torch.cuda.empty_cache()

    def disk_path(self, eng: str, e: dict, url: str, phase_end: float, disk_box: dict, w1_dir: str) -> None:
        """push_from_disk of the saved payload; on the FP8 engine also its last_update split."""
        from sglang_fp8rl.trainer import push_from_disk

        if self.args.skip_disk:
            e["disk"] = {"status": "skipped (--skip-disk)"}
            return
        if disk_box.get("thread") is not None:
            disk_box["thread"].join(max(1.0, phase_end - time.time() - 30))
        if not disk_box.get("ok"):
            e["disk"] = {"status": f"skipped: checkpoint not written ({disk_box.get('error', 'not ready')})"}
            return
        e["disk"] = self.run_path(eng, "disk", lambda: push_from_disk(url, w1_dir), phase_end)
        if eng == "fp8":
            e["disk"]["server_telemetry"] = telemetry_of(fp8rl_info(url).get("last_update"))

    def run_engine(self, eng: str, sd: dict, model: str, phase_end: float, disk_box: dict, w1_dir: str) -> None:
        """Start one engine's server, run its paths, stop it (its error is recorded; the other engine still runs)."""
        from sglang_fp8rl.trainer import push_state_dict

        a = self.args
        e: dict[str, Any] = {}
        self.res["engines"][eng] = e
        url = self.url = f"http://127.0.0.1:{a.port}"
        pre_used = MemPoller.used()
        proc = launch(model, a.port, os.path.join(a.out, f"server_{eng}.log"), eng, a.mem, self.plan.server_flags)
        try:
            from server_io import wait_healthy

            e["startup_s"] = wait_healthy(a.port, proc, timeout=max(60.0, phase_end - time.time()))
            say(f"{eng}: healthy after {e['startup_s']:.0f} s")
            e["server_used_bytes"] = MemPoller.used() - pre_used
            e["schemes"] = fp8rl_info(url).get("schemes")
            self.save()

            if disk_box.get("thread") is not None and disk_box["thread"].is_alive():
                # the checkpoint write (host copies, disk) must not overlap the timed pushes
                t = time.time()
                disk_box["thread"].join(max(1.0, phase_end - time.time() - 60))
                e["waited_for_disk_save_s"] = time.time() - t

            def push(weights: dict, atomic: bool) -> list:
                return push_state_dict(url, weights, bucket_bytes=a.bucket_mb << 20, atomic=atomic)

            # atomic=False: a BF16 server does not know the validate-only format of the atomic step
            e["tensor"] = self.run_path(eng, "tensor", lambda: push(sd, False), phase_end)
            if eng == "fp8":
                self.fp8_paths(e, url, sd, push, phase_end)
            update_scaleout.broadcast_path(self, eng, e, url, sd, phase_end, fp8rl_info, sum_bucket_stats)
            try:
                e["tokens_after_update"] = generate_ids(url)
            except (OSError, RuntimeError, ValueError, KeyError) as ex:  # informative only (requests: OSError)
                e["tokens_after_update"] = f"generate failed: {ex}"
            self.disk_path(eng, e, url, phase_end, disk_box, w1_dir)
            self.save()
        except (OSError, RuntimeError, ValueError, KeyError, TimeoutError) as ex:  # this engine's numbers are lost, the
            # other engine still runs; WeightPushError is a RuntimeError, requests' errors are OSErrors
            e["error"] = f"{type(ex).__name__}: {ex}"
            say(f"{eng}: ERROR {e['error']}")
            self.save()
        finally:
            stop(proc, pre_used)

    def run(self) -> int:
        """The whole benchmark; 0 when no engine failed."""
        import torch

        a = self.args
        from make_models import ensure
        from server_payloads import W1_SEED, hf_shapes, make_weights

        a.skip_disk = "disk" not in self.plan.paths  # no checkpoint written for a path that does not run
        os.makedirs(a.out, exist_ok=True)
        model = ensure(a.model_dir, [a.model])[0]
        config = json.load(open(os.path.join(model, "config.json")))
        self.shapes = hf_shapes(config)
        self.res.update(command=" ".join(["python3 scripts/bench_update.py", *self.argv]),
                        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        model=a.model, model_path=model, bucket_mb=a.bucket_mb, repeats=a.repeats,
                        disk_repeats=a.disk_repeats, mem_fraction_static=a.mem, payload=payload_stats(self.shapes),
                        device=f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", deadline_s=a.deadline_s,
                        tp_size=a.tp_size, plan=self.plan.as_dict())
        self.res["notes"].append("peak extra = max device-wide used memory during the push minus the level right "
                                 "before it (server steady state + client payload); the server's caching "
                                 "allocator hides reuse of blocks it reserved earlier, so this is a lower bound")
        self.res["notes"].append("validate/apply: sum over the buckets of one extra push (atomic=False) read from "
                                 "last_update after each bucket; the disk path: the last_update of its last update "
                                 "(one streaming update)")
        self.res["d2d_copy_GBps"] = measure_d2d_copy() / GB
        say(f"d2d copy {self.res['d2d_copy_GBps']:.0f} GB/s (read + write)")

        t = time.time()
        sd = update_scaleout.make_payload(self.shapes, self.plan, make_weights, W1_SEED)
        torch.cuda.synchronize()
        self.res["payload_gen_s"] = time.time() - t
        say(f"payload: {self.res['payload']['bytes'] / GB:.2f} GB on GPU(s) {self.plan.payload_gpus} in "
            f"{self.res['payload_gen_s']:.1f} s")
        self.save()

        w1_dir = os.path.join(a.out, "tmp", "w1")
        disk_box: dict[str, Any] = {}
        if not a.skip_disk:
            os.makedirs(os.path.dirname(w1_dir), exist_ok=True)
            free = shutil.disk_usage(os.path.dirname(w1_dir)).free
            need = int(self.res["payload"]["bytes"] * 1.1)
            if free < need:
                a.skip_disk = True
                self.res["notes"].append(f"disk path skipped: {free / GB:.1f} GB free < {need / GB:.1f} GB needed")
            else:
                disk_box["thread"] = threading.Thread(target=save_payload, args=(sd, model, w1_dir, disk_box),
                                                      daemon=True)
                disk_box["thread"].start()

        try:
            engines = [x for x in ("bf16", "fp8") if x in a.engines]
            for idx, eng in enumerate(engines):
                # shares of the time left for the engines still to run (the FP8 engine has more paths)
                share = TIME_SHARE[eng] / sum(TIME_SHARE[x] for x in engines[idx:])
                phase_end = time.time() + self.left() * share
                self.run_engine(eng, sd, model, phase_end, disk_box, w1_dir)
                if disk_box.get("save_s") and "disk_save_s" not in self.res:
                    self.res["disk_save_s"] = disk_box["save_s"]
        finally:
            if disk_box.get("thread") is not None:
                disk_box["thread"].join(120)
            if disk_box.get("save_s"):
                self.res["disk_save_s"] = disk_box["save_s"]
            if not a.keep_tmp:
                shutil.rmtree(os.path.join(a.out, "tmp"), ignore_errors=True)
            self.save()
            md = render(self.res)
            with open(os.path.join(a.out, "summary.md"), "w") as f:
                f.write(md)
            print(md, flush=True)
        ok = all("error" not in e for e in self.res["engines"].values())
        return 0 if ok else 1


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model-dir", required=True, help="folder of dummy-weight models (scripts/gpu/make_models.py; "
                                                      "the --model folder is written there if missing)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b", choices=["qwen3-8b", "qwen3-small", "qwen3-30b-a3b"])
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=530.0, help="whole-run budget in seconds (default 530)")
    p.add_argument("--repeats", type=int, default=2, help="timed pushes per path other than disk (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up pushes per path other than disk (default 1)")
    p.add_argument("--disk-repeats", type=int, default=2, help="timed disk updates per engine (default 2)")
    p.add_argument("--disk-warmup", type=int, default=0,
                   help="warm-up disk updates per engine (default 0: the tensor path already warmed the kernels)")
    p.add_argument("--skip-disk", action="store_true", help="no safetensors copy, no disk path")
    p.add_argument("--keep-tmp", action="store_true", help="keep OUT/tmp/w1 (the 16 GB checkpoint)")
    p.add_argument("--engines", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--mem", type=float, default=0.5, help="--mem-fraction-static of the servers (default 0.5)")
    p.add_argument("--port", type=int, default=30020)
    p.add_argument("--poll-ms", type=float, default=5.0, help="memory sampling period (default 5 ms)")
    update_scaleout.add_args(p)
    return p.parse_args(argv)


def dry_run(args: argparse.Namespace) -> int:
    """Print the run's plan as JSON (no GPU, no server); 0, or 2 with the reason for a layout that cannot run."""
    from make_models import ensure
    from server_payloads import hf_shapes

    from sglang_fp8rl.cpu_runner import install_cpu_stubs

    install_cpu_stubs()  # SGLang's import (the launch flags) without a working torchvision, as on a CPU machine
    try:
        plan = update_scaleout.make_plan(args, args.gpus or args.tp_size)
    except ValueError as e:
        print(f"bench_update.py: {e}", file=sys.stderr)
        return 2
    model = ensure(args.model_dir, [args.model])[0]
    shapes = hf_shapes(json.load(open(os.path.join(model, "config.json"))))
    commands = {eng: " ".join(launch_command(model, args.port, eng, args.mem, plan.server_flags))
                for eng in args.engines}
    print(json.dumps(update_scaleout.dry_run(args, shapes, commands), indent=1))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print("bench_update.py needs a CUDA GPU (it launches SGLang servers and pushes CUDA IPC handles)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a suite timeout still stops the server (finally)
    try:
        plan = update_scaleout.make_plan(args, torch.cuda.device_count())
    except ValueError as e:  # a layout this machine cannot run (the message names the option)
        print(f"bench_update.py: {e}", file=sys.stderr)
        return 2
    return Bench(args, argv, plan).run()


if __name__ == "__main__":
    sys.exit(main())
