#!/usr/bin/env python3
"""Cold and warm server start: BF16 vs --quantization fp8_online_blockwise, stock `python -m sglang.launch_server`.

One run, side by side, on a dummy-weight model (default Qwen3-8B shapes, scripts/gpu/make_models.py):

  bf16_cold   BF16, fresh Triton / DeepGEMM / gemm_select caches
  fp8_cold    fp8_online_blockwise, fresh caches (so: Triton and DeepGEMM JIT, the load-time GEMM measurement)
  fp8_warm    fp8_online_blockwise again, reusing fp8_cold's caches (what every later start on that machine costs)
  fp8_cold_serial  (only with --runs) fp8_cold with --fp8rl-jit-workers 0: DeepGEMM compiles inside SGLang's
              graph capture, one kernel after the other (the behaviour before the parallel warm-up)

Start time = launch until /health_generate answers 200 (SGLang has loaded, captured its CUDA graphs and served a
warm-up generation). Also parsed from each log: the [fp8rl] lines (JIT warm-up and GEMM measurement wall times)
and SGLang's prefill / decode CUDA-graph capture times.
The target (issue 8): fp8_cold - bf16_cold <= 30 s.

  python scripts/bench_startup.py --model-dir /tmp/fp8rl_suite/models --out /tmp/fp8rl_suite/startup
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
from server_io import wait_healthy  # scripts/gpu/server_io.py: polls /health_generate

from sglang_fp8rl.kernels import gemm_select

COMMON = ["--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend",
          "pytorch", "--grammar-backend", "none", "--dtype", "bfloat16", "--host", "127.0.0.1"]
# name, fp8, cache folder, extra server flags
RUNS = (("bf16_cold", False, "bf16", ()), ("fp8_cold", True, "fp8", ()), ("fp8_warm", True, "fp8", ()),
        ("fp8_cold_serial", True, "fp8serial", ("--fp8rl-jit-workers", "0")))
DEFAULT_RUNS = ("bf16_cold", "fp8_cold", "fp8_warm")
TARGET_EXTRA_S = 30.0


def cache_env(root: str) -> dict[str, str]:
    """Every on-disk JIT / measurement cache a start can use, under ``root``."""
    return {"TRITON_CACHE_DIR": os.path.join(root, "triton"), "SGLANG_DG_CACHE_DIR": os.path.join(root, "deep_gemm"),
            gemm_select.ENV_CACHE: os.path.join(root, "gemm_select.json"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TVM_FFI_CACHE_DIR": os.path.join(root, "tvm_ffi")}  # SGLang's own JIT kernels (sglang.kernels.jit)


def parse_log(text: str) -> dict:
    lines = [ln[ln.index("[fp8rl]"):][:300] for ln in text.splitlines() if "[fp8rl]" in ln]
    m = re.search(r"gemm_select: measured (\d+) entries for (\d+) shapes in ([\d.]+) s", text)
    warm = re.findall(r"JIT warm-up for [^:]*: (\d+)/(\d+) launches by (\d+) workers in ([\d.]+) s", text)
    workers = re.search(r"DeepGEMM JIT warm-up: (\d+) workers \(requested (\d+)", text)
    capture = {phase: float(c.group(1)) for phase in ("prefill", "decode")
               for c in [re.search(rf"Capture target {phase} CUDA graph end\. elapsed=([\d.]+) s", text)] if c}
    return {"fp8rl_lines": lines[:12], "gemm_measured_entries": int(m.group(1)) if m else 0,
            "gemm_measure_s": float(m.group(3)) if m else 0.0,
            "jit_warmup_s": round(sum(float(w[3]) for w in warm), 1),
            "jit_warmup_launches": " + ".join(f"{w[0]}/{w[1]} x{w[2]}" for w in warm),
            "jit_workers": int(workers.group(1)) if workers else None,
            "jit_workers_requested": int(workers.group(2)) if workers else None,
            "capture_prefill_s": capture.get("prefill"), "capture_decode_s": capture.get("decode"),
            "deepgemm_precompile": "DeepGEMM JIT Pre-Compile" in text}


def run_one(name: str, fp8: bool, model: str, port: int, env: dict, log: str, timeout: float, mem: float,
            extra: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
           "--mem-fraction-static", str(mem), *COMMON]
    if fp8:
        cmd += ["--quantization", "fp8_online_blockwise"]
    cmd += list(extra)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    res = {"name": name, "cmd": " ".join(cmd)}
    try:
        res["start_s"] = round(wait_healthy(port, proc, timeout), 1)
    except (RuntimeError, TimeoutError) as e:
        res["error"] = str(e)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    res["wall_s"] = round(time.time() - t0, 1)
    with open(log, errors="replace") as f:
        res.update(parse_log(f.read()))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=240.0, help="per start (s)")
    p.add_argument("--mem", type=float, default=0.7)
    p.add_argument("--port", type=int, default=30040)
    p.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), choices=[r[0] for r in RUNS])
    args = p.parse_args(argv)
    import make_models

    model = make_models.ensure(args.model_dir, [args.model])[0]
    os.makedirs(args.out, exist_ok=True)
    caches = {kind: os.path.join(args.out, f"cache_{kind}") for _, _, kind, _ in RUNS}
    for path in caches.values():
        shutil.rmtree(path, ignore_errors=True)  # cold means cold: nothing from an earlier run
    results = []
    for name, fp8, kind, extra in RUNS:
        if name not in args.runs:
            continue
        env = dict(os.environ, PYTHONUNBUFFERED="1", **cache_env(caches[kind]))
        env.pop("SGLANG_JIT_DEEPGEMM_PRECOMPILE", None)  # the plugin's default applies, as for a user
        r = run_one(name, fp8, model, args.port, env, os.path.join(args.out, f"{name}.log"), args.timeout, args.mem,
                    extra)
        print(json.dumps(r), flush=True)
        results.append(r)
    by = {r["name"]: r.get("start_s") for r in results}
    lines = [f"## Server start, {args.model} (dummy weights), stock launch_server, caches fresh for *_cold", "",
             "| run | ready after (s) | JIT warm-up (s) | launches x workers | gemm_select entries measured | "
             "measurement (s) | prefill-graph capture (s) | decode-graph capture (s) | note |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r.get('start_s', 'n/a')} | {r['jit_warmup_s']} | {r['jit_warmup_launches']} | "
                     f"{r['gemm_measured_entries']} | {r['gemm_measure_s']} | {r['capture_prefill_s']} | "
                     f"{r['capture_decode_s']} | {r.get('error', '')} |")
    if by.get("fp8_cold") is not None and by.get("bf16_cold") is not None:
        extra = by["fp8_cold"] - by["bf16_cold"]
        lines.append("")
        lines.append(f"fp8_cold - bf16_cold = {extra:+.1f} s (target <= {TARGET_EXTRA_S:.0f} s): "
                     f"{'PASS' if extra <= TARGET_EXTRA_S else 'FAIL'}")
        for name in ("fp8_warm", "fp8_cold_serial"):
            if by.get(name) is not None:
                lines.append(f"{name} - bf16_cold = {by[name] - by['bf16_cold']:+.1f} s")
    text = "\n".join(lines)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "startup_results.json"), "w") as f:
        json.dump({"runs": results, "model": args.model}, f, indent=1)
    print("\n" + text)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
