#!/usr/bin/env python3
"""Rollout throughput: online blockwise FP8 (this plugin) vs BF16, SGLang's pre-quantized block-FP8 and online
per-channel FP8.

One command, one run, one table. Each config is one subprocess of `sglang.benchmark.one_batch` (what
`python -m sglang.bench_one_batch` runs: a static batch, prefill then greedy decode, no server) on a dummy-weight
Qwen3-8B-shaped model (`--moe`: Qwen3-30B-A3B-shaped), with in-process hooks (scripts/bench_rollout_child.py):

  bf16                  qwen3-8b, no quantization (cuBLAS BF16 GEMMs)
  fp8_online_blockwise  qwen3-8b, --quantization fp8_online_blockwise (this plugin: 128x128 FP32-scaled weight blocks
                        quantized at load, dynamic 1x128 activation groups). Its dummy weights are left alone: the
                        plugin quantizes SGLang's BF16 dummy values itself.
  block_prequant        qwen3-8b-block (config.json quantization_config fp8/e4m3/dynamic/[128,128]): SGLang's own
                        pre-quantized block-FP8 path (DeepGEMM on sm90), SGLANG_JIT_DEEPGEMM_PRECOMPILE=0
  fp8_channel           qwen3-8b, --quantization fp8 (online per-output-channel weight scales, per-token activations)
Opt-in (--configs), the FP8 KV cache of issue 15:
  fp8_online_blockwise_kv         fp8_online_blockwise + --kv-cache-dtype fp8_e4m3 (K/V scales calibrated at load:
                                  the plugin's default for this pair of flags)
  fp8_online_blockwise_kv_static  the same + --fp8rl-kv-scales static (SGLang's scale 1.0, no decode fold)
  fp8_online_blockwise_kv_sglang_write  fp8_online_blockwise_kv + --fp8rl-kv-write sglang (SGLang's K/V write and a
                                  clamp, instead of the default one-kernel write)
  fp8_online_blockwise_kv_fa3     fp8_online_blockwise_kv + --fp8rl-decode-attention fa3 (FlashAttention-3's FP8
                                  decode at every batch size)
  fp8_online_blockwise_kv_splitkv fp8_online_blockwise_kv + --fp8rl-decode-attention split_kv (the plugin's split-KV
                                  decode at every batch size; the default, auto, takes it up to 32 sequences)
  fp8_online_blockwise_kv_bf16q   fp8_online_blockwise_kv + --fp8rl-decode-query bf16 (the split-KV kernel reads
                                  the BF16 query, no E4M3 cast launch)
  fp8_online_blockwise_kv_forms   fp8_online_blockwise_kv + --fp8rl-split-kv-forms single_plan,step_plan,fused_merge
                                  (the split-KV kernel with fewer launches: no plan launch at batch 1, one plan a
                                  step, no merge launch)
  fp8_online_blockwise_kv_noforms fp8_online_blockwise_kv + --fp8rl-split-kv-forms none (the split-KV kernel as it
                                  ran before the forms: the baseline of the default forms)
  fp8_online_blockwise_kv_lean    fp8_online_blockwise_kv + --fp8rl-decode-query bf16 --fp8rl-producer-quant on (every
                                  opt-in that takes launches out of the decode step)
  bf16_kv                         BF16 weights + --kv-cache-dtype fp8_e4m3 (SGLang's static scale 1.0)
  fp8_online_noselect             the plugin with SGLang's GEMM dispatch only (--fp8rl-gemm-select off)

For block_prequant and fp8_channel the FP8 dummy weights found at dummy init are refilled with U(-2,2) in e4m3 and
weight_scale_inv := 5e-4 (SGLang's dummy init casts U(-1e-3,1e-3) to e4m3, which leaves ~98 % zeros and negative
scales). fp8_channel quantizes after dummy init, so there the hook finds nothing to refill.

Common flags: --load-format dummy --attention-backend triton (or
--attention-backend flashinfer / fa3; fa3 only where sglang-kernel's FlashAttention-3 imports) --sampling-backend
pytorch --grammar-backend none --dtype bfloat16 --disable-prefill-cuda-graph --cuda-graph-bs-decode <the batch sizes>
--mem-fraction-static 0.7, input 512, output 1024 (--output-len takes several lengths: one process runs them all).
With flashinfer, FP8-KV configs run with SGLANG_FLASHINFER_USE_PAGED=1 (its ragged prefix path ignores KV scales).
--bf16-backend B runs BF16 once more on backend B (label bf16@B), so that "BF16 on its fastest backend" is measured
in the same run; --merge RESULTS.json adds the entries of an earlier run (labels config@backend) to the tables.
bench_one_batch warms up once at the first batch size (32 decode steps), then runs each (batch size, output length)
once (--repeat N runs the whole list N times; the table uses the last pass). Decode tok/s is bs / median step latency.
Batch sizes whose (input+output) x bs exceed the KV pool are skipped by bench_one_batch ("skipped (KV)").
FP8-KV configs get a second table (scripts/kv_measure.py): decode ratios over BF16 on the same backend and on BF16's
fastest backend at outputs 256 / 1024 and bs 64 / 128, issue 15's targets with margins, and the load-time K/V-scale
recalibration time (parsed from the engine's log) against a 1024-token rollout at bs 128.

The tail (--input-len with several lengths): every (batch size, prompt length) runs in one process per config; the
main tables keep the first length, and a second table (scripts/tail_table.py) gives each config's decode step at
every (context, bs) and its speed-up over the first config, with the batch-1 8k-context target (>= 1.4x).

Writes under --out: results.json (everything parsed), summary.md (the table), logs.tgz (per-config logs, jsonl,
env, profiler traces), and with --profile-decode profile_top_kernels.txt.

  python scripts/bench_rollout.py --out /tmp/rollout                      # 4 configs, bs 64 128, ~5-6 min warm
  python scripts/bench_rollout.py --batch-sizes 1 8 32 64 128 256 --out /tmp/r2
  python scripts/bench_rollout.py --moe --out /tmp/moe                    # Qwen3-30B-A3B shape (bs 32 64, out 512)
  python scripts/bench_rollout.py --configs fp8_online_blockwise --profile-decode --batch-sizes 128 --output-len 256
  # the tail on FA3: decode at bs 1 4 16 after 4k and 8k-token prompts, BF16 first (the baseline)
  python scripts/bench_rollout.py --attention-backend fa3 --configs bf16 fp8_online_blockwise \\
      fp8_online_blockwise_kv --batch-sizes 1 4 16 --input-len 4096 8192 --output-len 64 --out /tmp/tail
  # FP8 KV on triton (~5 min warm), then on FlashInfer with the triton results merged (BF16 best of both):
  python scripts/bench_rollout.py --configs bf16 fp8_online_blockwise_kv fp8_online_blockwise_kv_static \\
      --output-len 256 1024 --out /tmp/kv
  python scripts/bench_rollout.py --attention-backend flashinfer --configs bf16 fp8_online_blockwise_kv \\
      --output-len 256 1024 --merge /tmp/kv/results.json --out /tmp/kv_fi
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time

import _paths  # noqa: F401  (scripts/gpu and the checkout on sys.path)
import kernel_trace as KT  # scripts/kernel_trace.py: the profiler's top-kernels table
import kv_measure as KV  # scripts/kv_measure.py: the FP8-KV tables and log parsing
import tail_table as TAIL  # scripts/tail_table.py: decode at small batch over long contexts
from bench_rollout_configs import (  # scripts/bench_rollout_configs.py: the configs and their command lines
    CONFIGS,
    EXTRA_CONFIGS,
    bench_flags,
    config_spec,
    plan_runs,
    profile_flags,
    sweep_order,
)
from bench_rollout_report import (  # scripts/bench_rollout_report.py: log parsing, ratios, targets, the tables
    DESC,
    _f,
    check_targets,
    compute_ratios,
    format_summary,
    input_lens_of,
    last_pass,
    of_input_len,
    parse_log,
    parse_rows_from_log,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ECHO_RE = re.compile(
    r"\[fp8rl\]|\[bench_rollout\]|Load weight end|max_total_num_tokens=|Prefill\. latency|Decode\.  median|"
    r"Total\. latency|skipping \(|Traceback|Error|error:|CUDA out of memory")


# ----------------------------------------------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"[bench_rollout {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _env_info() -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        info["device"] = out.splitlines()[0] if out else "unknown"
    except (OSError, subprocess.SubprocessError) as e:  # CPU machine / no driver
        info["device"] = f"unknown ({type(e).__name__})"
    from importlib.metadata import PackageNotFoundError, version

    vs = []
    for p in ["sglang", "sglang-kernel", "sgl-deep-gemm", "torch", "triton", "transformers", "sglang-fp8rl"]:
        try:
            vs.append(f"{p} {version(p)}")
        except PackageNotFoundError:
            pass
    info["versions"] = ", ".join(vs)
    return info


def run_config(cfg: str, cmd: list[str], env: dict, log_path: str, timeout_s: float) -> dict:
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("# " + " ".join(cmd) + "\n# env: " + " ".join(f"{k}={v}" for k, v in sorted(env.items())
                                                                  if k.startswith(("SGLANG", "FP8RL", "DG_"))) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        echoed = collections.Counter()

        def pump():
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(f"[{time.time() - t0:7.1f}] {line}\n")
                log.flush()
                m = ECHO_RE.search(line)
                if m:
                    key = m.group(0)
                    echoed[key] += 1
                    if echoed[key] <= (6 if key == "[fp8rl]" else 3):
                        print(f"  {cfg} +{time.time() - t0:4.0f}s| {line.strip()[:220]}", flush=True)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _say(f"{cfg}: timeout after {timeout_s:.0f} s, stopping it (process group {proc.pid})")
            for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)  # the group of the process started above (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode if proc.returncode is not None else -9
        th.join(timeout=10)
    return {"rc": rc, "timed_out": timed_out, "wall_s": time.time() - t0}


def _write_summary(out_dir, results, meta) -> str:
    text = format_summary(results, meta)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text + "\n")
    inputs = input_lens_of(meta)
    tail = TAIL.tail_rows(results, inputs, meta.get("batch_sizes") or []) if len(inputs) > 1 else []
    primary = of_input_len(results, inputs[0])  # the main tables' rows
    best = last_pass(primary, meta.get("output_len") if len(meta.get("output_lens") or []) > 1 else None)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "tail": tail, "ratios": compute_ratios(best),
                   "targets": check_targets(best), "kv_ratios": KV.kv_ratio_rows(primary),
                   "kv_targets": KV.kv_targets(primary), "kv_recalibration": KV.recal_report(results)},
                  f, indent=1, default=str)
    return text


def load_merged(paths, main_backend: str) -> collections.OrderedDict:
    """Entries of earlier runs' results.json, relabelled config@backend (they never replace this run's entries)."""
    merged = collections.OrderedDict()
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--merge {path}: cannot read it ({e})") from e
        their_backend = (data.get("meta") or {}).get("attention_backend", KV.DEFAULT_ATTENTION_BACKEND)
        for label, res in (data.get("results") or {}).items():
            cfg = KV.entry_config(label, res)
            backend = KV.entry_backend(res, their_backend)
            merged[f"{cfg}@{backend}"] = {**res, "config": cfg, "backend": backend, "merged_from": path}
    return merged


def check_backends(args) -> None:
    """Refuse FlashAttention-3 where sglang-kernel's FA3 does not import (our GPU wheelhouse drops it)."""
    if KV.FA3 not in [args.attention_backend, *args.bf16_backend]:
        return
    ok, why = KV.fa3_available(sys.executable)
    if not ok:
        raise SystemExit(f"--attention-backend fa3: FlashAttention-3 does not import here ({why}). sglang-kernel's "
                         "flash_ops (FA3) is missing from this installation (the trimmed GPU wheelhouse drops it); use "
                         "triton or flashinfer, or install the complete sglang-kernel wheel.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS + EXTRA_CONFIGS)
    p.add_argument("--batch-sizes", nargs="+", type=int, default=None, help="default 64 128 (--moe: 32 64)")
    p.add_argument("--input-len", type=int, nargs="+", default=[512],
                   help="prompt length(s); several add the tail table (decode per context length and bs; the main "
                        "tables use the first length)")
    p.add_argument("--output-len", type=int, nargs="+", default=None,
                   help="one or more output lengths, run by one process per config (default 1024; --moe: 512)")
    p.add_argument("--attention-backend", choices=KV.ATTENTION_BACKENDS, default=KV.DEFAULT_ATTENTION_BACKEND,
                   help="attention backend of every config (fa3 only where sglang-kernel's FlashAttention-3 imports)")
    p.add_argument("--bf16-backend", nargs="+", default=[], choices=KV.ATTENTION_BACKENDS, metavar="BACKEND",
                   help="also run BF16 on these backends (labels bf16@BACKEND): the FP8-KV table divides by BF16 on "
                        "its fastest backend")
    p.add_argument("--merge", nargs="+", action="extend", default=[], metavar="RESULTS_JSON",
                   help="add the entries of earlier runs (their results.json) to the tables, e.g. another backend "
                        "(repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="run the batch-size list N times in one process")
    p.add_argument("--prefill-graph", action="store_true",
                   help="keep SGLang's prefill CUDA graphs (the server default; off by default here: eager prefill)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="default 0.7 (--moe: 0.88)")
    p.add_argument("--model-dir", default="/tmp/fp8rl_models", help="dummy model folders (made if missing)")
    p.add_argument("--out", default="/tmp/fp8rl_bench_rollout")
    p.add_argument("--budget-s", type=float, default=300, help="timeout per config (s)")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="total wall budget (s) for all configs; a config that cannot get --min-s is skipped (0: none)")
    p.add_argument("--min-s", type=float, default=75, help="skip a config when less than this is left")
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B shape (qwen3-30b-a3b / qwen3-30b-a3b-block)")
    p.add_argument("--profile-decode", action="store_true",
                   help="torch-profile a few decode steps (bench_one_batch --profile, in process) of --profile-configs "
                        "and write the top kernels by CUDA time to profile_top_kernels.txt")
    p.add_argument("--profile-configs", nargs="+", default=["fp8_online_blockwise"], choices=CONFIGS + EXTRA_CONFIGS)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--extra-args", default="", help="extra bench_one_batch flags for every config (one string)")
    p.add_argument("--keep-raw", action="store_true", help="keep OUT/raw/ next to logs.tgz")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    a = p.parse_args(argv)
    if a.batch_sizes is None:
        a.batch_sizes = [32, 64] if a.moe else [64, 128]
    a.input_lens = list(dict.fromkeys(a.input_len))
    a.input_len = a.input_lens[0]  # the primary length: the main tables
    a.output_lens = sorted(set(a.output_len)) if a.output_len else [512 if a.moe else 1024]
    a.output_len = max(a.output_lens)  # the primary length: the old ratio / target tables, profiling
    if a.mem_fraction_static is None:
        a.mem_fraction_static = 0.88 if a.moe else 0.7
    return a


def combine(results: dict, merged: dict) -> collections.OrderedDict:
    """This run's entries, then the merged ones whose (config, backend) this run did not measure."""
    mine = {(KV.entry_config(k, v), KV.entry_backend(v)) for k, v in results.items()}
    out = collections.OrderedDict(results)
    for label, res in merged.items():
        if (KV.entry_config(label, res), KV.entry_backend(res)) not in mine and label not in out:
            out[label] = res
    return out


def build_plan(args, raw: str, prof_dir: str, model_dir: str, script: str = __file__) -> list[tuple]:
    """(label, config, backend, spec, cmd, env) per run; each cmd is ``script _child <bench_one_batch flags>`` (another
    script's child may wrap this one's, as decode_roofline.py does)."""
    plan = []
    for label, cfg, backend in plan_runs(args.configs, args.attention_backend, args.bf16_backend):
        spec = config_spec(cfg, args.moe, backend)
        mpath = os.path.join(model_dir, spec["model"])
        cmd = [sys.executable, os.path.abspath(script), "_child",
               *bench_flags(mpath, args.batch_sizes, args.input_lens, args.output_lens, args.mem_fraction_static,
                            os.path.join(raw, f"{label}.jsonl"), label, args.repeat, args.prefill_graph, backend),
               *spec["flags"]]
        profiled = args.profile_decode and cfg in args.profile_configs
        if profiled:
            cmd += profile_flags(label, args.output_lens, args.profile_steps)
        if args.extra_args:
            cmd += args.extra_args.split()
        env = dict(os.environ)
        env.update({"PYTHONUNBUFFERED": "1", **spec["env"]})
        env.setdefault("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")
        env.setdefault("SGLANG_DG_CACHE_DIR", "/tmp/dg_cache")
        if profiled:
            env["SGLANG_TORCH_PROFILER_DIR"] = prof_dir
        plan.append((label, cfg, backend, spec, cmd, env))
    return plan


def main(argv=None) -> int:
    args = parse_args(argv)
    check_backends(args)
    out = os.path.abspath(args.out)
    raw = os.path.join(out, "raw")
    prof_dir = os.path.join(raw, "profile")
    model_dir = os.path.abspath(args.model_dir)
    plan = build_plan(args, raw, prof_dir, model_dir)
    merged = load_merged(args.merge, args.attention_backend)
    if args.dry_run:
        for label, _, _, _, cmd, env in plan:
            shown = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith(("SGLANG", "FP8RL")))
            print(f"# {label}: env {shown}")
            print(" ".join(cmd))
        for label in merged:
            print(f"# merged: {label} from {merged[label]['merged_from']}")
        return 0

    if os.path.isdir(raw):
        shutil.rmtree(raw)  # a stale raw/ from an earlier run would be packed with this one
    os.makedirs(raw)
    import make_models  # scripts/gpu/make_models.py

    needed = sorted({p[3]["model"] for p in plan})
    make_models.ensure(model_dir, needed)
    meta = {"model_desc": ("Qwen3-30B-A3B-shaped" if args.moe else "Qwen3-8B-shaped") + " dummy weights",
            "models": needed, "input_len": args.input_len, "input_lens": args.input_lens, "output_len": args.output_len,
            "output_lens": args.output_lens, "attention_backend": args.attention_backend,
            "batch_sizes": args.batch_sizes, "repeat": args.repeat, "mem_fraction_static": args.mem_fraction_static,
            "merged": list(args.merge), "argv": sys.argv, **_env_info()}
    with open(os.path.join(raw, "env.txt"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    _say(f"{meta['device']} | {meta['versions']}")
    _say(f"runs {[p[0] for p in plan]}, bs {args.batch_sizes} x{args.repeat}, in {args.input_lens}, "
         f"out {args.output_lens}, attention {args.attention_backend}, mem {args.mem_fraction_static}, "
         f"models in {model_dir}{f', merged {list(merged)}' if merged else ''}")

    t_start = time.time()
    results = collections.OrderedDict()
    for label, cfg, backend, spec, cmd, env in plan:
        base = {"config": cfg, "backend": backend, "flags": spec["flags"], "env": spec["env"]}
        timeout = args.budget_s
        if args.deadline_s > 0:
            left = args.deadline_s - (time.time() - t_start)
            timeout = min(timeout, left - 5)
            if timeout < args.min_s:
                _say(f"SKIP {label}: only {left:.0f} s left of --deadline-s {args.deadline_s:.0f}")
                results[label] = {**base, "status": "skipped (deadline)", "rc": None, "rows": []}
                continue
        _say(f"run {label} ({DESC[cfg]}), attention {backend}, model {spec['model']}, timeout {timeout:.0f} s")
        log_path = os.path.join(raw, f"{label}.log")
        run = run_config(label, cmd, env, log_path, timeout)
        with open(log_path, errors="replace") as f:
            text = f.read()
        info = parse_log(text)
        jl = os.path.join(raw, f"{label}.jsonl")
        rows = []
        if os.path.exists(jl):
            with open(jl) as f:
                rows = [json.loads(ln) for ln in f if ln.strip()]
        if not rows:
            rows = parse_rows_from_log(text, sweep_order(args.batch_sizes, args.output_lens, args.repeat))
        res = {"model": spec["model"], **base, **run, **info, "rows": rows,
               "status": "ok" if run["rc"] == 0 else ("timeout" if run["timed_out"] else f"failed rc={run['rc']}")}
        results[label] = res
        recal = f", KV-scale recalibration {info['kv_recal_ms']} ms" if info["kv_recal_ms"] else ""
        _say(f"{label}: {res['status']}, {run['wall_s']:.0f} s, weights {_f(info['weight_gib'], '{:.2f}')} GiB, "
             f"KV {_f(info['kv_tokens'])} tokens ({info['kv_dtype'] or '?'}), {len(rows)} result rows{recal}")
        if run["rc"] != 0 and info["error_tail"]:
            print("\n".join("    " + ln for ln in info["error_tail"][-12:]), flush=True)
        _write_summary(out, combine(results, merged), meta)  # partial results survive a killed call

    if args.profile_decode:
        parts = []
        for tr in sorted(glob.glob(os.path.join(prof_dir, "*decode*.trace.json*"))):
            try:
                parts.append(KT.format_kernel_summary(KT.kernel_totals(KT.load_trace(tr)), os.path.basename(tr),
                                                   steps=args.profile_steps))
            except (OSError, ValueError, KeyError, TypeError) as e:  # a truncated or foreign trace
                parts.append(f"### {os.path.basename(tr)}: could not summarize: {e!r}")
        if not parts:
            parts.append("no decode trace found (the profiled config failed, or the bench skipped profiling)")
        with open(os.path.join(out, "profile_top_kernels.txt"), "w") as f:
            f.write("\n\n".join(parts) + "\n")
        _say(f"profile summary -> {os.path.join(out, 'profile_top_kernels.txt')}")

    text = _write_summary(out, combine(results, merged), meta)
    with tarfile.open(os.path.join(out, "logs.tgz"), "w:gz") as tf:
        tf.add(raw, arcname="raw")
    if not args.keep_raw:
        shutil.rmtree(raw, ignore_errors=True)
    print("\n" + text, flush=True)
    if args.profile_decode and os.path.exists(os.path.join(out, "profile_top_kernels.txt")):
        with open(os.path.join(out, "profile_top_kernels.txt")) as f:
            print("\n" + "\n".join(f.read().splitlines()[:40]))
    ok = all(r.get("rc") == 0 for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        from bench_rollout_child import child_main

        child_main(sys.argv[2:])
    else:
        sys.exit(main())
