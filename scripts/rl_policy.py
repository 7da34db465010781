"""The torch policy of scripts/rl_regression.py: the Qwen3 toy of train_toy_policy.py at a --model-size, its
teacher-forced response log-probs, torch sampling, the BF16 copy of its weights that an engine serves, the
supervised warm start to --init-reward, and the BF16 HF checkpoint the servers start from."""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import time

import torch
import train_toy_policy as T
from rl_grpo import reward
from rl_report import say

MODEL_SIZES = {"toy": {}, "tiny": dict(hidden=128, layers=2, heads=1, kv_heads=1, head_dim=128, intermediate=256)}


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
    T.mark_config_bf16(out)
