"""The verdicts of scripts/gpu/check_colocated.py, from what a pass recorded (no GPU, no server: tested in
tests/test_check_colocated_cpu.py on a recorded file)."""
from __future__ import annotations

from typing import Any, Optional

from server_report import Check, check, max_logprob_diff, not_run, same_outputs, says_all

PASSES = {"no_backup": (), "backup": ("--enable-weights-cpu-backup",)}  # the extra launch flags of each pass
RELEASED = ["kv_cache", "weights"]  # what verl releases after its rollout (sorted: as the engine reports them)


def kv(info: Optional[dict], key: str) -> Any:
    """A field of the engine's KV-scale telemetry (None when absent)."""
    return ((info or {}).get("kv_scales") or {}).get(key)


def answered(step: Optional[dict]) -> bool:
    """A release or resume answered HTTP 200."""
    return (step or {}).get("status") == 200


def differing_checksums(a: Optional[dict], b: Optional[dict]) -> Optional[list[str]]:
    """Names (rank/name) whose checksums differ or exist on one side only; None when either side has none."""
    if not a or not b:
        return None
    names = []
    for rank in sorted(set(a) | set(b)):
        x, y = a.get(rank) or {}, b.get(rank) or {}
        names += [f"{rank}/{n}" for n in sorted(set(x) | set(y)) if x.get(n) != y.get(n)]
    return names


def refused_generation(answer: Optional[dict]) -> bool:
    """A generation answered as aborted (HTTP error, or an abort finish reason), not served."""
    answer = answer or {}
    return answer.get("status") is not None and (answer["status"] >= 400 or "abort" in answer.get("text", "").lower())


def pass_checks(name: str, obs: dict, cold: dict) -> list[Check]:
    """Every check of one pass (check_colocated.py's docstring), named ``<pass>.<check>``."""
    if "info_start" not in obs:
        return [not_run(f"{name}.cycle", obs.get("error", "server A did not start"))]
    backup = name == "backup"
    start, released, refused = obs["info_start"], obs.get("info_released"), obs.get("info_refused")
    resumed, pushed, end = obs.get("info_resumed"), obs.get("info_pushed"), obs.get("info_end")
    digest = start.get("fp8_param_ptr_digest")
    push_released, push_w1 = obs.get("push_released") or {}, obs.get("push_w1") or {}
    checks = [
        check(f"{name}.release", [
            (answered(obs.get("release")), "/release_memory_occupation answered 200"),
            ((released or {}).get("released") == RELEASED, f"the engine reports {RELEASED} released"),
            ((released or {}).get("consistent") is True, "engine consistent")], (obs.get("release") or {}).get("text")),
        check(f"{name}.push_refused_while_released", [
            (push_released.get("ok") is False, "the push refused"),
            (says_all(push_released.get("message", ""), ["released", "/resume_memory_occupation"]),
             "the message says the weights are released and to resume them"),
            ((refused or {}).get("consistent") is True, "engine still consistent (nothing written)"),
            ((refused or {}).get("fp8_param_ptr_digest") == digest, "FP8 pointers unchanged")],
            push_released.get("message", "")),
        check(f"{name}.generate_refused_while_released", [
            (refused_generation(obs.get("generate_released")), "answered as aborted, not served")],
            (obs.get("generate_released") or {}).get("text", "")),
        check(f"{name}.resume_weights", [
            (answered(obs.get("resume_weights")), "/resume_memory_occupation (weights) answered 200"),
            ((resumed or {}).get("released") == ["kv_cache"], "only the KV cache still released"),
            ((resumed or {}).get("consistent") is backup,
             "consistent (the CPU backup restored the bytes)" if backup else
             "inconsistent (the bytes are lost: nothing may be served until a full push)"),
            (backup or says_all((resumed or {}).get("inconsistent_reason", ""), ["CPU backup"]),
             "the reason names the missing CPU backup")], (resumed or {}).get("inconsistent_reason", "")),
        check(f"{name}.push_w1", [
            (push_w1.get("ok") is True, "W1 pushed by tensor, cache flushed"),
            ((pushed or {}).get("consistent") is True, "engine consistent (every parameter rewritten)"),
            (kv(pushed, "due") is True, "a KV recalibration due"),
            (kv(pushed, "writes") == kv(resumed, "writes"), "and waiting: the KV cache is still released")],
            push_w1.get("message", ""), seconds=push_w1.get("seconds")),
        check(f"{name}.resume_kv", [
            (answered(obs.get("resume_kv")), "/resume_memory_occupation (kv_cache) answered 200"),
            ((end or {}).get("released") == [], "nothing released"),
            (kv(end, "due") is False and (kv(end, "writes") or 0) > (kv(pushed, "writes") or 0),
             "the KV scales recalibrated on the resume"),
            ((end or {}).get("consistent") is True, "engine consistent"),
            (((end or {}).get("step") or {}).get("phase") == "idle", "no step left open"),
            (obs.get("alive_end") is True, "/health_generate 200")]),
        check(f"{name}.fp8_pointers_unchanged", [
            ((end or {}).get("fp8_param_ptr_digest") == digest and digest is not None,
             "the FP8 parameters' pointer digest is the start's (captured graphs stay valid)")]),
    ]
    return checks + against_cold(name, obs, end, cold)


def against_cold(name: str, obs: dict, end: Optional[dict], cold: dict) -> list[Check]:
    """The pass's end state against the cold W1 start."""
    if "outputs" not in cold:
        return [not_run(f"{name}.equals_cold_start", cold.get("error", "the cold W1 server did not run"))]
    differ = differing_checksums(obs.get("checksums_end"), cold.get("checksums"))
    outputs = obs.get("outputs_end")
    tokens_same = outputs is not None and [o["ids"] for o in outputs] == [o["ids"] for o in cold["outputs"]]
    return [
        check(f"{name}.params_equal_cold_start", [
            (differ is not None, "/weights_checker checksums on both servers"),
            (differ == [], "every parameter and buffer bit-identical")], ", ".join((differ or [])[:5]),
            checksummed=sum(len(r or {}) for r in (obs.get("checksums_end") or {}).values())),
        check(f"{name}.kv_scales_equal_cold_start", [
            (kv(end, "scales") is not None and kv(end, "scales") == kv(cold.get("info"), "scales"),
             "the recalibrated KV scales equal the cold start's calibration")]),
        check(f"{name}.outputs_equal_cold_start", [
            (tokens_same, "greedy tokens equal"),
            (same_outputs(outputs, cold["outputs"]), "and their logprobs, bit for bit")],
            max_logprob_diff=max_logprob_diff(outputs, cold["outputs"]) if tokens_same else None),
    ]
