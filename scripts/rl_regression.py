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
import contextlib
import dataclasses
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import _paths  # noqa: F401  (the checkout's sglang_fp8rl serves --dry-run on a bare machine)
import torch
import train_toy_policy as T

from sglang_fp8rl import rollout_correction as rc

# FP8: the toy's GEMMs are tiny, so no load-time GEMM measurement (SGLang's block-FP8 dispatch runs them) and one
# DeepGEMM JIT worker per linear shape (qkv, o_proj, gate_up, down), which keeps a cold start short
_FP8 = ["--quantization", "fp8_online_blockwise", "--fp8rl-gemm-select", "off", "--fp8rl-jit-workers", "4"]
SERVER_KINDS = {"bf16": [], "fp8": _FP8, "fp8kv": [*_FP8, "--kv-cache-dtype", "fp8_e4m3"]}
TIS_SUFFIX = "_tis"
DEFAULT_ARMS = ("bf16", "fp8", "fp8_tis")
COMMON_SERVER_FLAGS = ["--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
                       "--grammar-backend", "none", "--dtype", "bfloat16", "--cuda-graph-backend-prefill", "disabled",
                       "--host", "127.0.0.1"]
MODEL_SIZES = {"toy": {}, "tiny": dict(hidden=128, layers=2, heads=1, kv_heads=1, head_dim=128, intermediate=256)}
REWARDS = ("digits", "exact")
RESERVE_S = 25.0  # final evaluation, outputs and server shutdown after the last step
STEP_KEYS = ("step", "reward", "exact_match", "response_len", "token_mult_prob_error", "kl_k1", "kl_k2", "kl_k3",
             "tis_clip_fraction", "is_ratio_mean", "max_abs_log_ratio", "seq_geo_log_ratio_abs_max",
             "ppo_clip_fraction", "loss", "grad_norm", "tokens", "push_s", "rollout_s", "train_s")
_T0 = time.time()


def say(msg: str) -> None:
    """One progress line on stderr, with wall time since start."""
    print(f"[rl {time.strftime('%H:%M:%S')} +{time.time() - _T0:.0f}s] {msg}", file=sys.stderr, flush=True)


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
# task, reward, GRPO (pure; tested on CPU in tests/test_rl_regression_cpu.py)
# ----------------------------------------------------------------------------------------------------------------

def reward(tokens: list[int], answer: list[int], kind: str = "digits") -> float:
    """Per-position partial credit over the answer tokens (digits), or 1.0 for the whole answer right (exact)."""
    if kind == "exact":
        return float(list(tokens) == list(answer))
    if kind != "digits":
        raise ValueError(f"reward kind must be one of {REWARDS}, got {kind!r}")
    return sum(i < len(tokens) and int(tokens[i]) == a for i, a in enumerate(answer)) / len(answer)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps) over consecutive groups of group_size samples of one prompt."""
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"need a 1-d reward vector split into groups of >= 2, got {tuple(rewards.shape)} and "
                         f"group_size {group_size}")
    g = rewards.reshape(-1, group_size).to(torch.float32)
    return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)).reshape(-1)


def grpo_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, logp_rollout: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip_eps: float, tis_cap: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clipped token-mean loss [N, R] with per-sequence advantages [N]; times TIS weights when tis_cap is set."""
    ratio = torch.exp(logp_new - logp_old.detach())
    a = adv[:, None].to(ratio.dtype)
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    if tis_cap is not None:
        per_token = per_token * rc.tis_weights(logp_old, logp_rollout, tis_cap)
    loss = rc.masked_mean(per_token, mask)
    clipped = ((ratio - 1).abs() > clip_eps).to(ratio.dtype).detach()
    return loss, {"ppo_clip_fraction": float(rc.masked_mean(clipped, mask))}


def pack_rollouts(prompts: list[list[int]], samples: list[tuple[list[int], list[float]]],
                  max_new: int) -> dict[str, torch.Tensor]:
    """Prompts (all one length) + sampled (tokens, logprobs) -> ids/attention [N, P+R], mask/rollout logp [N, R]."""
    if len(prompts) != len(samples):
        raise ValueError(f"{len(prompts)} prompts but {len(samples)} samples")
    plen = {len(p) for p in prompts}
    if len(plen) != 1:
        raise ValueError(f"prompts must share one length (fixed-width operands), got lengths {sorted(plen)}")
    p = plen.pop()
    n = len(prompts)
    ids = torch.full((n, p + max_new), T.PAD, dtype=torch.long)
    attn = torch.zeros((n, p + max_new), dtype=torch.long)
    mask = torch.zeros((n, max_new), dtype=torch.float32)
    lp = torch.zeros((n, max_new), dtype=torch.float32)
    for i, (prompt, (toks, lps)) in enumerate(zip(prompts, samples)):
        if len(toks) != len(lps) or not 0 < len(toks) <= max_new:
            raise ValueError(f"sample {i}: {len(toks)} tokens, {len(lps)} logprobs (max_new_tokens {max_new})")
        k = len(toks)
        ids[i, :p] = torch.tensor(prompt)
        ids[i, p:p + k] = torch.tensor(toks)
        attn[i, :p + k] = 1
        mask[i, :k] = 1
        lp[i, :k] = torch.tensor(lps, dtype=torch.float32)
    return {"ids": ids, "attn": attn, "mask": mask, "rollout_logp": lp, "prompt_len": torch.tensor(p)}


def step_record(step: int, rewards: list[float], exact: list[float], lengths: list[int], mismatch: dict,
                train: dict, times: dict) -> dict:
    """The per-step, per-arm record (keys STEP_KEYS)."""
    rec = {"step": step, "reward": statistics.fmean(rewards), "exact_match": statistics.fmean(exact),
           "response_len": statistics.fmean(lengths), **{k: mismatch[k] for k in (
               "token_mult_prob_error", "kl_k1", "kl_k2", "kl_k3", "tis_clip_fraction", "is_ratio_mean",
               "max_abs_log_ratio", "seq_geo_log_ratio_abs_max", "tokens")},
           **{k: train[k] for k in ("ppo_clip_fraction", "loss", "grad_norm")},
           **{k: times[k] for k in ("push_s", "rollout_s", "train_s")}}
    missing = set(STEP_KEYS) - set(rec)
    if missing:
        raise KeyError(f"step record lacks {sorted(missing)}")
    return {k: rec[k] for k in STEP_KEYS}


# ----------------------------------------------------------------------------------------------------------------
# policy (torch)
# ----------------------------------------------------------------------------------------------------------------

def autocast(device: torch.device):
    """BF16 autocast on CUDA (as train_toy_policy.py trains), nothing on CPU."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_policy(size: str, seed: int, device: torch.device):
    """A fresh fp32 Qwen3 toy policy (train_toy_policy.py's config) with dims of --model-size."""
    from transformers import Qwen3ForCausalLM

    targs = T.parse_args(["--out", "unused"])
    for k, v in MODEL_SIZES[size].items():
        setattr(targs, k, v)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(T.model_config(targs)).to(device=device, dtype=torch.float32)


def response_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """log pi(token) of every response position [N, R] (float32), teacher-forced on prompt + response."""
    with autocast(ids.device):
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    lp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
    return lp.gather(-1, ids[:, prompt_len:, None]).squeeze(-1)


@torch.no_grad()
def sample_torch(model, prompts: list[list[int]], max_new: int, temperature: float,
                 generator: torch.Generator) -> list[tuple[list[int], list[float]]]:
    """Autoregressive sampling in torch (no KV cache: answers are 7 tokens): (tokens up to <eos>, logprobs) each."""
    device = next(model.parameters()).device
    seq = torch.tensor(prompts, dtype=torch.long, device=device)
    toks, lps = [], []
    for _ in range(max_new):
        with autocast(device):
            logits = model(input_ids=seq, use_cache=False).logits[:, -1].float()
        logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
        if temperature == 0:
            tok = logp.argmax(dim=-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        toks.append(tok)
        lps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
        seq = torch.cat([seq, tok[:, None]], dim=1)
    out = []
    for t, lp in zip(torch.stack(toks, 1).tolist(), torch.stack(lps, 1).tolist()):
        k = t.index(T.EOS) + 1 if T.EOS in t else len(t)
        out.append((t[:k], lp[:k]))
    return out


def named_bf16(model) -> list[tuple[str, torch.Tensor]]:
    """The HF-named parameters as fresh BF16 tensors (what the engine serves)."""
    return [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]


def sft_warm_start(model, task: dict, args, device: torch.device) -> dict:
    """Supervised training (train_toy_policy's recipe) until the sampled held-out reward reaches --init-reward."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    probs = T.test_problems(args.eval_n, seed=777, task=task)
    prompts = [T.prompt_ids(a, b, task) for a, b in probs]
    answers = [T.answer_ids(a, b, task) for a, b in probs]
    history, t0, step, r = [], time.time(), 0, 0.0
    while step < args.sft_max_steps:
        step += 1
        for g in opt.param_groups:
            g["lr"] = args.sft_lr * min(1.0, step / 50)
        ids, labels = T.make_batch(rng, args.sft_batch_size, task, device)
        with autocast(device):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.sft_check_every == 0 or step == args.sft_max_steps:
            samples = sample_torch(model, prompts, T.max_answer_tokens(task), 1.0, gen)
            r = statistics.fmean(reward(s[0], a, args.reward) for s, a in zip(samples, answers))
            history.append({"step": step, "loss": float(loss.detach()), "sampled_reward": r})
            if r >= args.init_reward:
                break
    say(f"warm start: {step} supervised steps in {time.time() - t0:.1f} s, sampled held-out reward {r:.3f} "
        f"(target {args.init_reward})")
    return {"steps": step, "seconds": time.time() - t0, "sampled_reward": r, "history": history}


def save_checkpoint(model, out: str) -> None:
    """HF checkpoint in BF16 + tokenizer, as train_toy_policy.py writes it (what the servers start from)."""
    import copy

    os.makedirs(out, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    T.build_tokenizer().save_pretrained(out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    cfg.setdefault("dtype", "bfloat16")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


# ----------------------------------------------------------------------------------------------------------------
# rollout engines: the SGLang server, or torch sampling for --dry-run
# ----------------------------------------------------------------------------------------------------------------

def server_command(kind: str, model_dir: str, port: int, args) -> list[str]:
    """`python -m sglang.launch_server` for one server kind; one decode CUDA graph at the rollout batch size."""
    extra = shlex.split(args.server_args) + (shlex.split(args.fp8kv_server_args) if kind == "fp8kv" else [])
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port", str(port),
            "--mem-fraction-static", str(args.mem_fraction_static), "--max-total-tokens", str(args.max_total_tokens),
            "--cuda-graph-bs-decode", str(args.prompts_per_step * args.group_size), "--random-seed", str(args.seed),
            *COMMON_SERVER_FLAGS, *SERVER_KINDS[kind], *extra]


def parse_generate_output(out: dict) -> tuple[list[int], list[float]]:
    """One /generate answer -> (sampled token ids, their logprobs), from meta_info.output_token_logprobs."""
    rows = (out.get("meta_info") or {}).get("output_token_logprobs")
    if rows is None:
        raise KeyError("meta_info has no output_token_logprobs (was return_logprob honoured?)")
    toks, lps = [int(r[1]) for r in rows], [float(r[0]) for r in rows]
    if "output_ids" in out and list(out["output_ids"]) != toks:
        raise ValueError(f"output_ids {out['output_ids']} differ from the logprob rows' tokens {toks}")
    return toks, lps


class ServerEngine:
    """A stock SGLang HTTP server: weights pushed by CUDA IPC, samples from /generate."""

    def __init__(self, url: str, timeout: float = 300.0):
        self.url, self.timeout = url, timeout

    def push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from sglang_fp8rl.trainer import push_state_dict

        torch.cuda.synchronize()  # the BF16 copies must be written before the server reads them through IPC
        push_state_dict(self.url, named)

    def generate(self, prompts: list[list[int]], max_new: int, temperature: float) -> list:
        import requests

        sp = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": max_new,
              "stop_token_ids": [T.EOS]}
        r = requests.post(self.url + "/generate", json={"input_ids": prompts, "sampling_params": sp,
                                                          "return_logprob": True}, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered HTTP {r.status_code}: {r.text[:500]}")
        outs = r.json()
        return [parse_generate_output(o) for o in (outs if isinstance(outs, list) else [outs])]


def fake_fp8(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Decoder linear weights through the blockwise FP8 round trip (sglang_fp8rl.quant); the rest unchanged."""
    from sglang_fp8rl import quant

    out = []
    for name, w in named:
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            w = quant.dequantize_blockwise(*quant.quantize_blockwise(w)).to(torch.bfloat16)
        out.append((name, w))
    return out


class TorchEngine:
    """--dry-run engine: a BF16 copy of the policy (FP8 round trip of the linears for fp8 kinds), sampled in torch."""

    def __init__(self, kind: str, model, seed: int):
        import copy

        self.kind, self.model = kind, copy.deepcopy(model).to(torch.bfloat16).eval()
        self.gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    @torch.no_grad()
    def push(self, named: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        for name, w in (fake_fp8(named) if self.kind != "bf16" else named):
            params[name].copy_(w)

    def generate(self, prompts: list[list[int]], max_new: int, temperature: float) -> list:
        return sample_torch(self.model, prompts, max_new, temperature, self.gen)


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
# summaries and outputs
# ----------------------------------------------------------------------------------------------------------------

def summarize_arm(records: list[dict], window: int) -> dict:
    """First/last-window means of reward and exact match, mismatch means and maxima, median times."""
    if not records:
        return {"steps": 0}
    w = max(1, min(window, len(records)))

    def mean(key, rows):
        return statistics.fmean(r[key] for r in rows)

    first, last = records[:w], records[-w:]
    return {"steps": len(records), "window": w,
            "reward_first": mean("reward", first), "reward_last": mean("reward", last),
            "exact_first": mean("exact_match", first), "exact_last": mean("exact_match", last),
            "kl_k3_mean": mean("kl_k3", records), "kl_k3_max": max(r["kl_k3"] for r in records),
            "kl_k1_mean": mean("kl_k1", records),
            "tmpe_mean": mean("token_mult_prob_error", records),
            "tmpe_max": max(r["token_mult_prob_error"] for r in records),
            "tis_clip_fraction_mean": mean("tis_clip_fraction", records),
            **{f"{k}_median": statistics.median(r[k] for r in records) for k in ("push_s", "rollout_s", "train_s")}}


def compare_arms(summaries: dict[str, dict], baseline: str = "bf16") -> list[str]:
    """One line per non-baseline arm: its final-window reward minus the baseline's, in points (x100)."""
    base = summaries.get(baseline)
    if not base or not base.get("steps"):
        return []
    lines = []
    for name, s in summaries.items():
        if name == baseline or not s.get("steps"):
            continue
        gap = 100 * (s["reward_last"] - base["reward_last"])
        lines.append(f"{name} vs {baseline}: final reward {gap:+.1f} points (mean of the last {s['window']} steps; "
                     f"mismatch KL k3 {s['kl_k3_mean']:.3g} vs {base['kl_k3_mean']:.3g}, token_mult_prob_error "
                     f"{s['tmpe_mean']:.6f} vs {base['tmpe_mean']:.6f})")
    return lines


def format_markdown(results: dict) -> str:
    """The summary table plus the per-arm comparison lines."""
    m = results["meta"]
    lines = [f"## RL regression: GRPO on the toy addition policy, {m['steps_done']} steps, {m['prompts_per_step']} "
             f"prompts x {m['group_size']} samples, reward `{m['reward']}`, {m['device']}"
             + (" (dry run: torch sampling, no server)" if m.get("dry_run") else ""), "",
             "| arm | rollout | TIS | reward first -> last | sampled exact first -> last | greedy held-out EM start "
             "-> end | gen KL k3 mean (max) | token_mult_prob_error mean (max) | TIS-clipped tokens | push / rollout "
             "/ train ms (median) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, a in results["arms"].items():
        s, ev = a["summary"], a.get("evals", {})
        if not s.get("steps"):
            lines.append(f"| {name} | {a['server']} | {'yes' if a['tis'] else 'no'} | no step | | | | | | |")
            continue
        em = f"{ev.get('start', float('nan')):.3f} -> {ev.get('end', float('nan')):.3f}"
        lines.append(f"| {name} | {a['server']} | {'cap ' + str(m['tis_cap']) if a['tis'] else 'no'} | "
                     f"{s['reward_first']:.3f} -> {s['reward_last']:.3f} | {s['exact_first']:.3f} -> "
                     f"{s['exact_last']:.3f} | {em} | {s['kl_k3_mean']:.3g} ({s['kl_k3_max']:.3g}) | "
                     f"{s['tmpe_mean']:.6f} ({s['tmpe_max']:.6f}) | {s['tis_clip_fraction_mean']:.2e} | "
                     f"{1e3 * s['push_s_median']:.0f} / {1e3 * s['rollout_s_median']:.0f} / "
                     f"{1e3 * s['train_s_median']:.0f} |")
    cmp_lines = compare_arms({k: a["summary"] for k, a in results["arms"].items()})
    if cmp_lines:
        lines += [""] + [f"- {c}" for c in cmp_lines]
    t = m.get("timing", {})
    if t:
        lines += ["", "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items())]
    return "\n".join(lines)


def plot_curves(results: dict, path: str) -> str | None:
    """rl_curves.png: reward, exact match, KL k3, token_mult_prob_error - 1, TIS clip fraction, step times.
    Returns None, or why no picture was written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e}); the numbers are in rl_results.json"
    panels = [("reward", "mean reward", False), ("exact_match", "sampled exact match", False),
              ("kl_k3", "KL(rollout || trainer), k3", True),
              ("token_mult_prob_error", "token_mult_prob_error - 1", True),
              ("tis_clip_fraction", "tokens with ratio > TIS cap", False), ("rollout_s", "rollout / push s", True)]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, (key, title, log) in zip(axes.flat, panels):
        for name, a in results["arms"].items():
            xs = [r["step"] for r in a["records"]]
            ys = [r[key] - 1 if key == "token_mult_prob_error" else r[key] for r in a["records"]]
            if log:
                ys = [max(y, 1e-12) for y in ys]
            line, = ax.plot(xs, ys, label=name, lw=1.2)
            if key == "rollout_s":
                ax.plot(xs, [max(r["push_s"], 1e-12) for r in a["records"]], ls="--", color=line.get_color())
        ax.set_title(title + (" (dashed: push)" if key == "rollout_s" else ""))
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle(f"GRPO on the toy policy: BF16 vs FP8 rollouts ({results['meta']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_outputs(results: dict, out: str) -> None:
    """rl_results.json, summary.md and rl_curves.png into out."""
    for a in results["arms"].values():
        a["summary"] = summarize_arm(a["records"], results["meta"]["summary_window"])
    with open(os.path.join(out, "rl_results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = format_markdown(results)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + "\n")
    try:
        why = plot_curves(results, os.path.join(out, "rl_curves.png"))
    except (ValueError, RuntimeError, OSError, AttributeError) as e:  # the numbers matter more than the picture
        why = f"plotting failed: {e!r}"
    if why:
        say(f"no rl_curves.png: {why}")
    print("\n" + text, flush=True)


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
