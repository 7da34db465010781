#!/usr/bin/env python3
"""Full-model weight update: BF16 engine vs FP8-online engine, same payload, by tensor (CUDA IPC) and from disk.

Measures, per engine (`bf16` = no --quantization, `fp8` = --quantization fp8_online_blockwise) and per path:
  * wall time of a full update (client-side clock around ``push_state_dict`` / ``push_from_disk``): one warm-up push,
    then ``--repeats`` timed pushes;
  * peak extra GPU memory during the update: a client thread samples device-wide used memory
    (``torch.cuda.mem_get_info``, every ``--poll-ms``) and subtracts the level right before the push (which holds the
    server's steady state and the client's payload);
  * FP8 engine only: server-side validate_s / apply_s summed over the buckets of one extra per-bucket push (read from
    ``/get_server_info`` internal_states[0]["fp8rl"]["last_update"] after every bucket), and the quantizer bandwidth
    = bytes moved by the apply step (BF16 read + FP8 written + scales; BF16 params read + written) / apply_s,
    against a device-to-device copy measured in the client (1 GiB, read + write bytes per second).
Targets (issue): FP8 update <= 1.10x the BF16 update; peak extra memory <= the largest single tensor in BF16.

Servers run one at a time (`python -m sglang.launch_server`, `--load-format dummy`, the flags of
scripts/gpu/check_server.py). The payload (random BF16, every HF tensor of the shape) is generated once on the GPU
in this process, kept there and reused for both engines; it is also saved once as safetensors under OUT/tmp/w1 for
the disk path (in a background thread while the first server starts; deleted at the end unless --keep-tmp).

Caveat on memory: the server's PyTorch caching allocator keeps what it once reserved, so device-wide polling sees
only *new* reservations; temporaries served from blocks cached earlier (startup, a previous push) are invisible.
The first push after startup ("first") is the most informative number; the timed pushes usually show ~0.

usage (GPU machine, after `source scripts/gpu/env.sh`):
  python3 scripts/bench_update.py --model-dir /tmp/fp8rl_suite/models --out /tmp/fp8rl_suite/update     (Qwen3-8B)
  python3 scripts/bench_update.py --model-dir ... --out ... --model qwen3-small                         (fast)
Writes OUT/update_results.json (after every step) and OUT/summary.md; prints the table and the target lines.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root, for sglang_fp8rl when it is not installed

GB = 1e9
ENGINES = {"bf16": [], "fp8": ["--quantization", "fp8_online_blockwise"]}
START_S_GUESS = {"qwen3-8b": 110.0, "qwen3-small": 70.0}
BLOCK = 128


def say(msg: str) -> None:
    print(f"[bench_update {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# pure helpers (CPU-testable)


def linear_names(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The HF tensors that become FP8 linear layers (2-D, not embeddings / lm_head)."""
    return [n for n, s in shapes.items() if len(s) == 2 and "embed_tokens" not in n and "lm_head" not in n]


def apply_bytes(shapes: dict[str, tuple[int, ...]], block: int = BLOCK) -> dict[str, int]:
    """Bytes the apply step moves on an FP8 engine: quantized linears read BF16 and write FP8 + fp32 block scales;
    the other parameters (embeddings, lm_head, norms) are BF16 copies (read + write)."""
    lin = set(linear_names(shapes))
    quant_read = quant_write = copy_bytes = 0
    for name, s in shapes.items():
        numel = 1
        for d in s:
            numel *= d
        if name in lin:
            n, k = s
            quant_read += 2 * numel
            quant_write += numel + 4 * (-(-n // block)) * (-(-k // block))
        else:
            copy_bytes += 2 * 2 * numel
    return {"quant_read": quant_read, "quant_write": quant_write, "bf16_copy_rw": copy_bytes,
            "total": quant_read + quant_write + copy_bytes}


def payload_stats(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    sizes = {n: 2 * _numel(s) for n, s in shapes.items()}
    largest = max(sizes, key=sizes.get)
    return {"tensors": len(sizes), "bytes": sum(sizes.values()), "largest_name": largest,
            "largest_bytes": sizes[largest]}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def sum_bucket_stats(stats: list[dict]) -> dict[str, Any]:
    """Sum the per-bucket last_update records of one push."""
    out = {"buckets": len(stats), "ok": all(s.get("ok") for s in stats), "tensors": 0, "bytes": 0,
           "validate_s": 0.0, "apply_s": 0.0, "fp8_layers_written": {}, "bf16_params_written": 0}
    for s in stats:
        out["tensors"] += s.get("tensors", 0)
        out["bytes"] += s.get("bytes", 0)
        out["validate_s"] += s.get("validate_s", 0.0)
        out["apply_s"] += s.get("apply_s", 0.0)
        out["bf16_params_written"] += s.get("bf16_params_written", 0)
        if s.get("peak_extra_bytes") is not None:  # server-side allocator peak (exact, per bucket)
            out["server_peak_extra_bytes"] = max(out.get("server_peak_extra_bytes", 0), s["peak_extra_bytes"])
        for k, v in (s.get("fp8_layers_written") or {}).items():
            out["fp8_layers_written"][k] = out["fp8_layers_written"].get(k, 0) + v
    return out


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def render(res: dict) -> str:
    """Markdown summary: the table and the target lines."""
    lines = [f"## weight update: {res.get('model')} ({res.get('device', '?')})", "",
             f"payload: {res['payload']['tensors']} tensors, {res['payload']['bytes'] / GB:.2f} GB BF16, "
             f"bucket {res['bucket_mb']} MB; largest tensor {res['payload']['largest_name']} "
             f"{res['payload']['largest_bytes'] / GB:.3f} GB; d2d copy {_fmt(res.get('d2d_copy_GBps'), '.0f')} GB/s "
             "(read + write)", "",
             "| engine | path | warm-up s | timed s | mean s | payload GB/s | peak extra first GB | "
             "peak extra timed GB | server peak extra GB | validate s | apply s | quantizer GB/s (x d2d) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for eng in ("bf16", "fp8"):
        e = res.get("engines", {}).get(eng, {})
        for path in ("tensor", "disk"):
            p = e.get(path)
            if not p:
                continue
            if p.get("status") and p.get("status") != "ok" and not p.get("timed_s"):
                lines.append(f"| {eng} | {path} | {p['status']} | | | | | | | | | |")
                continue
            tele = p.get("server_telemetry") or {}
            qbw = p.get("quantizer_GBps")
            qcol = "n/a" if qbw is None else f"{qbw:.0f} ({p.get('quantizer_vs_d2d', 0):.2f}x)"
            timed = ", ".join(f"{t:.2f}" for t in p.get("timed_s", []))
            lines.append(
                f"| {eng} | {path} | {_fmt(p.get('warmup_s'))} | {timed} | {_fmt(p.get('mean_s'))} | "
                f"{_fmt(p.get('payload_GBps'), '.1f')} | {_fmt(_gb(p.get('peak_extra_first_bytes')), '.3f')} | "
                f"{_fmt(_gb(p.get('peak_extra_timed_bytes')), '.3f')} | "
                f"{_fmt(_gb(tele.get('server_peak_extra_bytes')), '.3f')} | {_fmt(tele.get('validate_s'), '.3f')} | "
                f"{_fmt(tele.get('apply_s'), '.3f')} | {qcol} |")
    lines.append("")
    for t in res.get("targets", []):
        lines.append(f"- {t}")
    for note in res.get("notes", []):
        lines.append(f"- note: {note}")
    return "\n".join(lines) + "\n"


def _gb(x: Optional[float]) -> Optional[float]:
    return None if x is None else x / GB


def targets(res: dict) -> list[str]:
    """The issue's two targets, as PASS/FAIL/UNKNOWN lines."""
    out = []
    eng = res.get("engines", {})
    for path in ("tensor", "disk"):
        b, f = eng.get("bf16", {}).get(path, {}), eng.get("fp8", {}).get(path, {})
        if b.get("mean_s") and f.get("mean_s"):
            r = f["mean_s"] / b["mean_s"]
            out.append(f"FP8 update <= 1.10x BF16 ({path}): {f['mean_s']:.2f} s / {b['mean_s']:.2f} s = {r:.2f}x "
                       f"-> {'PASS' if r <= 1.10 else 'FAIL'}")
        else:
            out.append(f"FP8 update <= 1.10x BF16 ({path}): UNKNOWN (not measured on both engines)")
    largest = res["payload"]["largest_bytes"]
    for path in ("tensor", "disk"):
        f = eng.get("fp8", {}).get(path, {})
        peaks = [x for x in (f.get("peak_extra_first_bytes"), f.get("peak_extra_timed_bytes")) if x is not None]
        if peaks:
            peak = max(peaks)
            out.append(f"FP8 peak extra memory <= largest BF16 tensor ({path}): {peak / GB:.3f} GB vs "
                       f"{largest / GB:.3f} GB -> {'PASS' if peak <= largest else 'FAIL'} (device-wide polling; "
                       "a lower bound, see notes)")
        else:
            out.append(f"FP8 peak extra memory <= largest BF16 tensor ({path}): UNKNOWN")
    return out


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

    def __enter__(self) -> "MemPoller":
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


def launch(model: str, port: int, log: str, engine: str, mem: float) -> subprocess.Popen:
    """The stock launcher (the plugin arrives through SGLang's entry-point loader), in its own process group."""
    from check_server import COMMON

    env = dict(os.environ, SGLANG_JIT_DEEPGEMM_PRECOMPILE="0")
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
           "--load-format", "dummy", "--mem-fraction-static", str(mem), *ENGINES[engine], *COMMON]
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


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.time()
        self.res: dict[str, Any] = {"engines": {}, "notes": [], "targets": []}

    def left(self) -> float:
        return self.args.deadline_s - (time.time() - self.t0)

    def save(self) -> None:
        self.res["elapsed_s"] = time.time() - self.t0
        self.res["targets"] = targets(self.res) if "payload" in self.res else []
        with open(os.path.join(self.args.out, "update_results.json"), "w") as f:
            json.dump(self.res, f, indent=1, default=str)

    def timed(self, fn, poller_period: float) -> tuple[float, int, Any]:
        """(wall s, peak extra bytes over the pre-push level, answer) of one update."""
        import torch

        torch.cuda.synchronize()
        base = MemPoller.baseline()
        with MemPoller(poller_period) as poll:
            t = time.perf_counter()
            answer = fn()
            wall = time.perf_counter() - t
        return wall, max(0, poll.peak - base), answer

    def run_path(self, eng: str, path: str, push, phase_end: float, est_s: Optional[float]) -> dict:
        """Warm-up + repeats of one path, within this engine's share of the deadline."""
        a = self.args
        rec: dict[str, Any] = {"status": "ok", "timed_s": [], "peak_extra_timed_bytes": None}
        period = a.poll_ms / 1e3
        reps = a.repeats if path == "tensor" else a.disk_repeats
        warm = a.warmup if path == "tensor" else a.disk_warmup
        # first guess without a measurement: 2 GB/s by tensor, 1 GB/s from disk
        est = est_s or self.res["payload"]["bytes"] / GB / (2.0 if path == "tensor" else 1.0)
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
        return rec

    def telemetry_push(self, url: str, sd: dict) -> Optional[dict]:
        """One extra push bucket by bucket, reading last_update after each (FP8 engine only)."""
        from sglang_fp8rl.weight_sync.client import buckets, push_state_dict

        per = []
        for bucket in buckets(sd, self.args.bucket_mb << 20):
            push_state_dict(url, bucket, bucket_bytes=1 << 62)
            last = fp8rl_info(url).get("last_update")
            if last is None:
                return None
            per.append(last)
        return sum_bucket_stats(per)

    def run_engine(self, eng: str, sd: dict, model: str, phase_end: float, disk_box: dict, w1_dir: str) -> None:
        from sglang_fp8rl.weight_sync.client import push_from_disk, push_state_dict

        a = self.args
        e: dict[str, Any] = {}
        self.res["engines"][eng] = e
        url = f"http://127.0.0.1:{a.port}"
        pre_used = MemPoller.used()
        proc = launch(model, a.port, os.path.join(a.out, f"server_{eng}.log"), eng, a.mem)
        try:
            from check_server import wait_healthy

            e["startup_s"] = wait_healthy(a.port, proc, timeout=max(60.0, phase_end - time.time()))
            say(f"{eng}: healthy after {e['startup_s']:.0f} s")
            e["server_used_bytes"] = MemPoller.used() - pre_used
            info = fp8rl_info(url)
            e["schemes"] = info.get("schemes")
            self.save()

            if disk_box.get("thread") is not None and disk_box["thread"].is_alive():
                # the checkpoint write (host copies, disk) must not overlap the timed pushes
                t = time.time()
                disk_box["thread"].join(max(1.0, phase_end - time.time() - 60))
                e["waited_for_disk_save_s"] = time.time() - t

            def tensor_push():
                return push_state_dict(url, sd, bucket_bytes=a.bucket_mb << 20)

            e["tensor"] = self.run_path(eng, "tensor", tensor_push, phase_end, self.res.get("tensor_est_s"))
            if e["tensor"].get("warmup_s"):
                self.res.setdefault("tensor_est_s", e["tensor"]["warmup_s"])
            self.save()
            if eng == "fp8" and time.time() + (e["tensor"].get("mean_s") or 30) * 2 + 5 < phase_end:
                tele = self.telemetry_push(url, sd)
                e["tensor"]["server_telemetry"] = tele
                if tele and tele["apply_s"] > 0:
                    moved = apply_bytes(self.shapes)
                    e["tensor"]["apply_bytes"] = moved
                    e["tensor"]["quantizer_GBps"] = moved["total"] / GB / tele["apply_s"]
                    e["tensor"]["quantizer_quant_only_GBps"] = \
                        (moved["quant_read"] + moved["quant_write"]) / GB / tele["apply_s"]
                    if self.res.get("d2d_copy_GBps"):
                        e["tensor"]["quantizer_vs_d2d"] = e["tensor"]["quantizer_GBps"] / self.res["d2d_copy_GBps"]
                self.save()
            try:
                e["tokens_after_update"] = generate_ids(url)
            except (OSError, RuntimeError, ValueError, KeyError) as ex:  # informative only (requests errors are OSError)
                e["tokens_after_update"] = f"generate failed: {ex}"

            if a.skip_disk:
                e["disk"] = {"status": "skipped (--skip-disk)"}
            else:
                if disk_box.get("thread") is not None:
                    disk_box["thread"].join(max(1.0, phase_end - time.time() - 30))
                if not disk_box.get("ok"):
                    e["disk"] = {"status": f"skipped: checkpoint not written ({disk_box.get('error', 'not ready')})"}
                else:
                    e["disk"] = self.run_path(eng, "disk", lambda: push_from_disk(url, w1_dir), phase_end,
                                              self.res.get("disk_est_s"))
                    if e["disk"].get("timed_s"):
                        self.res.setdefault("disk_est_s", e["disk"]["timed_s"][0])
                    if eng == "fp8":
                        last = fp8rl_info(url).get("last_update")
                        e["disk"]["last_update_after"] = last
            self.save()
        except (OSError, RuntimeError, ValueError, KeyError, TimeoutError) as ex:  # this engine's numbers are lost, the
            # other engine still runs; WeightPushError is a RuntimeError, requests' errors are OSErrors
            e["error"] = f"{type(ex).__name__}: {ex}"
            say(f"{eng}: ERROR {e['error']}")
            self.save()
        finally:
            stop(proc, pre_used)

    def run(self) -> int:
        import torch

        a = self.args
        from check_server import hf_shapes, make_w1
        from make_models import ensure

        os.makedirs(a.out, exist_ok=True)
        model = ensure(a.model_dir, [a.model])[0]
        config = json.load(open(os.path.join(model, "config.json")))
        self.shapes = hf_shapes(config)
        self.res.update(model=a.model, model_path=model, bucket_mb=a.bucket_mb, repeats=a.repeats,
                        disk_repeats=a.disk_repeats, mem_fraction_static=a.mem, payload=payload_stats(self.shapes),
                        device=torch.cuda.get_device_name(), deadline_s=a.deadline_s)
        self.res["notes"].append("peak extra = max device-wide used memory during the push minus the level right "
                                 "before it (server steady state + client payload); the server's caching "
                                 "allocator hides reuse of blocks it reserved earlier, so this is a lower bound")
        self.res["notes"].append("validate/apply: sum over the buckets of one extra push read from last_update "
                                 "after each bucket; the disk path streams (no per-bucket stats)")
        self.res["d2d_copy_GBps"] = measure_d2d_copy() / GB
        say(f"d2d copy {self.res['d2d_copy_GBps']:.0f} GB/s (read + write)")

        t = time.time()
        sd = make_w1(config, "cuda")
        torch.cuda.synchronize()
        self.res["payload_gen_s"] = time.time() - t
        say(f"payload: {self.res['payload']['bytes'] / GB:.2f} GB on GPU in {self.res['payload_gen_s']:.1f} s")
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
                # equal shares of the time left for the engines still to run
                phase_end = time.time() + self.left() / (len(engines) - idx)
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model-dir", required=True, help="folder of dummy-weight models (scripts/gpu/make_models.py; "
                                                      "the --model folder is written there if missing)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b", choices=["qwen3-8b", "qwen3-small"])
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--deadline-s", type=float, default=530.0, help="whole-run budget in seconds (default 530)")
    p.add_argument("--repeats", type=int, default=2, help="timed pushes per engine, by tensor (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up pushes per engine, by tensor (default 1)")
    p.add_argument("--disk-repeats", type=int, default=2, help="timed disk updates per engine (default 2)")
    p.add_argument("--disk-warmup", type=int, default=0,
                   help="warm-up disk updates per engine (default 0: the tensor path already warmed the kernels)")
    p.add_argument("--skip-disk", action="store_true", help="no safetensors copy, no disk path")
    p.add_argument("--keep-tmp", action="store_true", help="keep OUT/tmp/w1 (the 16 GB checkpoint)")
    p.add_argument("--engines", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument("--mem", type=float, default=0.5, help="--mem-fraction-static of the servers (default 0.5)")
    p.add_argument("--port", type=int, default=30020)
    p.add_argument("--poll-ms", type=float, default=5.0, help="memory sampling period (default 5 ms)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_update.py needs a CUDA GPU (it launches SGLang servers and pushes CUDA IPC handles)",
              file=sys.stderr)
        return 2
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
