"""The checks of scripts/gpu/check_server.py, in order, against server A (see that script's docstring).

Server A holds W0 (dummy), then W1. Every refusal is followed by the same observation (alive, consistent, outputs,
FP8 pointers); the reference outputs are W1's while no accepted update changes them.
"""
from __future__ import annotations

import subprocess
import time
from typing import Any, Callable, Optional

from server_io import Traffic, alive, fp8rl_info, generate, post, push_by_tensor, stop, url, wait_healthy
from server_payloads import (
    BadUpdate,
    Payloads,
    bad_updates,
    bucket_body,
    buckets_of,
    disk_body,
    tensor_body,
)
from server_report import Check, check, max_logprob_diff, not_run, refusal, same_outputs

from sglang_fp8rl.trainer import WeightPushError

TENSOR, DISK = "/update_weights_from_tensor", "/update_weights_from_disk"
BUCKET_BYTES = 512 << 20
LIVE_PUSHES = 9
LIVE_GAP_S = 0.3  # between pushes during generation, so that requests run in between


class Run:
    """Server A between checks: its port, TP size, pointer digest, reference outputs, and the check records."""

    def __init__(self, args: Any, report: dict, write: Callable[[dict, list], Any]):
        self.args, self.report, self._write = args, report, write
        self.port, self.tp = args.port, args.tp_size
        self.checks: list[Check] = []
        self.digest: Any = None
        self.ref: Optional[list[dict]] = None  # what A must answer while no update changes it

    def add(self, c: Check) -> Check:
        """Record a check, print its line, rewrite the report."""
        self.checks.append(c)
        print(f"[check_server {time.strftime('%H:%M:%S')}] {c.verdict} {c.name}: {c.why[:200]}", flush=True)
        self._write(self.report, self.checks)
        return c

    def observe(self) -> tuple[bool, Optional[list[dict]], dict]:
        """(alive, outputs, fp8rl telemetry) of server A now; (False, None, {}) when it does not answer."""
        if not alive(self.port):
            return False, None, {}
        try:
            return True, generate(self.port), fp8rl_info(self.port)
        except (OSError, ValueError, KeyError, RuntimeError):  # OSError: requests; KeyError: an error answer
            return False, None, {}

    def refuse(self, name: str, send: Callable[[], dict], says: tuple[str, ...], **data: Any) -> Check:
        """Send a bad update; check the refusal and what follows it (server_report.refusal)."""
        answer, error = None, None
        t0 = time.perf_counter()
        try:
            answer = send()
        except (OSError, ValueError, RuntimeError) as e:  # requests' errors are OSErrors: the server may have died
            error = f"{type(e).__name__}: {e}"
        seconds = round(time.perf_counter() - t0, 3)
        ok, outputs, info = self.observe()
        diff = max_logprob_diff(outputs, self.ref) if outputs is not None else None
        return self.add(refusal(name, answer, error, says, ok, same_outputs(outputs, self.ref),
                                info.get("fp8_param_ptr_digest") == self.digest, info.get("consistent"),
                                seconds=seconds, http_status=(answer or {}).get("http_status"),
                                max_logprob_diff=diff, **data))

    def push(self, weights: Any, atomic: bool = True, bucket_bytes: int = BUCKET_BYTES) -> tuple[bool, str, float]:
        """(success, message, seconds) of a client push by tensor."""
        t0 = time.perf_counter()
        try:
            answers = push_by_tensor(self.port, weights, bucket_bytes=bucket_bytes, atomic=atomic)
            return True, f"{len(answers)} requests answered success", time.perf_counter() - t0
        except WeightPushError as e:
            return False, str(e), time.perf_counter() - t0


def client_step(run: Run, weights: Any, bucket_bytes: int) -> dict:
    """An atomic step through the client, as an answer dict (the client raises on a refusal)."""
    ok, message, _ = run.push(weights, atomic=True, bucket_bytes=bucket_bytes)
    return {"success": ok, "message": message}


def send_bad(run: Run, bad: BadUpdate) -> dict:
    """A bad update as built: raw HTTP (no client-side checks), or the client's atomic step."""
    if bad.kind == "tensor":
        return post(run.port, TENSOR, tensor_body(bad.content, run.tp, bad.load_format))
    if bad.kind == "bucket":
        return post(run.port, TENSOR, bucket_body(bad.content, run.tp))
    if bad.kind == "disk":
        return post(run.port, DISK, disk_body(bad.content))
    return client_step(run, bad.content, bad.data["bucket_bytes"])


def refusals(run: Run, p: Payloads) -> None:
    """Every bad update on server A (holding W1): refused, and nothing changes."""
    for bad in bad_updates(p):
        run.refuse(bad.name, lambda bad=bad: send_bad(run, bad), bad.says,
                   **(dict(bad.data, path=bad.content) if bad.kind == "disk" else bad.data))


def cold_reference(run: Run, b: subprocess.Popen, timeout: float) -> Optional[list[dict]]:
    """Server B's outputs (cold start from W1 on disk) and the check that the W1 tensor push equals them."""
    port_b = run.port + 1
    try:
        run.report.setdefault("startup_s", {})["b_cold_w1"] = round(wait_healthy(port_b, b, timeout), 1)
        cold = generate(port_b)
    except (OSError, ValueError, RuntimeError, TimeoutError) as e:
        run.add(check("tensor_push_equals_cold_start", [(False, f"cold W1 server served ({e})")]))
        return None
    finally:
        stop(b)
    run.add(check("tensor_push_equals_cold_start", [
        (same_outputs(run.ref, cold), "tokens and logprobs bit-identical to the cold W1 start")],
        max_logprob_diff=max_logprob_diff(run.ref, cold)))
    return cold


def disk_update(run: Run, p: Payloads, w1_ref: list[dict]) -> list[dict]:
    """W2 by tensor (outputs change), then W1 from disk: equal to the cold W1 start, pointers unchanged."""
    ok2, msg2, _ = run.push(p.w2)
    out_w2 = generate(run.port)
    t0 = time.perf_counter()
    answer = post(run.port, DISK, disk_body(p.folders["w1"]))
    seconds = round(time.perf_counter() - t0, 3)
    _, outputs, info = run.observe()
    run.add(check("disk_update_w1", [
        (ok2, "W2 pushed by tensor"), (not same_outputs(out_w2, w1_ref), "W2 outputs differ from W1's"),
        (answer.get("success") is True, "disk update answered success"),
        (same_outputs(outputs, w1_ref), "outputs equal the cold W1 start"),
        (info.get("fp8_param_ptr_digest") == run.digest, "FP8 pointers unchanged")],
        answer.get("message", "") or msg2, seconds=seconds, last_update=info.get("last_update")))
    return out_w2


def prequant_transports(run: Run, p: Payloads, out_w2: list[dict]) -> None:
    """Pre-quantized W1 by tensor, by flattened bucket, from disk, each onto W2: bit-identical outputs."""
    def by_bucket() -> tuple[bool, str]:
        bodies = buckets_of(p.prequant, BUCKET_BYTES)
        for i, bucket in enumerate(bodies):
            answer = post(run.port, TENSOR, bucket_body(bucket, run.tp, flush_cache=i == len(bodies) - 1))
            if not answer.get("success"):
                return False, answer.get("message", "")
        return True, f"{len(bodies)} flattened buckets answered success"

    def by_disk() -> tuple[bool, str]:
        answer = post(run.port, DISK, disk_body(p.folders["prequant"]))
        return bool(answer.get("success")), answer.get("message", "")

    sends = {"by_tensor": lambda: run.push(p.prequant, atomic=False)[:2], "by_bucket": by_bucket, "from_disk": by_disk}
    outputs: dict[str, Optional[list[dict]]] = {}
    for name, send in sends.items():
        reset_ok, reset_msg, _ = run.push(p.w2)
        reset_same = same_outputs(generate(run.port), out_w2)
        t0 = time.perf_counter()
        ok, message = send()
        seconds = round(time.perf_counter() - t0, 3)
        _, outputs[name], info = run.observe()
        run.add(check(f"prequant_{name}", [
            (reset_ok and reset_same, "reset to W2 first (outputs equal W2's)"), (ok, "answered success"),
            (outputs[name] is not None and not same_outputs(outputs[name], out_w2), "outputs changed from W2"),
            (info.get("fp8_param_ptr_digest") == run.digest, "FP8 pointers unchanged")],
            message if ok else message or reset_msg, seconds=seconds, last_update=info.get("last_update")))
    first = outputs["by_tensor"]
    run.add(check("prequant_transport_equivalence", [
        (all(same_outputs(first, o) for o in outputs.values()), "by tensor = by bucket = from disk, bit for bit")],
        max_logprob_diff={k: max_logprob_diff(first, o) if first and o else None for k, o in outputs.items()}))


def live_updates(run: Run, p: Payloads, w1_ref: list[dict]) -> None:
    """LIVE_PUSHES pushes (W1, W2, ..., W1) while a thread keeps generating; then the outputs equal W1's."""
    results = []
    with Traffic(run.port) as traffic:
        time.sleep(1.0)  # the first batch is running
        t0 = time.time()
        for i in range(LIVE_PUSHES):
            ok, message, seconds = run.push(p.w1 if i % 2 == 0 else p.w2)
            results.append({"weights": "W1" if i % 2 == 0 else "W2", "ok": ok, "s": round(seconds, 3),
                            "message": message[:200]})
            time.sleep(LIVE_GAP_S)
        t1 = time.time()
    overlapped = traffic.completed_between(t0, t1)
    _, outputs, info = run.observe()
    run.add(check("updates_during_generation", [
        (all(r["ok"] for r in results), f"all {LIVE_PUSHES} pushes succeeded"),
        (not traffic.errors, "no generation request failed"),
        (overlapped > 0, "requests completed while the pushes ran"),
        (same_outputs(outputs, w1_ref), "outputs after the last push (W1) equal the cold W1 start"),
        (info.get("consistent") is True, "engine consistent")],
        "; ".join(traffic.errors[:3]), pushes=results, requests_completed=len(traffic.done),
        requests_during_pushes=overlapped, request_errors=len(traffic.errors)))


def run_all(run: Run, a: subprocess.Popen, p: Payloads, launch_cold: Callable[[], subprocess.Popen],
            timeout: float) -> Optional[subprocess.Popen]:
    """Every check on server A, in order; returns server B (stopped) so the caller can make sure."""
    run.report["startup_s"] = {"a_dummy_w0": round(wait_healthy(run.port, a, timeout), 1)}
    out_w0 = generate(run.port)
    info0 = fp8rl_info(run.port)
    run.digest, run.report["schemes"] = info0.get("fp8_param_ptr_digest"), info0.get("schemes")
    ok, message, seconds = run.push(p.w1)
    run.ref = generate(run.port)
    info1 = fp8rl_info(run.port)
    run.add(check("tensor_push_w1", [
        (ok, "every request answered success"), (info1.get("fp8_param_ptr_digest") == run.digest,
                                                 "FP8 pointers unchanged"),
        (not same_outputs(run.ref, out_w0), "outputs changed from W0")],
        message, seconds=round(seconds, 3), url=url(run.port), last_update=info1.get("last_update")))
    b = launch_cold()  # starts while A runs the refusals
    refusals(run, p)
    cold = cold_reference(run, b, timeout)
    w1_ref = cold if cold is not None else run.ref
    out_w2 = guarded(run, "disk_update_w1", lambda: disk_update(run, p, w1_ref))
    if out_w2 is None:
        run.add(not_run("prequant_transports", "no W2 reference (disk_update_w1 did not finish)"))
    else:
        guarded(run, "prequant_transports", lambda: prequant_transports(run, p, out_w2))
    guarded(run, "updates_during_generation", lambda: live_updates(run, p, w1_ref))
    return b


def guarded(run: Run, name: str, section: Callable[[], Any]) -> Any:
    """Run one section of checks; an error that stops it (the server died, an error answer) is that section's FAIL,
    and the next section still runs."""
    try:
        return section()
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # requests' errors are OSErrors
        run.add(not_run(name, f"{type(e).__name__}: {e}"))
        return None
