#!/usr/bin/env python3
"""RL regression: GRPO on the toy addition policy with BF16 vs FP8 rollouts from the stock SGLang server.

One command, one GPU, <= 10 minutes. The policy is the Qwen3 toy of scripts/train_toy_policy.py (4 layers, hidden
512; reversed-digit addition, 3-5 digit operands). The trainer is plain torch on the same GPU; rollouts come from
`python -m sglang.launch_server ... --skip-tokenizer-init` (`/generate` with input_ids, temperature 1,
`return_logprob`); after every optimizer step the weights are pushed with
`sglang_fp8rl.trainer.push_state_dict` (CUDA IPC).

Arms (`--arms`; a name is a server kind, plus `_tis` for truncated importance sampling with cap `--tis-cap`):
  bf16        BF16 server, no correction (the engine-vs-trainer mismatch of an unquantized engine is not zero)
  fp8         `--quantization fp8_online_blockwise`, no correction
  fp8_tis     the same FP8 server, loss weighted by min(pi_train / pi_rollout, 2) (sglang_fp8rl.rollout_correction)
  fp8kv_tis   FP8 weights + `--kv-cache-dtype fp8_e4m3` (+ `--fp8kv-server-args`, e.g. "--fp8rl-kv-scales
              calibrate" once that option exists), with TIS. Not in the default arms: it needs a third server.

Schedule. Each server kind starts once, all concurrently, from a checkpoint of the initial (random) weights, while
the trainer warm-starts the policy by supervised training until its sampled (temperature 1) per-digit reward on
held-out problems reaches `--init-reward`: the reward is neither 0 nor saturated at step 0. Then every arm starts
from those same weights and seeds; the arms run interleaved, step k of every arm before step k + 1, so a time limit
cuts all arms at the same step, and every step uses the same prompts in every arm. Arms that share a server get
their own weights pushed before each rollout (the push is the update after the previous step).

Per step and arm (trainer log-probs recomputed in torch on the sampled tokens before the update): mean reward and
exact match, KL(pi_rollout || pi_train) estimators k1/k2/k3, token_mult_prob_error, TIS clip fraction (ratio > cap,
reported for every arm), PPO clip fraction, push time, rollout time, train time. Held-out greedy exact match per arm
before the first and after the last step.

Reward: per-digit partial credit (`--reward digits`, default): the fraction of the 7 answer tokens (6 sum digits and
<eos>) generated right at their position. It is graded, so nearly every group of samples has reward variance and
thus a gradient, where exact match (`--reward exact`, 1 for the whole answer right) gives none to groups that are all
wrong or all right. The warm start stops at a sampled reward of 0.75 (`--init-reward`): the policy knows most digits
but sampling at temperature 1 still errs, so there are 25 points to gain, by sharpening the distribution and by
fixing carries. GRPO: group-normalized advantages (r - mean) / (std + 1e-6) over `--group-size` samples per prompt,
PPO-clipped token-mean loss over `--minibatches` minibatches per step (AdamW, `--lr`), no KL penalty. These defaults
are chosen, not tuned: if the BF16 curve is flat, raise --lr or lower --init-reward.

Output in --out: rl_results.json (every step record, summaries, settings), summary.md (table), rl_curves.png
(matplotlib; skipped with a message if it is missing), server_<kind>.log.

  python scripts/rl_regression.py --out /tmp/rl                      # on the GPU machine (see docs/GPU.md)
  python scripts/rl_regression.py --out /tmp/rl --dry-run --model-size tiny --steps 3   # CPU, no server

--dry-run replaces the servers by torch sampling from a BF16 copy of the policy (server kind bf16) or from a copy
whose decoder linear weights went through the package's blockwise FP8 round trip (fp8, fp8kv; weights only, no
activation or KV quantization): the training and metrics code runs without SGLang.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import _paths  # noqa: F401  (the checkout's sglang_fp8rl serves --dry-run on a bare machine)
import torch
import train_toy_policy as T
from rl_engines import SERVER_KINDS, ServerEngine, TorchEngine, server_command
from rl_grpo import REWARDS, group_advantages, grpo_loss, pack_rollouts, reward, step_record
from rl_policy import MODEL_SIZES, build_policy, named_bf16, response_logprobs, save_checkpoint, sft_warm_start
from rl_report import say, write_outputs

from sglang_fp8rl import rollout_correction as rc

TIS_SUFFIX = "_tis"
DEFAULT_ARMS = ("bf16", "fp8", "fp8_tis")
RESERVE_S = 25.0  # final evaluation, outputs and server shutdown after the last step


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    server: str
    tis: bool


def parse_arm(name: str) -> Arm:
    """'<server kind>' or '<server kind>_tis' -> Arm."""
    base, tis = (name[:-len(TIS_SUFFIX)], True) if name.endswith(TIS_SUFFIX) else (name, False)
    if base not in SERVER_KINDS:
        raise ValueError(f"unknown arm {name!r}: expected <server>[{TIS_SUFFIX}] with server in {sorted(SERVER_KINDS)}")
    return Arm(name, base, tis)


# ----------------------------------------------------------------------------------------------------------------
# one GRPO step of one arm
# ----------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class ArmRun:
    arm: Arm
    model: object
    opt: torch.optim.Optimizer
    gen: torch.Generator
    records: list = dataclasses.field(default_factory=list)
    evals: dict = dataclasses.field(default_factory=dict)


def new_arm_run(arm: Arm, init_state: dict, args, device: torch.device) -> ArmRun:
    """The arm's own policy from the shared initial weights, a fresh optimizer, the shared minibatch seed."""
    model = build_policy(args.model_size, args.seed, device)
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    return ArmRun(arm, model, opt, torch.Generator().manual_seed(args.seed))


def step_problems(step: int, args, task: dict) -> list[tuple[int, int]]:
    """The step's training problems: the same in every arm."""
    return T.sample_problems(random.Random(args.seed * 1_000_003 + step), args.prompts_per_step, "train", task)


def run_step(run: ArmRun, engine, problems: list[tuple[int, int]], step: int, args, task: dict,
             device: torch.device) -> dict:
    """Push the arm's weights, sample G answers per prompt, score, recompute log-probs, update; the step's record."""
    t0 = time.perf_counter()
    engine.push(named_bf16(run.model))
    t1 = time.perf_counter()
    prompts = [T.prompt_ids(a, b, task) for a, b in problems for _ in range(args.group_size)]
    answers = [T.answer_ids(a, b, task) for a, b in problems for _ in range(args.group_size)]
    samples = engine.generate(prompts, T.max_answer_tokens(task), 1.0)
    t2 = time.perf_counter()
    rewards = [reward(s[0], a, args.reward) for s, a in zip(samples, answers)]
    exact = [reward(s[0], a, "exact") for s, a in zip(samples, answers)]
    b = {k: v.to(device) for k, v in pack_rollouts(prompts, samples, T.max_answer_tokens(task)).items()}
    plen = int(b["prompt_len"])
    run.model.train()
    with torch.no_grad():
        old = response_logprobs(run.model, b["ids"], b["attn"], plen)
    mismatch = rc.mismatch_metrics(old, b["rollout_logp"], b["mask"], args.tis_cap)
    adv = group_advantages(torch.tensor(rewards, device=device), args.group_size)
    perm = torch.randperm(len(prompts), generator=run.gen).to(device)
    losses, clips, norms = [], [], []
    for idx in perm.chunk(args.minibatches):
        new = response_logprobs(run.model, b["ids"][idx], b["attn"][idx], plen)
        loss, st = grpo_loss(new, old[idx], b["rollout_logp"][idx], adv[idx], b["mask"][idx], args.clip_eps,
                             args.tis_cap if run.arm.tis else None)
        run.opt.zero_grad(set_to_none=True)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)))
        run.opt.step()
        losses.append(float(loss.detach()))
        clips.append(st["ppo_clip_fraction"])
    t3 = time.perf_counter()
    train = {"loss": statistics.fmean(losses), "ppo_clip_fraction": statistics.fmean(clips),
             "grad_norm": statistics.fmean(norms)}
    times = {"push_s": t1 - t0, "rollout_s": t2 - t1, "train_s": t3 - t2}
    return step_record(step, rewards, exact, [len(s[0]) for s in samples], mismatch, train, times)


def greedy_eval(run: ArmRun, engine, args, task: dict) -> float:
    """Held-out exact match of greedy decoding through the arm's engine, with the arm's current weights."""
    probs = T.test_problems(args.eval_n, seed=4242, task=task)
    engine.push(named_bf16(run.model))
    samples = engine.generate([T.prompt_ids(a, b, task) for a, b in probs], T.max_answer_tokens(task), 0.0)
    return statistics.fmean(T.decode_answer(s[0], task) == a + b for s, (a, b) in zip(samples, probs))


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------

def launch_server(kind: str, model_dir: str, port: int, args, log_path: str) -> subprocess.Popen:
    """Start one server in its own process group, its output in log_path."""
    cmd = server_command(kind, model_dir, port, args)
    say(f"server {kind}: {' '.join(cmd[1:])} (log {log_path})")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("SGLANG_JIT_DEEPGEMM_PRECOMPILE", "0")
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def log_tail(path: str, n: int = 20) -> str:
    """The last n lines of a server log."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError as e:
        return f"(no log: {e})"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    """Until /health_generate answers 200; RuntimeError with the log's tail if the server exits or times out."""
    import requests

    t0 = last_said = time.time()
    while time.time() - t0 < timeout:
        if time.time() - last_said >= 15.0:
            say(f"waiting for {url} ({time.time() - t0:.0f} s); its log says: {log_tail(log_path, 1).strip()[:100]}")
            last_said = time.time()
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; last lines of {log_path}:\n{log_tail(log_path)}")
        try:
            if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; last lines of {log_path}:\n{log_tail(log_path)}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the server's own process group (started by launch_server)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 15)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue


def progress_line(step: int, runs: list[ArmRun], args, step_s: float) -> str:
    """'step k/N (s/step) | arm reward kl_k3 tmpe | ...'."""
    parts = [f"step {step}/{args.steps} ({step_s:.2f} s/step)"]
    for run in runs:
        r = run.records[-1]
        parts.append(f"{run.arm.name} r {r['reward']:.3f} em {r['exact_match']:.3f} k3 {r['kl_k3']:.2e} "
                     f"tmpe {r['token_mult_prob_error']:.5f}")
    return " | ".join(parts)


def versions() -> dict:
    """Installed versions of the packages the result depends on (None where absent)."""
    from importlib import metadata

    out = {}
    for name in ("sglang", "sglang-fp8rl", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_arms(runs: list[ArmRun], engines: dict, args, task: dict, device: torch.device, deadline: float,
             clock=time.time) -> int:
    """Steps 1..--steps, every arm per step, while the slowest of the last 3 steps still fits before the deadline
    (less RESERVE_S); returns the number of steps completed."""
    walls: list[float] = []
    done = 0
    for step in range(1, args.steps + 1):
        if clock() + (max(walls[-3:]) if walls else 0.0) + RESERVE_S > deadline:
            say(f"time budget reached after {done} steps (--max-seconds {args.max_seconds:.0f})")
            break
        t = clock()
        problems = step_problems(step, args, task)
        for run in runs:
            run.records.append(run_step(run, engines[run.arm.server], problems, step, args, task, device))
        walls.append(clock() - t)
        done = step
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            say(progress_line(step, runs, args, walls[-1]))
    return done


def main(argv=None) -> int:
    args = parse_args(argv)
    arms = [parse_arm(n) for n in args.arms]
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.dry_run and device.type != "cuda":
        print("rl_regression.py needs a CUDA GPU for the SGLang servers and CUDA IPC weight pushes; "
              "use --dry-run for the torch-only path.", file=sys.stderr)
        return 2
    t_start = time.time()
    deadline = t_start + args.max_seconds
    task = dict(T.DEFAULT_TASK, min_digits=args.min_digits, max_digits=args.max_digits)
    kinds = sorted({a.server for a in arms})
    results = {"meta": {**vars(args), "steps_done": 0,
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "task": task,
                        "argv": sys.argv if argv is None else list(argv), "timing": {}},
               "arms": {a.name: {"server": a.server, "tis": a.tis, "records": [], "evals": {}} for a in arms},
               "sft": None, "servers": {k: {} for k in kinds}}
    timing = results["meta"]["timing"]
    procs: dict[str, tuple[subprocess.Popen, str, str]] = {}
    try:
        model = build_policy(args.model_size, args.seed, device)
        if not args.dry_run:
            work = args.work or tempfile.mkdtemp(prefix="rl_regression_")
            save_checkpoint(model, os.path.join(work, "init"))
            for i, kind in enumerate(kinds):
                log = os.path.join(args.out, f"server_{kind}.log")
                url = f"http://127.0.0.1:{args.port_base + i}"
                procs[kind] = (launch_server(kind, os.path.join(work, "init"), args.port_base + i, args, log), url, log)
        results["sft"] = sft_warm_start(model, task, args, device)
        timing["warm_start"] = results["sft"]["seconds"]
        if args.dry_run:
            engines = {kind: TorchEngine(kind, model, args.seed + i) for i, kind in enumerate(kinds)}
        else:
            engines = {}
            for kind, (proc, url, log) in procs.items():
                wait_ready(url, proc, min(args.server_timeout, max(10.0, deadline - RESERVE_S - time.time())), log)
                results["servers"][kind]["ready_after_s"] = time.time() - t_start
                engines[kind] = ServerEngine(url)
                say(f"server {kind} ready")
        timing["start_to_engines_ready"] = time.time() - t_start
        init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
        runs = [new_arm_run(a, init_state, args, device) for a in arms]
        for run in runs:
            run.records, run.evals = results["arms"][run.arm.name]["records"], results["arms"][run.arm.name]["evals"]
        t = time.time()
        for kind, engine in engines.items():  # first push and full-size rollout compile what the loop will need
            t_kind = time.time()
            engine.push(named_bf16(runs[0].model))
            warm = [T.prompt_ids(a, b, task) for a, b in step_problems(0, args, task) for _ in range(args.group_size)]
            engine.generate(warm, T.max_answer_tokens(task), 1.0)
            results["servers"][kind]["warmup_s"] = time.time() - t_kind
        for run in runs:
            run.evals["start"] = greedy_eval(run, engines[run.arm.server], args, task)
        timing["warmup_and_start_eval"] = time.time() - t
        say("engines warm; held-out greedy exact match at the start: "
            + ", ".join(f"{r.arm.name} {r.evals['start']:.3f}" for r in runs))
        t = time.time()
        results["meta"]["steps_done"] = run_arms(runs, engines, args, task, device, deadline)
        timing["rl_steps"] = time.time() - t
        t = time.time()
        for run in runs:
            run.evals["end"] = greedy_eval(run, engines[run.arm.server], args, task)
        timing["end_eval"] = time.time() - t
    finally:
        for proc, _, _ in procs.values():
            stop_server(proc)
        timing["total"] = time.time() - t_start
        write_outputs(results, args.out)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", required=True, help="output folder (results, summary, curves, server logs)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                   help=f"<server>[{TIS_SUFFIX}] with server in {sorted(SERVER_KINDS)} (default: %(default)s)")
    p.add_argument("--steps", type=int, default=150, help="GRPO steps per arm at most (default %(default)s)")
    p.add_argument("--max-seconds", type=float, default=540.0,
                   help="wall budget of the whole run from start; steps stop early to meet it (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="torch sampling instead of SGLang servers (CPU or GPU)")
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="toy",
                   help="toy: train_toy_policy.py's model; tiny: 2 layers, hidden 128 (for --dry-run on a CPU)")
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--minibatches", type=int, default=2, help="optimizer steps per GRPO step")
    p.add_argument("--lr", type=float, default=3e-4, help="GRPO learning rate (AdamW; default %(default)s)")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--tis-cap", type=float, default=rc.DEFAULT_TIS_CAP, help="TIS cap of the *_tis arms")
    p.add_argument("--reward", choices=REWARDS, default="digits")
    p.add_argument("--init-reward", type=float, default=0.75,
                   help="warm-start target: sampled held-out reward at which supervised training stops "
                        "(default %(default)s)")
    p.add_argument("--sft-max-steps", type=int, default=600)
    p.add_argument("--sft-batch-size", type=int, default=512)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--sft-check-every", type=int, default=5)
    p.add_argument("--eval-n", type=int, default=256, help="held-out problems for the warm-start and greedy checks")
    p.add_argument("--min-digits", type=int, default=T.DEFAULT_TASK["min_digits"])
    p.add_argument("--max-digits", type=int, default=T.DEFAULT_TASK["max_digits"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port-base", type=int, default=30100, help="server ports: port-base, port-base + 1, ...")
    p.add_argument("--mem-fraction-static", type=float, default=0.6,
                   help="per server; the KV pool is capped by --max-total-tokens, so servers that start together and "
                        "the trainer share the GPU (default %(default)s)")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV-cache tokens per server")
    p.add_argument("--server-timeout", type=float, default=400.0, help="seconds to wait for the servers")
    p.add_argument("--server-args", default="", help="extra flags for every server (one shell-quoted string)")
    p.add_argument("--fp8kv-server-args", default="",
                   help="extra flags for the fp8kv server, e.g. '--fp8rl-kv-scales calibrate'")
    p.add_argument("--work", default=None, help="folder for the initial checkpoint (default: a new temp folder)")
    p.add_argument("--log-every", type=int, default=5, help="progress line every N steps")
    p.add_argument("--summary-window", type=int, default=10, help="steps averaged for first/last reward")
    p.add_argument("--device", default=None, help="trainer device (default: cuda if available, else cpu)")
    args = p.parse_args(argv)
    try:
        [parse_arm(n) for n in args.arms]
    except ValueError as e:
        p.error(str(e))
    if args.group_size < 2 or args.minibatches < 1 or args.prompts_per_step < 1 or args.steps < 1:
        p.error("need --group-size >= 2, --minibatches >= 1, --prompts-per-step >= 1, --steps >= 1")
    if args.minibatches > args.prompts_per_step * args.group_size:
        p.error("--minibatches exceeds the samples per step")
    return args


if __name__ == "__main__":
    sys.exit(main())
