"""FP8-KV arms of accuracy_regression.py (issue 15): arm settings, stored records, cross-policy checks, the table.

Pure Python (no torch, no SGLang at import); unit-tested in tests/test_kv_measure_scripts.py.

An *arm* is one engine compared with the BF16 engine of the same policy: ``fp8`` (weights only, BF16 KV cache),
``fp8_kv_static`` (+ FP8 E4M3 KV cache with SGLang's static scale 1.0) and ``fp8_kv_calibrate`` (+ FP8 KV cache with
scales calibrated on the engine). A *policy* is the checkpoint: ``original`` (the trained toy policy) or ``drifted``
(the same function with its K/V range multiplied by powers of two: scripts/kv_drift.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import json
import math
import os

ARMS = ("fp8", "fp8_kv_static", "fp8_kv_calibrate", "fp8_kv_fa3", "fp8_kv_splitkv", "fp8_kv_splitkv_bf16q",
        "fp8_kv_splitkv_lean")
POLICIES = ("original", "drifted")
FP8_KV_DTYPE = "fp8_e4m3"
ARM_KV_SCALES = {"fp8": None, "fp8_kv_static": "static", "fp8_kv_calibrate": "calibrate", "fp8_kv_fa3": "calibrate",
                 "fp8_kv_splitkv": "calibrate", "fp8_kv_splitkv_bf16q": "calibrate", "fp8_kv_splitkv_lean": "calibrate"}
# arms that decode on FlashAttention-3 (it must be installed): FA3's own FP8 decode at every batch (the kernel's
# "before"), or the split-KV kernel at every batch: its query cast
# to E4M3 as SGLang casts it, or as the model made it (--fp8rl-decode-query bf16); the pair isolates the query's cast;
# lean adds the producers that write their output's FP8 codes (--fp8rl-producer-quant on): every launch-saving opt-in
ARM_DECODE = {"fp8_kv_fa3": {"decode_attention": "fa3"}, "fp8_kv_splitkv": {"decode_attention": "split_kv"},
              "fp8_kv_splitkv_bf16q": {"decode_attention": "split_kv", "decode_query": "bf16"},
              "fp8_kv_splitkv_lean": {"decode_attention": "split_kv", "decode_query": "bf16", "producer_quant": "on"}}
ARM_DESC = {"fp8": "FP8 weights, BF16 KV cache", "fp8_kv_static": "FP8 weights + FP8 KV, static scale 1.0",
            "fp8_kv_calibrate": "FP8 weights + FP8 KV, calibrated scales",
            "fp8_kv_fa3": "FP8 weights + FP8 KV, calibrated, FA3's FP8 decode at every batch",
            "fp8_kv_splitkv": "FP8 weights + FP8 KV, calibrated, FA3 with the split-KV kernel, E4M3 query",
            "fp8_kv_splitkv_bf16q": "FP8 weights + FP8 KV, calibrated, FA3 with the split-KV kernel, BF16 query",
            "fp8_kv_splitkv_lean": ("FP8 weights + FP8 KV, calibrated, FA3 with the split-KV kernel, BF16 query, "
                                    "producers writing FP8 codes")}
# verdict criteria (printed with the verdicts)
CLOSE_EM = 0.01  # task exact match within this of the weight-only arm
CLOSE_TMPE = 0.005  # token_mult_prob_error (engine scoring) at most this above the weight-only arm's
DEGRADE_KL_RATIO = 10.0  # or: mean continuation KL at least this many times the calibrated arm's


def arm_engine_kwargs(arm: str, quantization: str) -> dict:
    """sglang.Engine kwargs of one arm (on top of the common ones)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    kwargs = {"quantization": quantization}
    if ARM_KV_SCALES[arm] is not None:
        kwargs["kv_cache_dtype"] = FP8_KV_DTYPE
    if arm in ARM_DECODE:
        kwargs["attention_backend"] = "fa3"
    return kwargs


def arm_options(arm: str, kv_calibration: str = "") -> dict:
    """Fp8rlOptions fields one arm sets (published through FP8RL_OPTIONS for the engine's processes)."""
    mode = ARM_KV_SCALES[arm]
    if mode is None:
        return {}
    opts = {"kv_scales": mode, **ARM_DECODE.get(arm, {})}
    if kv_calibration and mode == "calibrate":
        opts["kv_calibration"] = kv_calibration
    return opts


def missing_options(fields) -> list[str]:
    """The Fp8rlOptions fields among `fields` that the installed sglang-fp8rl does not have."""
    if not fields:
        return []
    from sglang_fp8rl.server_args import Fp8rlOptions

    have = {f.name for f in dataclasses.fields(Fp8rlOptions)}
    return sorted(set(fields) - have)


def require_options(fields) -> None:
    """Stop with a clear message if the plugin lacks an option the requested arms need."""
    missing = missing_options(fields)
    if missing:
        raise SystemExit(f"this sglang-fp8rl has no {', '.join(missing)} option(s) (Fp8rlOptions fields; "
                         "--fp8rl-kv-scales and friends): the FP8-KV arms need them. Install a version with the "
                         "KV-scale calibration, or run --arms fp8 only.")


@contextlib.contextmanager
def fp8rl_options(changes: dict):
    """Publish Fp8rlOptions with `changes` (FP8RL_OPTIONS, inherited by the engine's processes); restore after."""
    if not changes:
        yield
        return
    from sglang_fp8rl import server_args as SA

    require_options(changes)
    saved = os.environ.get(SA.ENV_VAR)
    SA.set_options(dataclasses.replace(SA.get_options(), **changes))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SA.ENV_VAR, None)
        else:
            os.environ[SA.ENV_VAR] = saved


def engine_name(policy: str, name: str) -> str:
    """Engine / log name: `fp8`, `bf16` for the original policy (the names of the single-arm run), else
    `drifted_fp8` etc."""
    return name if policy == POLICIES[0] else f"{policy}_{name}"


def prompts_digest(prompts) -> str:
    return hashlib.sha1(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16]


def signature(**fields) -> dict:
    """What a stored record was made with; a record is reused only when every field is equal."""
    return json.loads(json.dumps(fields, sort_keys=True, default=str))


def record_path(records_dir: str, policy: str, name: str) -> str:
    return os.path.join(records_dir, policy, f"{name}.json.gz")


def save_record(path: str, sig: dict, record: dict) -> None:
    """Write one engine's record atomically (gzip JSON)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with gzip.open(tmp, "wt") as f:
        json.dump({"signature": sig, "record": record}, f)
    os.replace(tmp, path)


def load_record(path: str, sig: dict):
    """The stored record if it exists and was made with `sig`, else None."""
    try:
        with gzip.open(path, "rt") as f:
            data = json.load(f)
    except (OSError, EOFError, json.JSONDecodeError):
        return None
    if data.get("signature") != sig:
        return None
    record = data["record"]
    for score in record.get("score", []):  # JSON made the {token id: logprob} keys strings
        score["dists"] = [{int(t): lp for t, lp in d.items()} for d in score.get("dists", [])]
    return record


def _max_abs_diff(xs, ys):
    diffs = [abs(a - b) for a, b in zip(xs, ys) if a is not None and b is not None]
    return max(diffs) if diffs else None


def record_diff(a: dict, b: dict) -> dict:
    """How far two engines' records are apart: greedy outputs, generation and scoring logprobs (0.0 = bit-identical).

    Logprob differences are taken over positions both have (generation: the common prefix of identical tokens)."""
    same, gen_diffs, score_diffs = 0, [], []
    for ga, gb in zip(a["gen"], b["gen"]):
        same += ga["output_ids"] == gb["output_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ga["output_ids"], gb["output_ids"])) if x != y),
                 min(len(ga["output_ids"]), len(gb["output_ids"])))
        gen_diffs.append(_max_abs_diff(ga["logprobs"][:n], gb["logprobs"][:n]))
    for sa, sb in zip(a["score"], b["score"]):
        score_diffs.append(_max_abs_diff(sa["token_logprobs"], sb["token_logprobs"]))
    n = max(1, min(len(a["gen"]), len(b["gen"])))
    gd = [d for d in gen_diffs if d is not None]
    sd = [d for d in score_diffs if d is not None]
    return {"greedy_identical_fraction": same / n, "max_abs_gen_logprob_diff": max(gd) if gd else None,
            "max_abs_score_logprob_diff": max(sd) if sd else None}


def is_identical(diff: dict) -> bool:
    return (diff["greedy_identical_fraction"] == 1.0 and diff["max_abs_gen_logprob_diff"] in (0.0, None)
            and diff["max_abs_score_logprob_diff"] in (0.0, None))


def _get(table, policy, arm, key):
    v = (table.get(policy) or {}).get(arm, {}).get(key)
    if isinstance(v, dict):
        v = v.get("mean")
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def verdicts(table: dict, diffs: dict) -> list[str]:
    """The issue's expectations, checked on what was measured (each line names its criterion)."""
    out = []
    for policy in POLICIES:
        em_c, em_w = (_get(table, policy, a, "task_exact_match_fp8") for a in ("fp8_kv_calibrate", "fp8"))
        t_c, t_w = (_get(table, policy, a, "tmpe_fp8_vs_bf16_engine_scoring") for a in ("fp8_kv_calibrate", "fp8"))
        if t_c is None or t_w is None:
            continue
        close = t_c - t_w <= CLOSE_TMPE and (em_c is None or em_w is None or abs(em_c - em_w) <= CLOSE_EM)
        out.append(f"calibrate close to weight-only FP8 on the {policy} policy: {'yes' if close else 'NO'} "
                   f"(token_mult_prob_error {t_c:.5f} vs {t_w:.5f}, task EM {_fmt(em_c)} vs {_fmt(em_w)}; "
                   f"criterion: error within +{CLOSE_TMPE}, EM within {CLOSE_EM})")
    s = {k: _get(table, "drifted", "fp8_kv_static", k) for k in ("task_exact_match_fp8", "kl_continuation",
                                                                 "tmpe_fp8_vs_bf16_engine_scoring")}
    c = {k: _get(table, "drifted", "fp8_kv_calibrate", k) for k in s}
    if s["tmpe_fp8_vs_bf16_engine_scoring"] is not None and c["tmpe_fp8_vs_bf16_engine_scoring"] is not None:
        em_drop = (c["task_exact_match_fp8"] or 0) - (s["task_exact_match_fp8"] or 0)
        kl_ratio = s["kl_continuation"] / max(c["kl_continuation"], 1e-12) if s["kl_continuation"] is not None \
            and c["kl_continuation"] is not None else None
        worse = (em_drop >= CLOSE_EM or s["tmpe_fp8_vs_bf16_engine_scoring"] - c["tmpe_fp8_vs_bf16_engine_scoring"]
                 > CLOSE_TMPE or (kl_ratio is not None and kl_ratio >= DEGRADE_KL_RATIO))
        out.append(f"static degrades on the drifted policy (vs calibrate): {'yes' if worse else 'NO'} (task EM "
                   f"{_fmt(s['task_exact_match_fp8'])} vs {_fmt(c['task_exact_match_fp8'])}, token_mult_prob_error "
                   f"{s['tmpe_fp8_vs_bf16_engine_scoring']:.5f} vs {c['tmpe_fp8_vs_bf16_engine_scoring']:.5f}, "
                   f"continuation KL x{_fmt(kl_ratio, '{:.3g}')}; criterion: EM -{CLOSE_EM}, error +{CLOSE_TMPE} or "
                   f"KL x{DEGRADE_KL_RATIO:g})")
    for name, expect in (("bf16", "the drift preserves the function in the engine"),
                         ("fp8", "FP8 weight codes stay, their scales move by c"),
                         ("fp8_kv_calibrate", "calibrated scales follow the drift (design: bit-identical)")):
        d = diffs.get(name)
        if d is not None:
            out.append(f"{name}: drifted == original ({expect}): {'yes' if is_identical(d) else 'NO'} (greedy "
                       f"identical {d['greedy_identical_fraction']:.4f}, max |d logprob| generation "
                       f"{_fmt(d['max_abs_gen_logprob_diff'])}, scoring {_fmt(d['max_abs_score_logprob_diff'])})")
    return out


def _fmt(v, f="{:.4g}"):
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f.format(v)


def kv_telemetry_line(kv) -> str:
    """One line from the engine's KV-scale telemetry (writes, last time, scale and amax ranges)."""
    if not kv:
        return "no KV-scale telemetry (static mode, or an engine without it)"
    scales = list((kv.get("scales") or {}).values())
    amax = list((kv.get("amax") or {}).values())
    parts = [f"{kv.get('writes', 0)} write(s), source {kv.get('source', '—')}"]
    if kv.get("seconds") is not None:
        parts.append(f"last {kv['seconds'] * 1e3:.1f} ms")
    for i, side in enumerate("kv"):
        if scales:
            parts.append(f"{side} scale [{min(x[i] for x in scales):g}, {max(x[i] for x in scales):g}]")
        if amax:
            parts.append(f"{side} amax max {max(x[i] for x in amax):.4g}")
    return ", ".join(parts)


def format_arms_table(table: dict, diffs: dict, meta: dict) -> str:
    """Markdown: every (policy, arm) against the BF16 engine of its policy, then the verdicts."""
    drift = meta.get("drift") or {}
    kl = "exact full-vocabulary KL" if meta.get("kl_exact") else "top-K intersection KL"
    lines = [f"## FP8 KV cache: static vs calibrated scales ({meta.get('n_prompts')} prompts, {kl})", ""]
    if drift:
        lines.append(f"drifted policy: K x{drift.get('k_factor')}, V x{drift.get('v_factor')} "
                     f"(amax K {_fmt(drift.get('k_amax_before'))} -> {_fmt(drift.get('k_amax_after'))}, "
                     f"V {_fmt(drift.get('v_amax_before'))} -> {_fmt(drift.get('v_amax_after'))}; E4M3 max 448)")
        lines.append("")
    lines += [("| policy | arm | KL cont. mean / p99 | KL prompt mean | top-1 cont. | token_mult_prob_error engine / "
               "vs HF BF16 | task EM arm / BF16 | greedy identical | non-finite KL |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for policy in POLICIES:
        for arm in ARMS:
            r = (table.get(policy) or {}).get(arm)
            if r is None:
                continue
            kc = r.get("kl_continuation") or {}
            lines.append(f"| {policy} | {arm} | {_fmt(kc.get('mean'))} / {_fmt(kc.get('p99'))} | "
                         f"{_fmt((r.get('kl_prompt') or {}).get('mean'))} | "
                         f"{_fmt(r.get('top1_agreement_continuation'), '{:.4f}')} | "
                         f"{_fmt(r.get('tmpe_fp8_vs_bf16_engine_scoring'), '{:.5f}')} / "
                         f"{_fmt(r.get('tmpe_fp8_rollout_vs_hf_bf16'), '{:.5f}')} | "
                         f"{_fmt(r.get('task_exact_match_fp8'), '{:.4f}')} / "
                         f"{_fmt(r.get('task_exact_match_bf16'), '{:.4f}')} | "
                         f"{_fmt(r.get('greedy_identical_fraction'), '{:.4f}')} | {r.get('kl_nonfinite', 0)} |")
    lines.append("- KL, top-1 and the engine token_mult_prob_error score BF16 rollouts in one prefill (radix cache "
                 "off), whose attention reads the request's fresh K/V, not the FP8 cache: they show the weights' error "
                 "only. The FP8 KV cache shows in the columns that decode through it: token_mult_prob_error of the "
                 "arm's own rollout vs HF BF16, task EM and greedy identical.")
    for line in verdicts(table, diffs):
        lines.append(f"- {line}")
    for name, kv in (meta.get("kv_scales") or {}).items():
        lines.append(f"- KV scales of {name}: {kv_telemetry_line(kv)}")
    for name, why in (meta.get("failed") or {}).items():
        lines.append(f"- FAILED {name}: {why}")
    if meta.get("missing"):
        lines += ["", "INCOMPLETE (call again with --reuse to finish): not measured yet: " + ", ".join(meta["missing"])]
    return "\n".join(lines)
