"""The GPU version of ``python -m sglang_fp8rl.demo``: the stock SGLang server, one CUDA-IPC weight push.

The server is started with only what the demo needs, so that a cold start stays short: one decode batch size in
CUDA graphs (the demo decodes one sequence), no prefill graphs, no load-time GEMM measurement (the demo's GEMMs are
tiny; SGLang's own block-FP8 dispatch runs them), and one DeepGEMM JIT worker per linear shape. While it starts, the
demo prints what it is doing; at the end, how long each start-up phase took (from the server log's timestamps).
``--server-args ...`` (the rest of the command line) appends launch_server arguments (later ones win), e.g. to
compare ``--fp8rl-jit-workers 0``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from sglang_fp8rl.compat.runtime import decode_graph_flags
from sglang_fp8rl.demo_common import (
    DEMO_DIMS,
    NEW_TOKENS,
    PROMPT,
    SEED_AFTER,
    SEED_BEFORE,
    random_state_dict,
    report,
    say,
    work_dir,
    write_checkpoint,
)
from sglang_fp8rl.server_args import DEEPGEMM_PRECOMPILE_ENV, QUANTIZATION_NAME
from sglang_fp8rl.startup_phases import StartupWatcher, phase_table

DEMO_LINEAR_SHAPES = 4  # qkv, o_proj, gate_up, down: one DeepGEMM kernel each at the captured batch size
SERVER_FLAGS = [
    "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--grammar-backend", "none", "--dtype", "bfloat16", "--host", "127.0.0.1",
    "--fp8rl-gemm-select", "off",
    "--fp8rl-jit-workers", str(DEMO_LINEAR_SHAPES),
]
POLL_S = 1.0
PROGRESS_EVERY_S = 15.0  # a "still ..." line when the log shows no new phase for this long
READY_WHAT = "first /health_generate answered (the demo's clock)"
# the on-disk JIT caches a start reads (Triton, DeepGEMM, inductor, SGLang's tvm-ffi kernels): --fresh-caches points
# each at an empty folder, so that a start on a warm machine compiles what a cold machine compiles
FRESH_CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "SGLANG_DG_CACHE_DIR": "deep_gemm",
                    "TORCHINDUCTOR_CACHE_DIR": "inductor", "TVM_FFI_CACHE_DIR": "tvm_ffi"}


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time."""


def server_command(model_dir: str, port: int, mem: float, extra: list[str]) -> list[str]:
    """The stock launcher's command line for the demo model (CUDA-graph flags spelled for the installed SGLang)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port),
            "--quantization", QUANTIZATION_NAME, "--mem-fraction-static", str(mem), *SERVER_FLAGS,
            *decode_graph_flags(batch_sizes=[1]),  # the demo decodes one sequence: capture that batch size only
            *extra]


def fresh_cache_env(root: str) -> dict[str, str]:
    """Environment that points every JIT cache of a start at a new empty folder under ``root``."""
    env = {var: os.path.join(root, name) for var, name in FRESH_CACHE_VARS.items()}
    for path in env.values():
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    return env


def launch(cmd: list[str], log_path: str, extra_env: dict[str, str]) -> subprocess.Popen:
    """Start the server in its own process group, its output in ``log_path``."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
    env.setdefault(DEEPGEMM_PRECOMPILE_ENV, "0")
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """Terminate the server's process group (started by us)."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def tail(path: str, n: int = 25) -> str:
    """The last ``n`` lines of a log file."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def report_progress(watcher: StartupWatcher, last_said: float) -> float:
    """Print each new phase mark of the log, or a "still ..." line when none came for a while; when we last spoke."""
    now = time.time()
    for event in watcher.poll(now):
        i = watcher.events.index(event)
        took = event.at - (watcher.events[i - 1].at if i else 0.0)
        say(f"{event.at:4.0f} s  done: {event.mark.done} ({took:.0f} s); now: {event.mark.next}")
        last_said = now
    if now - last_said >= PROGRESS_EVERY_S:
        last = watcher.last_line[:110] if watcher.last_line else "(log still empty)"
        say(f"{now - watcher.launched_at:4.0f} s  still: {watcher.doing_now()}  | last log line: {last}")
        last_said = now
    return last_said


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, watcher: StartupWatcher) -> float:
    """Seconds from launch until /health_generate answers 200, with progress lines meanwhile."""
    import requests

    last_said = time.time()
    while time.time() - watcher.launched_at < timeout:
        last_said = report_progress(watcher, last_said)
        if proc.poll() is not None:
            raise ServerStartError(f"server exited with {proc.returncode}; last log lines:\n{tail(watcher.log_path)}")
        try:
            if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                watcher.poll()
                return time.time() - watcher.launched_at
        except requests.RequestException:
            pass
        time.sleep(POLL_S)
    raise ServerStartError(f"server not healthy after {timeout:.0f} s; last log lines:\n{tail(watcher.log_path)}")


def generate(url: str, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Greedy token ids from the server's /generate."""
    import requests

    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": n, "temperature": 0}}, timeout=120)
    r.raise_for_status()
    return r.json()["output_ids"]


def fp8rl_state(url: str) -> dict:
    """Our telemetry from /get_server_info (internal_states[0]["fp8rl"])."""
    import requests

    info = requests.get(url + "/get_server_info", timeout=30).json()
    return (info.get("internal_states") or [{}])[0].get("fp8rl") or {}


def fp8rl_log_lines(log_path: str) -> list[str]:
    """The server's [fp8rl] scheme-summary line(s)."""
    try:
        with open(log_path, errors="replace") as f:
            return [line for line in f if "[fp8rl]" in line and "linear layers" in line][:4]
    except OSError:
        return []


def print_timings(watcher: StartupWatcher, ready_s: float | None, steps: list[tuple[str, float]]) -> None:
    """The start-up phases (server log) and the demo's own steps."""
    print("\n== server start-up, by phase (from the server log's timestamps, whole seconds) ==")
    print(phase_table(watcher.events, ready_s, READY_WHAT))
    if steps:
        print("\n== demo steps after start-up ==\n" + "\n".join(f"{what}: {s * 1e3:.0f} ms" for what, s in steps))
    print(flush=True)


def run_gpu(args: argparse.Namespace) -> int:
    """Serve, generate, push W1 by CUDA IPC, generate again; 0 when the update was applied."""
    import requests
    import torch

    from sglang_fp8rl.trainer import WeightPushError, push_state_dict

    url = f"http://127.0.0.1:{args.port}"
    ok = False
    with work_dir(args.keep) as work:
        model_dir, log_path = os.path.join(work, "model"), os.path.join(work, "server.log")
        say(f"GPU version: writing a random Qwen3 ({DEMO_DIMS}) to {model_dir}")
        write_checkpoint(model_dir, DEMO_DIMS, seed=SEED_BEFORE)
        cmd = server_command(model_dir, args.port, args.mem, list(args.server_args))
        say("launch: " + " ".join(cmd[1:]))
        cache_env = fresh_cache_env(os.path.join(work, "caches")) if args.fresh_caches else {}
        if cache_env:
            say(f"fresh JIT caches under {os.path.join(work, 'caches')}")
        watcher = StartupWatcher(log_path)
        proc = launch(cmd, log_path, cache_env)
        ready_s, steps = None, []
        try:
            ready_s = wait_healthy(url, proc, args.timeout, watcher)
            kept = "" if args.keep else "; removed at the end, --keep DIR keeps it"
            say(f"server healthy after {ready_s:.0f} s (log: {log_path}{kept})")
            t = time.perf_counter()
            before = generate(url, PROMPT)
            steps.append(("generate before the update", time.perf_counter() - t))
            state_before = fp8rl_state(url)
            w1 = random_state_dict(DEMO_DIMS, seed=SEED_AFTER, device="cuda")
            t = time.perf_counter()
            answers = push_state_dict(url, w1, bucket_bytes=args.bucket_mb << 20)
            push_s = time.perf_counter() - t
            steps.append(("push W1 (CUDA IPC, validate, re-quantize in place)", push_s))
            t = time.perf_counter()
            after = generate(url, PROMPT)
            steps.append(("generate after the update", time.perf_counter() - t))
            pushed = f"pushed {len(w1)} tensors in {len(answers)} request(s) by CUDA IPC, {push_s * 1e3:.0f} ms wall"
            ok = report(before, after, state_before, fp8rl_state(url), pushed, fp8rl_log_lines(log_path))
            del w1
            torch.cuda.empty_cache()
        except (ServerStartError, WeightPushError, requests.RequestException) as e:
            say(f"FAILED: {e}")
        finally:
            stop(proc)
            print_timings(watcher, ready_s, steps)
    return 0 if ok else 1
