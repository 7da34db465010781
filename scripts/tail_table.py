"""The long-context tail of a rollout: decode at small batch over long contexts, one table (bench_rollout.py).

An RL step ends with its few longest samples decoding at batch 1-16 with contexts of many thousand tokens; this
table puts every config's decode step there next to the first config's (the baseline), from bench_one_batch rows
that carry ``input_len`` (``bench_rollout.py --input-len 4096 8192 --batch-sizes 1 4 16``). Speed-up is the
baseline's median decode step time over the config's, so > 1 means faster than the baseline.
"""
from __future__ import annotations

from typing import Optional

# the tail target: batch-1 decode at an 8k context >= 1.4x BF16
TAIL_TARGET = (1, 8192, 1.4)


def step_ms(results: dict, cfg: str, input_len: int, bs: int) -> Optional[float]:
    """Median decode step (ms) of ``cfg`` at (input_len, bs): its last row there, or None."""
    rows = [r for r in results.get(cfg, {}).get("rows", [])
            if int(r.get("input_len", -1)) == input_len and int(r["batch_size"]) == bs
            and r.get("median_decode_latency")]
    return 1e3 * rows[-1]["median_decode_latency"] if rows else None


def tail_rows(results: dict, input_lens, batch_sizes) -> list[dict]:
    """One dict per (input_len, bs): each config's step ms and its speed-up over the first config."""
    configs = list(results)
    out = []
    for il in input_lens:
        for bs in batch_sizes:
            ms = {cfg: step_ms(results, cfg, int(il), int(bs)) for cfg in configs}
            base = ms[configs[0]] if configs else None
            speedup = {cfg: (base / v if base and v else None) for cfg, v in ms.items()}
            out.append({"input_len": int(il), "bs": int(bs), "step_ms": ms, "speedup": speedup})
    return out


def tail_target(rows: list[dict], cfg: str) -> dict:
    """The tail target for ``cfg``: its speed-up at TAIL_TARGET's (bs, input), PASS / FAIL / n/a."""
    bs, il, threshold = TAIL_TARGET
    value = next((r["speedup"].get(cfg) for r in rows if r["bs"] == bs and r["input_len"] == il), None)
    status = "n/a" if value is None else ("PASS" if value >= threshold else "FAIL")
    return {"config": cfg, "bs": bs, "input_len": il, "threshold": threshold, "value": value, "status": status}


def format_tail(results: dict, input_lens, batch_sizes) -> str:
    """Markdown: decode ms/step per config at every (context, bs), speed-ups over the first config, the target."""
    configs = list(results)
    if not configs:
        return ""
    rows = tail_rows(results, input_lens, batch_sizes)
    others = configs[1:]
    head = ["context", "bs", *[f"{c} ms/step" for c in configs], *[f"{c} / {configs[0]}" for c in others]]
    lines = [f"## The tail: decode at small batch over long contexts (speed-up over {configs[0]})", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = [str(r["input_len"]), str(r["bs"])]
        cells += ["—" if r["step_ms"][c] is None else f"{r['step_ms'][c]:.2f}" for c in configs]
        cells += ["—" if r["speedup"][c] is None else f"{r['speedup'][c]:.3f}" for c in others]
        lines.append("| " + " | ".join(cells) + " |")
    if others:
        lines.append("")
        for cfg in others:
            t = tail_target(rows, cfg)
            value = "—" if t["value"] is None else f"{t['value']:.3f}"
            lines.append(f"target {cfg}/{configs[0]} decode @bs{t['bs']}, context {t['input_len']} >= "
                         f"{t['threshold']:.2f}: {value} {t['status']}")
    return "\n".join(lines)
