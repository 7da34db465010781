#!/usr/bin/env python3
"""GPU proof that recalibrated FP8 KV scales take effect in place, CUDA graphs included (issue: FP8 KV cache).

Per attention backend (triton, flashinfer), stock `python -m sglang.launch_server ... --quantization
fp8_online_blockwise --kv-cache-dtype fp8_e4m3` (scales calibrated on the engine), greedy `return_logprob` outputs:

  1. server A on W0 (random weights written to disk): outputs O0, KV scales S0;
  2. push W1 = W0 with a function-preserving drift (v_proj x C, o_proj / C, C a power of two, every layer) WITHOUT
     the step-complete marker: the V scales stay S0 and V saturates in the FP8 cache -> outputs A_stale;
  3. `recalibrate_kv_scales(A)`: scales S1 (V scales x C exactly) -> outputs A_new;
  4. server B freshly started on W1 from disk: its load-time scales must equal S1, its outputs B. B takes the block-FP8
     GEMM kernels A measured at its start (--fp8rl-gemm-select cache): a selection measured anew could pick another
     kernel for some batch size, and another kernel rounds differently, which is not what this check is about.
  Checks: A_new == B bit for bit (token ids and every logprob); A_stale != B; A_new == O0 (the drift preserves the
  function exactly: every factor is a power of two); the FP8 parameter pointer digest of A never changed; A's decode
  CUDA graphs were captured once (no re-capture).

--diagnose adds, for finding where a failing backend's difference comes from (not part of the verdict):
  5. on A, one layer's K scale (then its V scale) sent by the trainer x64 and back: do the outputs move with the
     scale (does the written scale reach the kernels) and come back (A_back == A_new)?
  6. a second fresh server B2 on W1 (B2 == B: is a fresh start repeatable?) and a fresh server C on W0 (C == O0).

usage: python3 scripts/gpu/check_kv.py --out OUT [--backends triton flashinfer] [--drift 256] [--diagnose]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import requests
from server_io import fp8rl_info, generate, launch, stop, wait_healthy
from server_payloads import make_w1
from server_report import same_outputs

from sglang_fp8rl.kv_scales.decode_fold import ALLOW_UNVERIFIED_ENV

KV_FLAGS = ("--kv-cache-dtype", "fp8_e4m3", "--disable-radix-cache")
SAME_GEMMS = ("--fp8rl-gemm-select", "cache")  # fresh servers use the GEMM kernels server A measured (step 4)
CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=4096,
              max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
              torch_dtype="bfloat16", hidden_act="silu", attention_bias=False)


def write_model(path: str, sd: dict) -> None:
    """config.json, model.safetensors and a small tokenizer (the KV calibration batch goes through it)."""
    from safetensors.torch import save_file

    from sglang_fp8rl.demo_common import write_tokenizer

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    write_tokenizer(path, CONFIG["vocab_size"])


def drifted(sd: dict, c: float) -> dict:
    """v_proj x c and o_proj / c in every layer: V grows c-fold, the model's function does not change."""
    out = dict(sd)
    for name in sd:
        if name.endswith("self_attn.v_proj.weight"):
            out[name] = sd[name] * c
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = sd[name] / c
    return out


def kv_scales(port: int) -> dict:
    return fp8rl_info(port).get("kv_scales", {})


def scale_probe(port: int, layer: str, scales: dict, baseline: list) -> dict:
    """Step 5: one layer's K, then V scale x64 and back, by trainer-sent scales; which of them move the outputs."""
    import torch

    from sglang_fp8rl.trainer import push_state_dict

    url, found = f"http://127.0.0.1:{port}", {}
    k, v = scales[layer]
    for which, value in (("k", k), ("v", v)):
        name = f"model.layers.{layer}.self_attn.{which}_scale"
        push_state_dict(url, {name: torch.tensor(value * 64.0)}, complete=False)
        found[f"{which}_scale_x64_moves_outputs"] = not same_outputs(generate(port), baseline)
        push_state_dict(url, {name: torch.tensor(value)}, complete=False)
    found["restored_equals_recalibrated"] = same_outputs(generate(port), baseline)
    found["probe_layer"] = layer
    return found


def fresh_server(model: str, port: int, log: str, flags: tuple, env_extra: dict) -> tuple[float, list, dict]:
    """A server freshly started on ``model`` (server A's GEMM selection): its start-up seconds, greedy outputs and
    KV scales."""
    proc = launch(model, port, log, *flags, *SAME_GEMMS, mem=0.35, env_extra=env_extra)
    try:
        return wait_healthy(port, proc), generate(port), kv_scales(port)
    finally:
        stop(proc)


def check_backend(backend: str, out: str, w0: str, w1: str, sd1: dict, port: int, kv_write: str = "sglang",
                  diagnose: bool = False) -> dict:
    from sglang_fp8rl.trainer import push_state_dict, recalibrate_kv_scales

    # a backend not verified yet needs the verification switch to calibrate (this check is that verification)
    env_extra = {"SGLANG_FLASHINFER_USE_PAGED": "1"} if backend == "flashinfer" else {}
    env_extra[ALLOW_UNVERIFIED_ENV] = "1"
    flags = (*KV_FLAGS, "--attention-backend", backend, "--fp8rl-kv-write", kv_write)
    r: dict = {"backend": backend if kv_write == "sglang" else f"{backend} (--fp8rl-kv-write {kv_write})"}
    log_a, log_b = (os.path.join(out, f"kv_{backend}_{kv_write}_{which}.log") for which in "ab")
    a = launch(w0, port, log_a, *flags, mem=0.35, env_extra=env_extra)
    try:
        r["a_startup_s"] = wait_healthy(port, a)
        o0, s0 = generate(port), kv_scales(port)
        digest = fp8rl_info(port).get("fp8_param_ptr_digest")
        t0 = time.time()
        push_state_dict(f"http://127.0.0.1:{port}", sd1, complete=False)  # no marker: scales stay
        r["push_s"] = time.time() - t0
        a_stale, s_stale = generate(port), kv_scales(port)
        t0 = time.time()
        recalibrate_kv_scales(f"http://127.0.0.1:{port}")
        r["recalibrate_request_s"] = time.time() - t0
        a_new, s1 = generate(port), kv_scales(port)
        r["digest_unchanged"] = fp8rl_info(port).get("fp8_param_ptr_digest") == digest
        r["scales_s0"], r["scales_s1"] = s0.get("scales"), s1.get("scales")
        r["stale_kept_s0"] = s_stale.get("scales") == s0.get("scales")
        r["recalibration_ms"] = 1e3 * s1.get("seconds", float("nan"))
        r["changed_layers"] = s1.get("changed_layers")
        if diagnose and s1.get("scales"):  # the probe moves the last layer's scales
            r["diagnosis"] = scale_probe(port, max(s1["scales"], key=int), s1["scales"], a_new)
    finally:
        stop(a)
    with open(log_a, errors="replace") as f:
        r["a_capture_lines"] = sum("Capture cuda graph end" in line or "Capture decode" in line for line in f)
    r["b_startup_s"], out_b, sb = fresh_server(w1, port + 1, log_b, flags, env_extra)
    if "diagnosis" in r:
        log_b2, log_c = (os.path.join(out, f"kv_{backend}_{kv_write}_{which}.log") for which in ("b2", "c"))
        _, out_b2, _ = fresh_server(w1, port + 2, log_b2, flags, env_extra)
        _, out_c, _ = fresh_server(w0, port + 3, log_c, flags, env_extra)
        r["diagnosis"]["fresh_repeatable"] = same_outputs(out_b2, out_b)
        r["diagnosis"]["fresh_w0_equals_o0"] = same_outputs(out_c, o0)
    r["b_scales_equal_s1"] = sb.get("scales") == r["scales_s1"]
    r["recalibrated_equals_fresh"] = same_outputs(a_new, out_b)
    r["stale_differs_from_fresh"] = not same_outputs(a_stale, out_b)
    r["drift_preserves_outputs"] = same_outputs(a_new, o0)
    r["verdict"] = "PASS" if all(r[k] for k in ("b_scales_equal_s1", "recalibrated_equals_fresh",
                                               "stale_differs_from_fresh", "digest_unchanged",
                                               "stale_kept_s0")) else "FAIL"
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backends", nargs="+", default=["triton", "flashinfer"])
    ap.add_argument("--drift", type=float, default=256.0, help="C, a power of two")
    ap.add_argument("--port", type=int, default=30040)
    ap.add_argument("--kv-writes", nargs="+", default=["sglang", "fused"], choices=["sglang", "fused"],
                    help="--fp8rl-kv-write values to check on each backend")
    ap.add_argument("--diagnose", action="store_true", help="steps 5 and 6 of the docstring (not in the verdict)")
    ap.add_argument("--runs", nargs="+", default=None, metavar="BACKEND:WRITE",
                    help="explicit (backend, write) pairs, e.g. triton:fused flashinfer:sglang (instead of all pairs)")
    args = ap.parse_args()
    import torch

    os.makedirs(args.out, exist_ok=True)
    sd0 = {k: v for k, v in make_w1(CONFIG, "cuda").items()}
    sd1 = drifted(sd0, args.drift)
    w0, w1 = os.path.join(args.out, "kv_w0"), os.path.join(args.out, "kv_w1")
    write_model(w0, sd0)
    write_model(w1, sd1)
    report = {"drift": args.drift, "results": []}
    runs = [tuple(run.split(":", 1)) for run in args.runs] if args.runs else \
        [(backend, write) for backend in args.backends for write in args.kv_writes]
    for i, (backend, write) in enumerate(runs):
        try:
            report["results"].append(check_backend(backend, args.out, w0, w1, sd1, args.port + 10 * i, write,
                                                         args.diagnose))
        except (RuntimeError, TimeoutError, requests.RequestException, OSError) as e:
            report["results"].append({"backend": backend, "verdict": "ERROR", "error": f"{type(e).__name__}: {e}"})
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "check_kv.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("| backend | verdict | recalibrated == fresh | stale != fresh | drift exact | recal ms |")
    print("|---|---|---|---|---|---:|")
    for r in report["results"]:
        print(f"| {r['backend']} | {r['verdict']} | {r.get('recalibrated_equals_fresh')} | "
              f"{r.get('stale_differs_from_fresh')} | {r.get('drift_preserves_outputs')} | "
              f"{r.get('recalibration_ms', float('nan')):.1f} |")
        if r.get("diagnosis"):
            print(f"diagnosis {r['backend']}: {json.dumps(r['diagnosis'])}")
    return 0 if all(r["verdict"] == "PASS" for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
