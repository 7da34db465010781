#!/usr/bin/env python3
"""GPU check of the stock server with `--quantization fp8_online_blockwise`: weight updates over HTTP, good and bad.

One command on the GPU machine, after `source scripts/gpu/env.sh`:
  python3 scripts/gpu/check_server.py --model-dir /tmp/fp8rl_suite/models --out /tmp/fp8rl_suite/server
  ... --moe                  a small Qwen3-MoE (4 experts, moe_intermediate 256, 2 layers, hidden 1024)
  ... --tp-size 2            both servers at TP 2 (two GPUs)
  ... --moe --tp-size 4 --ep-size 4                          expert parallelism (each rank holds whole experts)
  ... --moe --tp-size 2 --enable-dp-attention --dp-size 2    DP attention (attention per DP group, MoE over all)
  ... --moe --tp-size 4 --nnodes 2                           each server as two 'nodes' of two GPUs on this host
  (scripts/gpu/scale_out.py: what each layout launches; both servers always get the same layout)

Server A (`python -m sglang.launch_server ... --load-format dummy`, W0) takes every update; server B starts cold from
W1 on disk, once, for the bit-for-bit reference (it starts while A runs the refusal checks). The client is this
process: CUDA tensors travel as IPC handles. Checks, each a PASS/FAIL record with the engine's message:
  * W1 pushed by tensor equals the cold W1 start bit for bit (greedy tokens and return_logprob values); FP8
    parameter pointers unchanged; a disk update of W1 (from W2) equals the cold start too;
  * refused, each followed by /health_generate 200, an engine still consistent, outputs equal to W1's and pointers
    unchanged: NaN by tensor; a truncated model.safetensors; a corrupted second shard; embed_tokens of shape [V, 1]
    by tensor and from disk; a float8_e5m2 tensor; FP8 codes without their scale; a scale of the wrong shape; a
    misaligned flattened bucket; a bucket with an unknown dtype; load_format "direct"; an atomic step whose last
    bucket holds an unknown name;
  * pre-quantized FP8 (codes + power-of-two scales for every FP8 linear) by tensor, by flattened bucket and from disk
    give bit-identical outputs (each pushed onto W2), with the update time of each;
  * 9 updates (W1, W2 alternately, W1 last) while a thread keeps generating (8 prompts x 64 tokens): no request
    error, every push succeeds, the outputs afterwards equal the cold W1 start;
  * the per-rank scheme summary line is in server A's log (every node's), SGLang's "not fully optimized" warning is
    not.
How the checks see the ranks: the bit-for-bit checks compare outputs (tokens and logprobs) of two servers launched
with the same layout, not parameters, so every rank's weights take part (each TP / EP rank's shard in every forward;
under DP attention each prompt is generated on every DP rank, whose attention weights are its own copy). The pointer
and consistency checks read the plugin's telemetry of TP rank 0 of every DP rank (what /get_server_info returns);
the other ranks' pointers are covered by the outputs (a weight moved under a CUDA graph changes them).
Writes OUT/check_server.json (after every check) and OUT/summary.md; prints the PASS/FAIL table last.
Exit code 0 when every check passed, 1 otherwise, 2 without CUDA. About 4 minutes on an H100 (two server starts).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import signal
import sys
import time
from typing import Optional

import scale_out
import server_checks
from server_io import launch, route_every_dp_rank, stop
from server_payloads import SMALL_MOE_NAME, prepare
from server_report import NOT_OPTIMIZED, check, not_run, read_log, scheme_lines, table, write_report

DENSE_MODEL = "qwen3-small"
KAPI_KEYS = ("deep_gemm", "w8a8_block_fp8_matmul", "fp8_scaled_mm", "per_token_group_quant")


def kernel_api_calls(out_dir: str) -> dict[str, int]:
    """Lines per block-GEMM / quantization kernel in the servers' kernel-API logs."""
    calls: dict[str, int] = {}
    for f in sorted(os.listdir(out_dir)):
        if "kapi" not in f:
            continue
        with open(os.path.join(out_dir, f), errors="replace") as log:
            for line in log:
                for key in KAPI_KEYS:
                    if key in line:
                        calls[key] = calls.get(key, 0) + 1
    return calls


def versions() -> dict[str, str]:
    """Installed versions of the packages the result depends on."""
    import importlib.metadata as md

    out = {}
    for p in ("sglang", "torch", "triton", "sglang-fp8rl"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = "absent"
    return out


def model_folder(model_dir: str, moe: bool) -> str:
    """The dummy-weight model folder to serve (written if missing)."""
    if moe:
        from server_payloads import write_small_moe

        return write_small_moe(model_dir)
    from make_models import ensure

    return ensure(model_dir, [DENSE_MODEL])[0]


def log_checks(run: server_checks.Run, log_paths: list[str], tp_size: int) -> None:
    """The per-rank scheme summary lines, and no 'not fully optimized' warning, in server A's logs (one per node)."""
    text = "\n".join(read_log(path) for path in log_paths)
    lines = scheme_lines(text)
    run.report["scheme_lines"] = lines
    run.add(check("scheme_summary_logged", [(len(lines) == tp_size, f"one summary line per TP rank ({len(lines)})")],
                  "; ".join(f"{k}: {v}" for k, v in sorted(lines.items()))))
    warned = [ln.strip()[:300] for ln in text.splitlines() if NOT_OPTIMIZED in ln]
    run.add(check("no_not_optimized_warning", [(not warned, "SGLang's 'not fully optimized' warning absent")],
                  "; ".join(warned[:2])))


def new_report(args: argparse.Namespace, model: str, argv: list[str]) -> dict:
    """The report's header: command, date, device, TP, model, versions."""
    import torch

    return {"command": " ".join(["python3 scripts/gpu/check_server.py", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", "tp_size": args.tp_size,
            "model": model, "model_name": os.path.basename(model), "versions": versions(),
            "layout": scale_out.layout(args)}


def run_checks(args: argparse.Namespace, argv: list[str]) -> int:
    """Start server A, prepare the payloads while it starts, run every check; always stop the servers."""
    os.makedirs(args.out, exist_ok=True)
    model = model_folder(args.model_dir, args.moe)
    report = new_report(args, model, argv)
    run = server_checks.Run(args, report, lambda rep, checks: write_report(args.out, rep, checks))
    t0 = time.time()
    tmp = os.path.join(args.out, "tmp")
    extra = shlex.split(args.server_flags)
    for port in (args.port, args.port + 1):
        route_every_dp_rank(port, args.dp_size if args.enable_dp_attention else 1)
    a = scale_out.launch_server(launch, model, args.port, os.path.join(args.out, "server_a.log"), args,
                                scale_out.dist_port(args.port, 0), "--load-format", "dummy", *extra)
    cold: list[Optional[scale_out.Server]] = [None]

    def launch_cold() -> scale_out.Server:
        cold[0] = scale_out.launch_server(launch, payloads.folders["w1"], args.port + 1,
                                          os.path.join(args.out, "server_b.log"), args,
                                          scale_out.dist_port(args.port, 1), *extra)
        return cold[0]

    try:
        payloads = prepare(model, tmp)  # while server A starts
        report["payload_prep_s"] = round(time.time() - t0, 1)
        server_checks.run_all(run, a, payloads, launch_cold, args.startup_timeout_s)
    except (OSError, ValueError, RuntimeError, KeyError, TimeoutError) as e:  # the checks not run count as FAIL
        run.add(not_run("run", f"{type(e).__name__}: {e}"))
    finally:
        stop(cold[0])
        log_checks(run, a.logs, args.tp_size)
        stop(a)
        report["kernel_api_calls"] = kernel_api_calls(args.out)
        report["elapsed_s"] = round(time.time() - t0, 1)
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        write_report(args.out, report, run.checks)
        print("\n" + table(run.checks), flush=True)
    return 0 if all(c.ok for c in run.checks) else 1


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model-dir", required=True, help="folder of dummy-weight models (scripts/gpu/make_models.py; "
                                                      "the model folder is written there if missing)")
    p.add_argument("--out", required=True)
    p.add_argument("--moe", action="store_true", help=f"serve {SMALL_MOE_NAME} instead of {DENSE_MODEL}")
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism of both servers (default 1)")
    scale_out.add_args(p)
    p.add_argument("--port", type=int, default=30010, help="server A's port; the cold-start server uses PORT+1")
    p.add_argument("--startup-timeout-s", type=float, default=420.0, help="limit per server start (default 420)")
    p.add_argument("--keep-tmp", action="store_true", help="keep OUT/tmp (the checkpoint folders)")
    p.add_argument("--server-flags", default="", help="more launch flags for both servers, one string (e.g. "
                                                      "'--enforce-disable-flashinfer-allreduce-fusion')")
    args = p.parse_args(argv)
    if args.tp_size < 1:
        p.error("--tp-size must be >= 1")
    scale_out.check_args(args, p.error)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Parse, check for CUDA (and enough GPUs), run."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < args.tp_size:
        print(f"check_server.py needs {args.tp_size} CUDA GPU(s) (it launches SGLang servers and pushes CUDA IPC "
              f"handles); found {torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a suite timeout still stops the servers (finally)
    return run_checks(args, argv)


if __name__ == "__main__":
    sys.exit(main())
