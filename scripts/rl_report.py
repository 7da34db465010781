"""Progress lines and outputs of scripts/rl_regression.py: say (one line on stderr with the time since start), the
per-arm summaries and the comparison against the BF16 arm, summary.md, rl_curves.png and rl_results.json."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

_T0 = time.time()


def say(msg: str) -> None:
    """One progress line on stderr, with wall time since start."""
    print(f"[rl {time.strftime('%H:%M:%S')} +{time.time() - _T0:.0f}s] {msg}", file=sys.stderr, flush=True)


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
