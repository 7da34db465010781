"""The pure part of scripts/rl_regression.py: the reward of an answer, GRPO's group-normalized advantages and
PPO-clipped loss (with optional TIS weights), the packing of sampled rollouts into trainer tensors, and the
per-step record of one arm (keys STEP_KEYS)."""

from __future__ import annotations

import statistics

import torch
import train_toy_policy as T

from sglang_fp8rl import rollout_correction as rc

REWARDS = ("digits", "exact")
STEP_KEYS = ("step", "reward", "exact_match", "response_len", "token_mult_prob_error", "kl_k1", "kl_k2", "kl_k3",
             "tis_clip_fraction", "is_ratio_mean", "max_abs_log_ratio", "seq_geo_log_ratio_abs_max",
             "ppo_clip_fraction", "loss", "grad_norm", "tokens", "push_s", "rollout_s", "train_s")


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
