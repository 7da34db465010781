"""Where an RL rollout's time goes, by the number of requests decoding at once (bench_rl_rollout.py's report).

From the scheduler's decode log lines of one run (``--decode-log-interval 1``: one line per decode step, whose ``gen
throughput`` is the running requests over the time since the previous line), each step's time is ``running /
throughput``. Steps are grouped in bands of running requests: the tail of a long-tailed rollout is the steps with few
requests left and long contexts; the body is the full batch. Per band: steps, median step time, and the seconds of the
run spent there (the sum of step times, prefills interleaved with those steps included).
"""
from __future__ import annotations

import re
from statistics import median

# bands of running requests: (label, lowest, highest); narrow ones at the tail, where a step's time moves most with the
# count (a wide band would compare one config's 1-request steps with another's 8-request steps)
BANDS = (("1", 1, 1), ("2", 2, 2), ("3-4", 3, 4), ("5-8", 5, 8), ("9-16", 9, 16), ("17-32", 17, 32),
         ("33-64", 33, 64), ("65-128", 65, 128), ("129-256", 129, 256), ("257-384", 257, 384), ("385-512", 385, 512),
         ("513+", 513, 1 << 30))
# a scheduler decode log line up to its running requests (with DP attention SGLang adds the rank: "Decode batch [0]")
DECODE_LINE = r"Decode batch(?: \[\d+\])?, #running-req: (\d+),"
# a decode step's line: its running requests, the KV tokens they hold (``#token``, where the line has it) and the
# generation throughput since the line before
DECODE_STEP = re.compile(DECODE_LINE + r"(?: #token: (\d+),)?.*gen throughput \(token/s\): ([0-9.]+)")


def decode_steps(run_log: list[str]) -> list[tuple[int, float]]:
    """(running requests, step seconds) per decode log line with a positive throughput."""
    steps = []
    for line in run_log:
        m = DECODE_STEP.search(line)
        if m and float(m[3]) > 0:
            steps.append((int(m[1]), int(m[1]) / float(m[3])))
    return steps


def regimes(run_log: list[str]) -> dict[str, dict]:
    """band label -> {steps, median_step_ms, seconds} (bands without steps left out)."""
    steps = decode_steps(run_log)
    out = {}
    for label, lo, hi in BANDS:
        times = [s for n, s in steps if lo <= n <= hi]
        if times:
            out[label] = {"steps": len(times), "median_step_ms": 1e3 * median(times), "seconds": sum(times)}
    return out


def format_regimes(per_config: dict[str, dict[str, dict]]) -> str:
    """Markdown: per band, each config's steps, median step ms and seconds, and step speed-up over the first config."""
    configs = [c for c, r in per_config.items() if r]
    if not configs:
        return ""
    base = configs[0]
    head = ["running requests"] + [f"{c}: steps, ms/step, s" for c in configs] + \
        [f"{c} step speed-up vs {base}" for c in configs[1:]]
    lines = ["Decode steps by running requests (from the scheduler's decode log lines; s = the run's seconds in that "
             "band):", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for label, _, _ in BANDS:
        if not any(label in per_config[c] for c in configs):
            continue
        cells = [label]
        for c in configs:
            r = per_config[c].get(label)
            cells.append("—" if r is None else f"{r['steps']:,}, {r['median_step_ms']:.2f}, {r['seconds']:.1f}")
        b = per_config[base].get(label)
        for c in configs[1:]:
            r = per_config[c].get(label)
            cells.append("—" if not (r and b) else f"{b['median_step_ms'] / r['median_step_ms']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
