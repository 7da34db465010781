"""The GPU and server helpers of scripts/bench_update.py: the progress line, the engines' launch flags, device-wide
memory polling, the device-to-device copy bandwidth, launching and stopping one SGLang server, its fp8rl telemetry,
a short generation after the updates, the payload saved as safetensors for the disk path, and the validate-only
phase of an atomic step pushed by hand."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from update_bench_report import sum_bucket_stats

ENGINES = {"bf16": [], "fp8": ["--quantization", "fp8_online_blockwise"]}


def say(msg: str) -> None:
    """A timestamped progress line."""
    print(f"[bench_update {time.strftime('%H:%M:%S')}] {msg}", flush=True)


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


def push_one_bucket(url: str, bucket: dict, flatten: bool) -> None:
    """One bucket as its own request (``atomic=False``; flattened with ``flatten``), as the telemetry and profiled
    pushes send it: a flattened bucket carries no step-complete marker, which would travel in a request of its own
    and be what last_update reports."""
    from sglang_fp8rl.trainer import push_state_dict

    push_state_dict(url, bucket, bucket_bytes=1 << 62, atomic=False, complete=not flatten, flatten=flatten)


def validate_only_push(url: str, weights: dict, bucket_bytes: int) -> int:
    """The first phase of an atomic step alone: every bucket sent with load_format "fp8rl.validate" (the engine
    validates and writes nothing); returns the number of buckets. Raises WeightPushError on a refusal."""
    import requests

    from sglang_fp8rl.trainer import WeightPushError
    from sglang_fp8rl.weight_sync.buckets import buckets  # the client's bucketing, sent by hand
    from sglang_fp8rl.weight_sync.client import serialize_for_ranks
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
