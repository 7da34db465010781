"""Metrics of scripts/accuracy_regression.py, pure Python: KL divergence of two {token: logprob} dicts, top-1
agreement, token_mult_prob_error, percentiles and summaries, the per-position distributions and token logprobs of
SGLang's scoring requests, `compare` (every metric from two engines' records) and `format_table` (the table)."""

from __future__ import annotations

import math

from accuracy_console import say

# ----------------------------------------------------------------------------------------------------------------
# metrics (pure python; unit-tested in tests/test_scripts_metrics.py)
# ----------------------------------------------------------------------------------------------------------------

def _logsumexp(xs) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def top_entries_to_dict(entries) -> dict:
    """SGLang top-logprob entries [(logprob, token_id, text|None), ...] (or None) -> {token_id: logprob}."""
    if not entries:
        return {}
    return {int(e[1]): float(e[0]) for e in entries if e is not None and e[0] is not None}


def kl_divergence(p: dict, q: dict) -> tuple[float, float, int]:
    """KL(P || Q) from two {token: logprob} dicts.

    Both are restricted to the tokens they share and renormalized there; with complete distributions (top-K = vocab)
    the restriction is the whole vocabulary and this is the exact KL. Returns (kl, coverage, n_common) where
    coverage = P's probability mass on the shared tokens (before renormalization)."""
    common = [t for t in p if t in q]
    if not common:
        return float("nan"), 0.0, 0
    lp = [p[t] for t in common]
    lq = [q[t] for t in common]
    zp, zq = _logsumexp(lp), _logsumexp(lq)
    kl = 0.0
    for a, b in zip(lp, lq):
        pa = a - zp
        kl += math.exp(pa) * (pa - (b - zq))
    return max(kl, 0.0), math.exp(zp), len(common)


def argmax_token(d: dict):
    return max(d.items(), key=lambda kv: (kv[1], -kv[0]))[0] if d else None


def token_mult_prob_error(lp_a, lp_b) -> float:
    """NeMo-RL's token_mult_prob_error: mean over tokens of exp(|logp_a - logp_b|) (1.0 = identical); pairs with a
    None are skipped. Computed by sglang_fp8rl.rollout_correction (float64 here)."""
    pairs = [(a, b) for a, b in zip(lp_a, lp_b) if a is not None and b is not None]
    if not pairs:
        return float("nan")
    import torch

    from sglang_fp8rl.rollout_correction import token_mult_prob_error as tmpe

    a = torch.tensor([x for x, _ in pairs], dtype=torch.float64)
    b = torch.tensor([y for _, y in pairs], dtype=torch.float64)
    return float(tmpe(a, b, torch.ones_like(a)))


def matching_prefix_len(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def percentile(xs, q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(xs) -> dict:
    xs = [x for x in xs if x == x]
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p99": None, "max": None}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99),
            "max": max(xs)}


def scoring_dists(meta: dict, seq_len: int) -> list[dict]:
    """Per-position next-token distributions from a scoring request (input_ids = seq, logprob_start_len=0).

    SGLang's input_top_logprobs has one row per input position, row 0 None; row i (i >= 1) is the distribution that
    predicts input token i. Returns seq_len - 1 dicts: element j predicts seq[j + 1]."""
    rows = meta.get("input_top_logprobs")
    if rows is None:
        raise KeyError("meta_info has no input_top_logprobs (return_logprob / top_logprobs_num not honoured?)")
    rows = _align_rows(rows, seq_len, "input_top_logprobs")
    return [top_entries_to_dict(r) for r in rows[1:]]


_WARNED = set()


def _align_rows(rows, seq_len, what):
    """Rows are expected for input positions 0..seq_len-1; if SGLang returned fewer (e.g. a cached prefix), they are
    the last ones: pad the front with None so indices stay aligned (and warn once)."""
    rows = list(rows)
    if len(rows) != seq_len:
        if what not in _WARNED:
            _WARNED.add(what)
            say(f"WARNING: {what} has {len(rows)} rows for {seq_len} input tokens; aligning at the end")
        rows = ([None] * (seq_len - len(rows)) + rows) if len(rows) < seq_len else rows[len(rows) - seq_len:]
    return rows


def scoring_token_logprobs(meta: dict, seq_len: int) -> list:
    """Logprob of each actual input token (index j -> token j + 1), from input_token_logprobs (row 0 is None)."""
    rows = _align_rows(meta.get("input_token_logprobs") or [], seq_len, "input_token_logprobs")
    return [None if r is None or r[0] is None else float(r[0]) for r in rows[1:]]


def output_logprobs(meta: dict) -> list:
    return [None if r[0] is None else float(r[0]) for r in (meta.get("output_token_logprobs") or [])]


def compare(prompts, bf16, fp8, hf=None, task_answers=None, decode_fn=None) -> dict:
    """All metrics from the collected records.

    prompts: list of token-id lists. bf16 / fp8: {"gen": [{"output_ids", "logprobs"}...],
    "score": [{"dists": [...], "token_logprobs": [...]}...]} with scoring over prompt + BF16 continuation.
    hf: {"bf16": [[lp per generated token]...], "fp8": [...]} (teacher-forced reference logprobs) or None."""
    kl_prompt, kl_cont, cov, top1_prompt, top1_cont = [], [], [], [], []
    kl_by_pos, nonfinite = {}, 0
    for i, pr in enumerate(prompts):
        P, Q = bf16["score"][i]["dists"], fp8["score"][i]["dists"]
        for j, (p, q) in enumerate(zip(P, Q)):
            if not p or not q:
                continue
            kl, c, _ = kl_divergence(p, q)
            nonfinite += not math.isfinite(kl)
            same = argmax_token(p) == argmax_token(q)
            if j + 1 >= len(pr):  # predicts a continuation token
                kl_cont.append(kl)
                top1_cont.append(same)
                kl_by_pos.setdefault(j + 1 - len(pr), []).append(kl)
            else:
                kl_prompt.append(kl)
                top1_prompt.append(same)
            cov.append(c)
    res = {
        "kl_continuation": summarize(kl_cont),
        "kl_prompt": summarize(kl_prompt),
        "kl_all": summarize(kl_cont + kl_prompt),
        "kl_coverage_min": min(cov) if cov else None,
        "kl_coverage_mean": sum(cov) / len(cov) if cov else None,
        "top1_agreement_continuation": sum(top1_cont) / len(top1_cont) if top1_cont else None,
        "top1_agreement_prompt": sum(top1_prompt) / len(top1_prompt) if top1_prompt else None,
        "kl_mean_by_continuation_pos": {k: sum(v) / len(v) for k, v in sorted(kl_by_pos.items())},
        "kl_nonfinite": nonfinite,  # NaN / inf KL positions (summaries drop NaN): a broken distribution
    }
    # token_mult_prob_error, engine-only: FP8 vs BF16 scoring of the BF16 continuations
    a, b = [], []
    for i, pr in enumerate(prompts):
        la, lb = bf16["score"][i]["token_logprobs"], fp8["score"][i]["token_logprobs"]
        start = len(pr) - 1  # index j predicts token j + 1; continuation tokens start at len(pr)
        a += la[start:]
        b += lb[start:]
    res["tmpe_fp8_vs_bf16_engine_scoring"] = token_mult_prob_error(a, b)
    if hf:
        for name, rec in (("bf16", bf16), ("fp8", fp8)):
            ga, gb = [], []
            for g, ref in zip(rec["gen"], hf[name]):
                n = min(len(g["logprobs"]), len(ref))
                ga += g["logprobs"][:n]
                gb += ref[:n]
            res[f"tmpe_{name}_rollout_vs_hf_bf16"] = token_mult_prob_error(ga, gb)
            res[f"tmpe_{name}_rollout_vs_hf_bf16_tokens"] = len(ga)
    # greedy continuation agreement
    same, pref, lens = 0, [], []
    for g1, g2 in zip(bf16["gen"], fp8["gen"]):
        same += g1["output_ids"] == g2["output_ids"]
        pref.append(matching_prefix_len(g1["output_ids"], g2["output_ids"]))
        lens.append(len(g1["output_ids"]))
    n = max(1, len(bf16["gen"]))
    res["greedy_identical_fraction"] = same / n
    res["greedy_mean_matching_prefix"] = sum(pref) / n
    res["greedy_mean_bf16_length"] = sum(lens) / n
    if task_answers is not None and decode_fn is not None:
        for name, rec in (("bf16", bf16), ("fp8", fp8)):
            ok = [decode_fn(g["output_ids"]) == ans for g, ans in zip(rec["gen"], task_answers)]
            res[f"task_exact_match_{name}"] = sum(ok) / max(1, len(ok))
    return res


def _fmt(v, f="{:.4g}"):
    return "—" if v is None or (isinstance(v, float) and v != v) else f.format(v)


def format_table(res: dict, meta: dict) -> str:
    kc, kp = res["kl_continuation"], res["kl_prompt"]
    exact = meta.get("kl_exact")
    lines = [f"## Accuracy regression: BF16 vs {meta.get('quantization')} on {meta.get('model')} "
             f"({meta.get('n_prompts')} prompts, greedy, top-{meta.get('top_k')} logprobs, "
             f"{'exact full-vocabulary KL' if exact else 'top-K intersection KL (approximate)'})",
             "", "| metric | value |", "| --- | --- |",
             f"| KL(BF16‖FP8) continuation positions: mean / p99 / max (n) | {_fmt(kc['mean'])} / {_fmt(kc['p99'])} / "
             f"{_fmt(kc['max'])} ({kc['n']}) |",
             f"| KL(BF16‖FP8) prompt positions: mean / p99 / max (n) | {_fmt(kp['mean'])} / {_fmt(kp['p99'])} / "
             f"{_fmt(kp['max'])} ({kp['n']}) |",
             f"| top-1 agreement continuation / prompt | {_fmt(res['top1_agreement_continuation'], '{:.4f}')} / "
             f"{_fmt(res['top1_agreement_prompt'], '{:.4f}')} |"]
    if not exact:
        lines.append(f"| KL coverage (BF16 mass on shared top-K) min / mean | {_fmt(res['kl_coverage_min'])} / "
                     f"{_fmt(res['kl_coverage_mean'])} |")
    if "tmpe_fp8_rollout_vs_hf_bf16" in res:
        lines.append(f"| token_mult_prob_error FP8 rollout vs HF BF16 | "
                     f"{_fmt(res['tmpe_fp8_rollout_vs_hf_bf16'], '{:.5f}')} |")
        lines.append(f"| token_mult_prob_error BF16 rollout vs HF BF16 (floor) | "
                     f"{_fmt(res['tmpe_bf16_rollout_vs_hf_bf16'], '{:.5f}')} |")
    lines.append(f"| token_mult_prob_error FP8 vs BF16 engine scoring (BF16 rollouts) | "
                 f"{_fmt(res['tmpe_fp8_vs_bf16_engine_scoring'], '{:.5f}')} |")
    lines.append(f"| greedy continuation identical | {_fmt(res['greedy_identical_fraction'], '{:.4f}')} "
                 f"(mean matching prefix {_fmt(res['greedy_mean_matching_prefix'], '{:.2f}')} of "
                 f"{_fmt(res['greedy_mean_bf16_length'], '{:.2f}')} tokens) |")
    if "task_exact_match_bf16" in res:
        hf = res.get("task_exact_match_hf")
        lines.append(f"| task exact match BF16 engine / FP8 engine / HF greedy | "
                     f"{_fmt(res['task_exact_match_bf16'], '{:.4f}')} / {_fmt(res['task_exact_match_fp8'], '{:.4f}')}"
                     f" / {_fmt(hf, '{:.4f}')} |")
    for k in ("bf16", "fp8"):
        if meta.get(f"engine_{k}_s") is not None:
            lines.append(f"| engine {k}: start / generate+score seconds | {meta[f'engine_{k}_s'][0]:.0f} / "
                         f"{meta[f'engine_{k}_s'][1]:.0f} |")
    if meta.get("fp8rl"):
        lines.append("")
        lines.append("fp8 engine: " + meta["fp8rl"][0][:300])
    return "\n".join(lines)
