"""Rollout correction for RL with a quantized rollout engine: importance weights and mismatch metrics (pure torch).

When the rollout engine samples from a policy that differs numerically from the trainer's (FP8 weights or KV cache,
other kernels, other reduction orders), policy-gradient RL is silently off-policy. This module gives the correction
weights and the mismatch metrics that the RL frameworks use, on per-token log-probabilities. It imports no SGLang.

Notation, per generated token t of a response sampled from the rollout policy:

* ``logp_train``: log pi_train(y_t | ...), recomputed by the trainer on the sampled tokens before the update (NeMo-RL
  ``prev_logprobs``, verl ``old_log_prob``);
* ``logp_rollout``: log pi_rollout(y_t | ...), returned by the engine with the sample (NeMo-RL
  ``generation_logprobs``, verl ``rollout_log_probs``; SGLang ``return_logprob``);
* ``delta_t = logp_train - logp_rollout`` and the importance ratio ``rho_t = exp(delta_t)``;
* ``mask``: 1 for response tokens that count, 0 for padding (float weights are accepted where noted).

Formulas and sources:

* Truncated importance sampling (TIS): ``w_t = min(rho_t, C)``, detached, multiplies the per-token policy-gradient
  loss. F. Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (2025,
  https://fengyao.notion.site/off-policy-rl); verl ``docs/algo/rollout_corr.md`` (``rollout_is: token``,
  ``rollout_is_threshold: 2.0``); NeMo-RL ``nemo_rl/algorithms/loss_functions.py`` (``truncated_importance_sampling_
  type: tis``: ``clamp(exp(prev_logprobs - generation_logprobs), max=ratio)``). verl's FP8 rollout docs use C = 2.
* ``token_mult_prob_error = sum(mask * exp(|delta_t|)) / sum(mask)`` (1.0 = identical): NeMo-RL
  ``loss_functions.py`` (``ClippedPGLossFn``, ``lp_error = |generation_logprobs - prev_logprobs|``) and
  ``docs/guides/grpo.md#metrics``.
* KL(pi_rollout || pi_train) from samples of pi_rollout, with ``r = pi_train / pi_rollout = rho_t`` (J. Schulman,
  "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html; NeMo-RL ``gen_kl_error`` via
  ``nemo_rl/algorithms/utils.py:calculate_kl``):
  ``k1 = -log r = -delta`` (unbiased, a single token can be negative),
  ``k2 = (log r)^2 / 2`` (biased, low variance),
  ``k3 = (r - 1) - log r`` (unbiased, never negative).
* Sequence-level masked importance sampling (MIS / rejection): drop whole sequences whose ratio leaves [lo, hi].
  ``mode="geometric"`` (default) uses the geometric mean of the token ratios, ``exp(mean_t delta_t)``;
  ``mode="product"`` uses the sequence likelihood ratio ``exp(sum_t delta_t)``. verl ``rollout_rs: geometric`` /
  ``sequence``; NeMo-RL ``seq-mask-tis`` (geometric); J. Liu, Y. Li et al., "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch" (2025). The geometric mean is the default because
  the product's log grows linearly with the length, so one fixed [lo, hi] would reject long responses far more often
  than short ones for the same per-token mismatch; the geometric mean is length-normalized, so one band means the
  same per-token mismatch at every length. The product is the exact sequence importance weight; use it when that is
  what you need (short, fixed-length responses).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

DEFAULT_TIS_CAP = 2.0
KL_ESTIMATORS = ("k1", "k2", "k3")
SEQUENCE_MODES = ("geometric", "product")
KLEstimator = Literal["k1", "k2", "k3"]
SequenceMode = Literal["geometric", "product"]
_K3_SERIES_BELOW = 1e-2


def _check_tensor(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor of log-probabilities, got {x.dtype}")


def _check_pair(logp_a: torch.Tensor, logp_b: torch.Tensor, names: tuple[str, str]) -> None:
    _check_tensor(logp_a, names[0])
    _check_tensor(logp_b, names[1])
    if logp_a.shape != logp_b.shape:
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape, got {tuple(logp_a.shape)} and "
                         f"{tuple(logp_b.shape)}")


def _check_mask(mask: torch.Tensor, shape: torch.Size) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"mask must have the log-probabilities' shape {tuple(shape)}, got {tuple(mask.shape)}")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32: BF16 log-probabilities would round exp(delta) to 3 significant digits."""
    return torch.promote_types(x.dtype, torch.float32)


def log_ratio(logp_train: torch.Tensor, logp_rollout: torch.Tensor) -> torch.Tensor:
    """delta = logp_train - logp_rollout per token, detached, in at least float32."""
    _check_pair(logp_train, logp_rollout, ("logp_train", "logp_rollout"))
    dtype = torch.promote_types(_work_dtype(logp_train), _work_dtype(logp_rollout))
    return logp_train.detach().to(dtype) - logp_rollout.detach().to(dtype)


def _weighted(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """weights * values, with masked-out positions exactly 0 even where padding holds inf or NaN."""
    return torch.where(weights != 0, weights * values, torch.zeros((), dtype=values.dtype, device=values.device))


def _mask_total(weights: torch.Tensor) -> torch.Tensor:
    total = weights.sum()
    if not bool(total > 0):
        raise ValueError(f"mask selects no token (sum(mask) = {float(total)}); nothing to average")
    return total


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(mask * values) / sum(mask) as a 0-d tensor (padding values ignored); ValueError if the mask is empty."""
    _check_mask(mask, values.shape)
    weights = mask.to(values.dtype)
    return _weighted(values, weights).sum() / _mask_total(weights)


def _k3(delta: torch.Tensor) -> torch.Tensor:
    """(e^d - 1) - d without cancellation: below |d| = 1e-2 its Taylor series to d^9, d^2/2 (1 + d/3 (1 + d/4 (...
    (1 + d/8)))), whose truncation (about 5.5e-7 d^8 relative) is below float64's rounding there, because
    expm1(d) - d loses all digits in float32 for FP8-sized |d| ~ 1e-6 (and digits in float64 near |d| ~ 1e-8)."""
    inner = torch.ones_like(delta)
    for k in range(8, 2, -1):  # Horner, innermost term first: 1 + d/k (1 + d/(k+1) (...))
        inner = 1 + delta / k * inner
    series = 0.5 * delta.square() * inner
    return torch.where(delta.abs() < _K3_SERIES_BELOW, series, torch.expm1(delta) - delta)


def tis_weights(logp_train: torch.Tensor, logp_rollout: torch.Tensor, cap: float = DEFAULT_TIS_CAP) -> torch.Tensor:
    """Truncated importance weights min(exp(logp_train - logp_rollout), cap) per token, detached."""
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    return torch.clamp(torch.exp(log_ratio(logp_train, logp_rollout)), max=cap)


def token_mult_prob_error(logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """NeMo-RL's sum(mask * exp(|logp_a - logp_b|)) / sum(mask) as a 0-d tensor (1.0 = identical)."""
    delta = log_ratio(logp_a, logp_b)
    return 1 + masked_mean(torch.expm1(delta.abs()), mask)


def kl_per_token(logp_train: torch.Tensor, logp_rollout: torch.Tensor,
                 estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_rollout || pi_train) for tokens sampled from pi_rollout (k1, k2 or k3)."""
    delta = log_ratio(logp_train, logp_rollout)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta.square()
    if estimator == "k3":
        return _k3(delta)
    raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def rollout_kl(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
               estimator: KLEstimator = "k3") -> torch.Tensor:
    """Masked mean of kl_per_token: the sample estimate of KL(pi_rollout || pi_train) (NeMo-RL gen_kl_error)."""
    return masked_mean(kl_per_token(logp_train, logp_rollout, estimator), mask)


def clip_fraction(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                  cap: float = DEFAULT_TIS_CAP, lo: float | None = None) -> torch.Tensor:
    """Fraction of masked tokens whose ratio exceeds cap (TIS truncates them), or falls below lo if given."""
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    if lo is not None and not 0 <= lo <= cap:
        raise ValueError(f"lo must be in [0, cap={cap}], got {lo}")
    delta = log_ratio(logp_train, logp_rollout)
    # compare in log space: exp(delta) overflows to inf for delta > 88 in float32, which would still compare right,
    # but log space also keeps lo = 0 exact (log 0 = -inf rejects nothing)
    out = delta > math.log(cap)
    if lo is not None:
        out = out | (delta < (math.log(lo) if lo > 0 else -math.inf))
    return masked_mean(out.to(delta.dtype), mask)


def sequence_log_ratio(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                       mode: SequenceMode = "geometric") -> torch.Tensor:
    """Per-sequence log importance ratio over the last dimension: mean_t delta (geometric) or sum_t delta (product).

    A sequence whose mask is all zero gets 0 (ratio 1): it has no token to weigh."""
    if mode not in SEQUENCE_MODES:
        raise ValueError(f"mode must be one of {SEQUENCE_MODES}, got {mode!r}")
    delta = log_ratio(logp_train, logp_rollout)
    _check_mask(mask, delta.shape)
    if delta.dim() < 1:
        raise ValueError("sequence_log_ratio needs at least one (token) dimension")
    weights = mask.to(delta.dtype)
    total = _weighted(delta, weights).sum(dim=-1)
    if mode == "product":
        return total
    count = weights.sum(dim=-1)
    return torch.where(count > 0, total / count.clamp(min=torch.finfo(delta.dtype).tiny), torch.zeros_like(total))


def sequence_mask(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor, lo: float, hi: float,
                  mode: SequenceMode = "geometric") -> torch.Tensor:
    """Bool keep-mask per sequence: True where lo <= sequence ratio <= hi (masked importance sampling).

    Apply it to the loss mask (``mask * keep[..., None]``), not to the weights, so that rejected tokens also leave the
    loss denominator (verl's rollout_corr design; slime PR #657)."""
    if not 0 <= lo <= hi:
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    if hi == 0:
        raise ValueError("hi must be positive: a ratio of 0 would keep nothing")
    s = sequence_log_ratio(logp_train, logp_rollout, mask, mode)
    log_lo = math.log(lo) if lo > 0 else -math.inf
    return (s >= log_lo) & (s <= math.log(hi))


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                     cap: float = DEFAULT_TIS_CAP) -> dict[str, float]:
    """All per-step mismatch metrics as Python floats, computed in float64 and read back in one transfer.

    float64 keeps ``token_mult_prob_error - 1`` and ``kl_k3`` resolvable down to ~1e-15 (a BF16 engine's own
    mismatch can be ~1e-8). Keys: token_mult_prob_error, kl_k1, kl_k2, kl_k3 (KL(pi_rollout || pi_train)),
    tis_clip_fraction (rho > cap), is_ratio_mean (mean rho), max_abs_log_ratio, seq_geo_log_ratio_abs_max (max
    |mean_t delta| over sequences with tokens), tokens (sum of the mask)."""
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    delta = log_ratio(logp_train, logp_rollout).to(torch.float64)
    _check_mask(mask, delta.shape)
    if delta.dim() < 1:
        raise ValueError("mismatch_metrics needs at least one (token) dimension")
    m = mask.to(torch.float64)
    n = _mask_total(m)
    used = m != 0
    geo = sequence_log_ratio(delta, torch.zeros_like(delta), mask, "geometric").abs()[used.any(dim=-1)]
    stats = torch.stack([
        1 + _weighted(torch.expm1(delta.abs()), m).sum() / n,
        _weighted(-delta, m).sum() / n,
        _weighted(0.5 * delta.square(), m).sum() / n,
        _weighted(_k3(delta), m).sum() / n,
        _weighted((delta > math.log(cap)).to(delta.dtype), m).sum() / n,
        _weighted(torch.exp(delta), m).sum() / n,
        delta.abs()[used].max(),
        geo.max(),
        n,
    ])
    keys = ("token_mult_prob_error", "kl_k1", "kl_k2", "kl_k3", "tis_clip_fraction", "is_ratio_mean",
            "max_abs_log_ratio", "seq_geo_log_ratio_abs_max", "tokens")
    return dict(zip(keys, (float(v) for v in stats.tolist())))
