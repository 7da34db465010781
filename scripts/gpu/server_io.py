"""Servers and HTTP for scripts/gpu/check_server.py (and the other GPU scripts): the stock launcher, health, greedy
outputs with logprobs, the plugin's telemetry, raw update requests, and a thread that keeps generating.
"""
from __future__ import annotations

import functools
import glob
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

import requests

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400, 500, 600], [42] * 12]
NEW_TOKENS = 16
TRAFFIC_PROMPTS = [[7 * i + j for j in range(1, 10 + i)] for i in range(8)]  # 8 distinct prompts, one batch
TRAFFIC_TOKENS = 64
BASE_FLAGS = ["--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
              "--grammar-backend", "none", "--dtype", "bfloat16", "--host", "127.0.0.1"]
DECODE_GRAPH_MAX_BS = 8  # decode CUDA graphs up to 8 sequences (the traffic batch); no prefill graphs


@functools.cache
def common_flags() -> tuple[str, ...]:
    """The launch flags every server of these scripts gets, the CUDA-graph ones spelled for the installed SGLang."""
    from sglang_fp8rl.compat.runtime import decode_graph_flags

    return (*BASE_FLAGS, *decode_graph_flags(max_bs=DECODE_GRAPH_MAX_BS))


def __getattr__(name: str) -> Any:
    """``COMMON`` (a list of common_flags()), built on first use: the graph flags are read off SGLang's ServerArgs,
    an import of seconds that the scripts which only poll a server don't need."""
    if name == "COMMON":
        return list(common_flags())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def url(port: int) -> str:
    """The local server's base URL."""
    return f"http://127.0.0.1:{port}"


def launch(model: str, port: int, log: str, *extra: str, mem: float = 0.3, env_extra: Optional[dict] = None,
           quantization: Optional[str] = "fp8_online_blockwise") -> subprocess.Popen:
    """The stock launcher, in its own process group; the plugin arrives through SGLang's entry-point loader.
    ``quantization=None``: a BF16 server (no --quantization), for a comparison."""
    # PYTHONFAULTHANDLER: every process of the server prints its Python stacks on SIGABRT (dump_stacks)
    env = dict(os.environ, SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST=log + ".kapi_%i.log",
               SGLANG_JIT_DEEPGEMM_PRECOMPILE="0", PYTHONFAULTHANDLER="1", **(env_extra or {}))
    quant = ["--quantization", quantization] if quantization else []
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port), *quant,
           "--mem-fraction-static", str(mem), *common_flags(), *extra]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 420) -> float:
    """Seconds until /health_generate answers 200; raises if the server exits or times out (after dump_stacks)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server on {port} exited with {proc.returncode}")
        try:
            if requests.get(url(port) + "/health_generate", timeout=5).status_code == 200:
                return time.time() - t0
        except requests.RequestException:
            pass
        time.sleep(2)
    dumped = dump_stacks(proc)
    raise TimeoutError(f"server on {port} not healthy after {timeout} s (stacks of {dumped} processes in its log)")


def dump_stacks(proc: Any, settle_s: float = 5.0) -> int:
    """Make every Python process below a server that hangs print its stacks into the server's log (SIGABRT, which
    PYTHONFAULTHANDLER turns into a traceback of every thread), so that a start that never ends says where it waits.
    Returns how many processes were signalled."""
    import psutil

    pids = []
    for node in getattr(proc, "procs", None) or [proc]:
        try:
            pids += [c.pid for c in psutil.Process(node.pid).children(recursive=True)]
        except psutil.Error:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGABRT)
        except OSError:
            pass
    time.sleep(settle_s if pids else 0)
    return len(pids)


def stop(proc: Any, grace_s: float = 60.0) -> None:
    """Terminate a server's process group (TP ranks included); SIGKILL what is left after ``grace_s``. A server of
    several launcher processes (scale_out.Server: two 'nodes' on this host) is stopped node by node."""
    if proc is None:
        return
    for node in getattr(proc, "procs", None) or [proc]:
        _stop_one(node, grace_s)


def _stop_one(proc: subprocess.Popen, grace_s: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived the launcher
    except ProcessLookupError:
        pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:  # a process stuck in the kernel (a GPU reset): leave it, say so
        print(f"[server_io] server {proc.pid} still there 30 s after SIGKILL", flush=True)


def flush_cache(port: int, wait_s: float = 60) -> None:
    """Empty the radix cache once the server is idle; RuntimeError when it does not."""
    r = requests.post(url(port) + "/flush_cache", params={"timeout": wait_s}, timeout=wait_s + 30)
    if r.status_code != 200:
        raise RuntimeError(f"/flush_cache answered HTTP {r.status_code}: {r.text[:200]}")


# DP attention: the servers on these ports have this many DP ranks, each with its own copy of the attention weights
DP_RANKS: dict[int, int] = {}


def route_every_dp_rank(port: int, dp_size: int) -> None:
    """Make generate() ask every one of the server's ``dp_size`` DP ranks for each prompt (SGLang's routed_dp_rank),
    so that an output comparison covers the weights of every DP group, each served the same way in both servers."""
    DP_RANKS[port] = dp_size


def generate(port: int, prompts: list[list[int]] = PROMPTS) -> list[dict]:
    """Greedy NEW_TOKENS tokens per prompt, one request each, with their logprobs, each from an empty radix cache:
    a prompt served from cached prefixes takes other kernel shapes, so its logprobs differ in the last bits. Under DP
    attention (route_every_dp_rank) each prompt once per DP rank, in rank order."""
    out = []
    ranks = range(DP_RANKS[port]) if DP_RANKS.get(port, 1) > 1 else [None]
    for ids in prompts:
        for rank in ranks:
            flush_cache(port)
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
                    "return_logprob": True}
            if rank is not None:
                body["routed_dp_rank"] = rank
            r = requests.post(url(port) + "/generate", json=body, timeout=120).json()
            out.append({"ids": r["output_ids"], "logprobs": [x[0] for x in r["meta_info"]["output_token_logprobs"]]})
    return out


def fp8rl_info(port: int) -> dict:
    """/get_server_info → internal_states[0]["fp8rl"]; with several DP ranks (one state each), that of DP rank 0 with
    ``consistent`` true only if every rank's is and ``fp8_param_ptr_digest`` the tuple of every rank's digest."""
    info = requests.get(url(port) + "/get_server_info", timeout=30).json()
    return merged_dp_states(info.get("internal_states") or [{}])


def merged_dp_states(states: list[dict]) -> dict:
    """The plugin's telemetry of several DP ranks as one record (see fp8rl_info). SGLang gathers the DP ranks' states
    in the order they answer, not in rank order, so the digests are compared as a sorted tuple: unchanged iff every
    rank's own digest is (two ranks never trade pointers)."""
    infos = [s.get("fp8rl") or {} for s in states]
    if len(infos) <= 1:
        return infos[0] if infos else {}
    merged = dict(infos[0])
    consistent = [i.get("consistent") for i in infos]
    merged["consistent"] = None if None in consistent else all(consistent)
    merged["fp8_param_ptr_digest"] = tuple(sorted(str(i.get("fp8_param_ptr_digest")) for i in infos))
    merged["dp_ranks"] = len(infos)
    return merged


def alive(port: int) -> bool:
    """/health_generate answers 200."""
    try:
        return requests.get(url(port) + "/health_generate", timeout=30).status_code == 200
    except requests.RequestException:
        return False


def answer_of(status: int, text: str, parsed: Any) -> dict:
    """An update route's answer {"success", "message", ...} with its HTTP status; ValueError for anything else."""
    if not isinstance(parsed, dict) or "success" not in parsed:
        raise ValueError(f"HTTP {status}: {text[:300]}")
    return dict(parsed, http_status=status)


def post(port: int, route: str, body: dict, timeout: float = 600) -> dict:
    """POST an update as built (no client-side checks): the engine's answer (HTTP 400 on refusal)."""
    r = requests.post(url(port) + route, json=body, timeout=timeout)
    try:
        parsed = r.json()
    except ValueError:
        parsed = None
    return answer_of(r.status_code, r.text, parsed)


def push_by_tensor(port: int, sd: Any, bucket_bytes: int = 512 << 20, atomic: bool = True) -> list:
    """CUDA IPC push through the package's client; raises WeightPushError on a refusal."""
    from sglang_fp8rl.trainer import push_state_dict

    return push_state_dict(url(port), sd, bucket_bytes=bucket_bytes, atomic=atomic)


def sequence_errors(result: Any, new_tokens: int) -> list[str]:
    """What is wrong with a batch /generate answer: not a list, an aborted sequence, a short one."""
    if not isinstance(result, list):
        return [f"not a batch answer: {str(result)[:200]}"]
    errors = []
    for i, seq in enumerate(result):
        finish = (seq.get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") != "length" or len(seq.get("output_ids") or []) != new_tokens:
            errors.append(f"sequence {i}: finish {finish}, {len(seq.get('output_ids') or [])} tokens")
    return errors


class Traffic:
    """A thread that keeps sending one batch request (TRAFFIC_PROMPTS, TRAFFIC_TOKENS tokens each, ignore_eos)."""

    def __init__(self, port: int):
        self.port = port
        self.done: list[float] = []  # completion times of good requests
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        body = {"input_ids": TRAFFIC_PROMPTS, "sampling_params": {
            "max_new_tokens": TRAFFIC_TOKENS, "temperature": 0, "ignore_eos": True}}
        while not self._stop.is_set():
            try:
                r = requests.post(url(self.port) + "/generate", json=body, timeout=300)
                errors = [f"HTTP {r.status_code}: {r.text[:200]}"] if r.status_code != 200 else \
                    sequence_errors(r.json(), TRAFFIC_TOKENS)
            except (requests.RequestException, ValueError) as e:
                errors = [f"{type(e).__name__}: {e}"]
            if errors:
                self.errors.extend(errors)
            else:
                self.done.append(time.time())

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(330)

    def completed_between(self, t0: float, t1: float) -> int:
        """Good requests that finished inside [t0, t1]."""
        return sum(t0 <= t <= t1 for t in self.done)


def settled_file(pattern: str, timeout_s: float, settle_s: float = 10.0,
                 done: Optional[Callable[[], bool]] = None) -> Optional[str]:
    """The newest file matching ``pattern`` once ``done()`` says so or its size has held for settle_s; None after
    timeout_s (a profiler's trace, written some time after the request that ends it)."""
    end, last, since = time.time() + timeout_s, None, time.time()
    while time.time() < end:
        files = sorted(glob.glob(pattern), key=os.path.getmtime)
        if files:
            size = os.path.getsize(files[-1])
            since = since if size == last else time.time()
            last = size
            if (done is not None and done()) or time.time() - since >= settle_s:
                return files[-1]
        time.sleep(0.5)
    return None
