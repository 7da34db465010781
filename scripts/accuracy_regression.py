#!/usr/bin/env python3
"""Accuracy regression: the same prompts through SGLang in BF16 and with --quantization fp8_online_blockwise.

Runs two in-process `sglang.Engine`s one after the other (BF16 first, then FP8; each shut down before the next
starts) on the same token ids, then optionally the HF transformers BF16 model as the "trainer" reference:

 1. BF16 engine: greedy (--temperature 0) generation from every prompt with return_logprob (sampled-token
    logprobs and top-K logprobs per generated token); then teacher-forced scoring of prompt + BF16 continuation
    (max_new_tokens=1, return_logprob=True, logprob_start_len=0, top_logprobs_num=K).
 2. FP8 engine: the same generation from the same prompts, and the same scoring of prompt + *BF16* continuation,
    so both distributions at every scored position condition on identical tokens.
 3. HF reference (skip with --no-hf-reference): transformers AutoModelForCausalLM in bf16 scores prompt +
    continuation for each engine's own continuation (fp32 log_softmax), as an RL trainer would.

Reported (accuracy.json, summary.md, accuracy.png, printed table):
 * next-token KL(P_bf16 || P_fp8) over the scored positions: mean / p99 / max, split into prompt positions and
   continuation positions (the ones that predict continuation tokens). With top_logprobs_num = vocab size
   (default for vocabularies <= 256, e.g. the toy policy's 32) this is the exact full-vocabulary KL. Otherwise it
   is an approximation: both top-K sets are intersected, both distributions renormalized over the intersection,
   and the BF16 probability mass covered by it is reported ("coverage").
 * top-1 agreement: argmax of the two distributions at the same positions.
 * token_mult_prob_error (NeMo-RL): mean over generated tokens of exp(|logp_rollout - logp_trainer|), the
   sampled/greedy token's logprob from the generation engine vs the training framework's recomputed logprob of
   that token (NVIDIA-NeMo/RL nemo_rl/algorithms/loss_functions.py, ClippedPGLossFn: lp_error =
   |generation_logprobs - prev_logprobs|; masked_mean(exp(lp_error * mask), mask); docs/guides/grpo.md#metrics;
   their CI gates on < 1.05 / median < 1.1). Three flavours: FP8 rollout vs HF BF16 (the quantity RL sees), BF16
   rollout vs HF BF16 (the no-quantization floor of engine/trainer mismatch), and FP8 vs BF16 engine scoring of
   the BF16 continuations (engine-only, no HF).
 * greedy-continuation agreement: fraction of prompts whose FP8 continuation equals the BF16 one token for
   token, and the mean length of the matching prefix.
 * --task addition: exact-match accuracy of both engines (and HF greedy) on held-out problems of
   scripts/train_toy_policy.py (task spec from <model>/task.json).

FP8 KV cache (issue 15): --arms picks the engines compared with BF16 (scripts/accuracy_kv.py):
  fp8               --quantization (weights only, BF16 KV cache): the default, the run described above
  fp8_kv_static     + kv_cache_dtype fp8_e4m3 with --fp8rl-kv-scales static (SGLang's scale 1.0)
  fp8_kv_calibrate  + kv_cache_dtype fp8_e4m3 with --fp8rl-kv-scales calibrate (scales measured on the engine; with
                    --task, on in-context task sequences written to OUT/kv_calibration.json, see --kv-calibration)
and --policies the checkpoints: `original` (--model) and `drifted`, the same function with its K range x --drift-k
and V range x --drift-v (powers of two, scripts/kv_drift.py; `auto` = the smallest power of two >= 64 (K) / 256 (V)
that takes the measured amax past 4 x 448), written to OUT/policy_drifted. Each (policy, engine) record is stored
under --records-dir; with --reuse a later call skips what is stored, so `--deadline-s` splits the work over calls.
Reported per (policy, arm): KL(BF16 || arm), token_mult_prob_error, task accuracy; then the expectations (calibrate
close to weight-only FP8; static worse on the drifted policy; drifted == original where the design says bit-identical).

  python scripts/accuracy_regression.py --model /tmp/toy_policy --task addition --out /tmp/acc
  python scripts/accuracy_regression.py --model /path/Qwen3-0.6B --prompts prompts.txt --max-new-tokens 64 \\
      --out /tmp/acc
  python scripts/accuracy_regression.py --model /tmp/toy_policy --task addition --out /tmp/kv_acc \\
      --arms fp8 fp8_kv_static fp8_kv_calibrate --policies original drifted --reuse --deadline-s 540

Engine settings: attention_backend triton, sampling_backend pytorch, grammar_backend none, dtype bfloat16,
mem_fraction_static 0.3, radix cache off (every request is computed in full), decode CUDA graphs on (one graph,
bs = --chunk; smaller decode batches are padded to it, which keeps the triton JIT at engine start short), prefill
CUDA graph off unless --prefill-cuda-graph (its capture costs ~1 min per engine start and does not change the
kernels). Each engine's own log goes to OUT/engine_<name>.log (its stdout/stderr are redirected
while it runs); `[fp8rl]` lines from it are copied into accuracy.json.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import time

import accuracy_kv as AK  # scripts/accuracy_kv.py: the FP8-KV arms, pure

_CONSOLE = None


def console():
    """A stream on the original stderr: still the terminal while the engine's fds 1/2 point at its log."""
    global _CONSOLE
    if _CONSOLE is None:
        try:
            _CONSOLE = os.fdopen(os.dup(2), "w", buffering=1)
        except OSError:
            _CONSOLE = sys.stderr
    return _CONSOLE


def say(msg: str) -> None:
    print(f"[accuracy {time.strftime('%H:%M:%S')}] {msg}", file=console(), flush=True)


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


# ----------------------------------------------------------------------------------------------------------------
# GPU side
# ----------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def redirect_fds(path: str):
    """Point fds 1 and 2 (inherited by the engine's subprocesses) at `path` for the duration."""
    sys.stdout.flush()
    sys.stderr.flush()
    console()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (*saved, fd):
            os.close(f)


def _progress(total, desc):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=console(), dynamic_ncols=False, ncols=100, mininterval=1.0)
    except ImportError:  # pragma: no cover
        class _P:
            def update(self, n):
                pass

            def close(self):
                pass

        return _P()


def engine_kv_scales(engine):
    """The plugin's KV-scale telemetry (/get_server_info internal_states[0].fp8rl.kv_scales), or None."""
    try:
        states = engine.get_server_info().get("internal_states") or [{}]
        return (states[0].get("fp8rl") or {}).get("kv_scales")
    except (AttributeError, KeyError, IndexError, TypeError, RuntimeError) as e:
        say(f"no KV-scale telemetry: {e!r}")
        return None


def run_engine(name, args, prompts, max_new_tokens, top_k, score_conts, quantization, log_path, stop_ids,
               model=None, engine_kwargs=None, options=None):
    """Generate from `prompts`, then score prompt + score_conts[i] (or prompt + own continuation if None).

    model: checkpoint folder (default --model); engine_kwargs: extra sglang.Engine kwargs of the arm (--engine-arg
    still wins); options: Fp8rlOptions fields published to the engine's processes while it runs."""
    import sglang

    model = model or args.model
    kwargs = dict(model_path=model, tokenizer_path=model, dtype="bfloat16", attention_backend="triton",
                  sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=args.mem_fraction_static,
                  disable_radix_cache=True, random_seed=args.seed, log_level=args.log_level,
                  cuda_graph_bs_decode=[args.chunk], disable_prefill_cuda_graph=not args.prefill_cuda_graph)
    if quantization:
        kwargs["quantization"] = quantization
    kwargs.update(engine_kwargs or {})
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        kwargs[k] = json.loads(v) if v[:1] in "[{0123456789-" or v in ("true", "false", "null") else v
    sp = {"temperature": args.temperature, "max_new_tokens": max_new_tokens}
    if stop_ids:
        sp["stop_token_ids"] = list(stop_ids)
    rec = {"gen": [], "score": []}
    t0 = time.time()
    with redirect_fds(log_path), AK.fp8rl_options(options or {}):
        os.write(1, f"[accuracy] engine {name}: {json.dumps(kwargs)}; fp8rl options {json.dumps(options or {})}\n"
                 .encode())
        engine = sglang.Engine(**kwargs)
        t_start = time.time() - t0
        say(f"engine {name} up in {t_start:.0f} s (log {log_path})")
        try:
            if kwargs.get("kv_cache_dtype"):
                rec["kv_scales"] = engine_kv_scales(engine)
            bar = _progress(2 * len(prompts), f"{name} gen+score")
            for i in range(0, len(prompts), args.chunk):
                chunk = prompts[i:i + args.chunk]
                outs = engine.generate(input_ids=chunk, sampling_params=sp, return_logprob=True,
                                       top_logprobs_num=top_k, logprob_start_len=0)
                for o in outs:
                    rec["gen"].append({"output_ids": list(o["output_ids"]), "logprobs": output_logprobs(o["meta_info"]),
                                       "finish": o["meta_info"].get("finish_reason")})
                bar.update(len(chunk))
            for i in range(0, len(prompts), args.chunk):
                seqs = []
                for k in range(i, min(i + args.chunk, len(prompts))):
                    cont = score_conts[k] if score_conts is not None else rec["gen"][k]["output_ids"]
                    seqs.append(list(prompts[k]) + list(cont))
                outs = engine.generate(input_ids=seqs, sampling_params={"temperature": 0.0, "max_new_tokens": 1},
                                       return_logprob=True, top_logprobs_num=top_k, logprob_start_len=0)
                for s, o in zip(seqs, outs):
                    rec["score"].append({"dists": scoring_dists(o["meta_info"], len(s)),
                                         "token_logprobs": scoring_token_logprobs(o["meta_info"], len(s))})
                bar.update(len(seqs))
            bar.close()
        finally:
            engine.shutdown()
            del engine
    rec["seconds"] = (t_start, time.time() - t0 - t_start)
    return rec


def hf_reference(model_dir, prompts, conts_by_name, task=None, task_problems=None, batch_size=64):
    """HF transformers BF16 teacher-forced logprobs of each continuation token (and HF greedy task accuracy)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    except TypeError:  # older transformers
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    model = model.cuda().eval()
    out = {}
    with torch.no_grad():
        for name, conts in conts_by_name.items():
            res = []
            for i in range(0, len(prompts), batch_size):
                seqs = [list(p) + list(c) for p, c in zip(prompts[i:i + batch_size], conts[i:i + batch_size])]
                L = max(len(s) for s in seqs)
                ids = torch.zeros((len(seqs), L), dtype=torch.long)
                mask = torch.zeros((len(seqs), L), dtype=torch.long)
                for r, s in enumerate(seqs):
                    ids[r, :len(s)] = torch.tensor(s)
                    mask[r, :len(s)] = 1
                logits = model(input_ids=ids.cuda(), attention_mask=mask.cuda()).logits.float()
                lps = torch.log_softmax(logits, dim=-1)
                for r, (p, c) in enumerate(zip(prompts[i:i + batch_size], conts[i:i + batch_size])):
                    pos = torch.arange(len(p) - 1, len(p) - 1 + len(c), device=lps.device)
                    tok = torch.tensor(list(c), device=lps.device, dtype=torch.long)
                    res.append(lps[r, pos, tok].tolist() if len(c) else [])
            out[name] = res
    hf_acc = None
    if task is not None and task_problems is not None:
        import train_toy_policy as T

        hf_acc, _ = T.greedy_exact_match(model, task_problems, task, torch.device("cuda"))
    del model
    torch.cuda.empty_cache()
    return out, hf_acc


def plot(res_detail, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kc, kp, bypos = res_detail["kl_cont"], res_detail["kl_prompt"], res_detail["kl_by_pos"]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))
    floor = 1e-9
    bins = np.logspace(-9, 1, 60)
    for xs, lab in ((kp, "prompt positions"), (kc, "continuation positions")):
        if xs:
            ax[0].hist(np.clip(np.array(xs), floor, None), bins=bins, alpha=0.6, label=f"{lab} (n={len(xs)})")
    ax[0].set_xscale("log")
    ax[0].set_xlabel("KL(BF16 || FP8) per position (clipped at 1e-9)")
    ax[0].set_ylabel("positions")
    ax[0].legend()
    if bypos:
        ks = sorted(bypos)
        ax[1].plot(ks, [np.mean(bypos[k]) for k in ks], "o-", label="mean")
        ax[1].plot(ks, [np.percentile(bypos[k], 99) for k in ks], "s--", label="p99")
        ax[1].set_yscale("log")
        ax[1].legend()
    ax[1].set_xlabel("continuation position (0 = first generated token)")
    ax[1].set_ylabel("KL(BF16 || FP8)")
    fig.suptitle(res_detail.get("title", "BF16 vs FP8 next-token KL"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--model", required=True, help="HF checkpoint folder (e.g. from train_toy_policy.py)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--task", choices=["addition"], help="held-out problems of the toy policy's task")
    src.add_argument("--prompts", help="text file, one prompt per line, or .jsonl with 'input_ids' or 'text'")
    p.add_argument("--out", required=True)
    p.add_argument("--n-prompts", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: task answer length, else 32")
    p.add_argument("--top-k", type=int, default=None,
                   help="top_logprobs_num; default: the model's vocab size if <= 256 (exact KL), else 20")
    p.add_argument("--quantization", default="fp8_online_blockwise", help="the engine compared with BF16")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--mem-fraction-static", type=float, default=0.3)
    p.add_argument("--chunk", type=int, default=64, help="prompts per generate() call (= the decode CUDA-graph bs)")
    p.add_argument("--prefill-cuda-graph", action="store_true")
    p.add_argument("--no-hf-reference", action="store_true", help="skip the HF transformers BF16 reference")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra sglang.Engine kwarg (repeatable), e.g. --engine-arg fp8_gemm_backend=triton")
    p.add_argument("--log-level", default="info", help="engine log level (its log goes to OUT/engine_*.log)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", choices=AK.ARMS, default=["fp8"],
                   help="engines compared with BF16 (fp8 = weights only; fp8_kv_* add an FP8 KV cache)")
    p.add_argument("--policies", nargs="+", choices=AK.POLICIES, default=["original"],
                   help="original = --model; drifted = the same function with its K/V range scaled (kv_drift.py)")
    p.add_argument("--drift-k", default="auto", help="K range factor of the drifted policy: a power of two or auto")
    p.add_argument("--drift-v", default="auto", help="V range factor of the drifted policy: a power of two or auto")
    p.add_argument("--kv-calibration", default="task",
                   help="calibration batch of the calibrate arm: 'task' (in-context task sequences with --task, else "
                        "the engine's default), 'default' (the engine's), or a JSON file of token-id lists")
    p.add_argument("--records-dir", default=None, help="where each engine's record is stored (default OUT/records)")
    p.add_argument("--reuse", action="store_true", help="reuse stored records made with the same settings")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="wall budget of this call (s): engines that cannot get --min-engine-s are left for a later "
                        "call with --reuse (exit code 3 until everything is measured); 0 = none")
    p.add_argument("--min-engine-s", type=float, default=120, help="time an engine needs (start + work)")
    a = p.parse_args(argv)
    import kv_drift as D

    try:
        D.parse_factor(a.drift_k)
        D.parse_factor(a.drift_v)
    except ValueError as e:
        p.error(str(e))
    return a


def load_prompts(args, tok):
    if args.prompts:
        prompts = []
        with open(args.prompts) as f:
            for line in f:
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if args.prompts.endswith(".jsonl"):
                    d = json.loads(line)
                    prompts.append(list(d["input_ids"]) if "input_ids" in d else tok(d["text"]).input_ids)
                else:
                    prompts.append(tok(line).input_ids)
        return prompts[:args.n_prompts], None, None, None
    if args.task == "addition":
        import train_toy_policy as T

        task = dict(T.DEFAULT_TASK)
        tj = os.path.join(args.model, "task.json")
        if os.path.exists(tj):
            with open(tj) as f:
                task.update(json.load(f))
        probs = T.test_problems(args.n_prompts, seed=4242, task=task)
        return [T.prompt_ids(a, b, task) for a, b in probs], [a + b for a, b in probs], task, probs
    raise SystemExit("give --task addition or --prompts FILE")


DRIFT_AMAX_PROMPTS = 64  # sequences the drift's K/V amax is measured on


def weights_stamp(model_dir: str) -> list:
    """(file, size, mtime) of a checkpoint's weight files: a retrained or rewritten policy invalidates records."""
    out = []
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith((".safetensors", ".bin")):
            st = os.stat(os.path.join(model_dir, fn))
            out.append([fn, st.st_size, st.st_mtime_ns])
    return out


def hf_kv_amax(model_dir: str, sequences) -> list:
    """Per-layer (K amax, V amax) of the HF model on `sequences` (CUDA in BF16 when available, else CPU float32)."""
    import kv_drift as D
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    model = (model.cuda() if cuda else model).eval()
    try:
        return D.kv_amax(model, sequences)
    finally:
        del model
        if cuda:
            torch.cuda.empty_cache()


def prepare_drifted(args, amax_sequences) -> tuple[str, dict]:
    """The drifted policy folder (OUT/policy_drifted; reused when made from the same checkpoint and request)."""
    import kv_drift as D

    dst = os.path.join(os.path.abspath(args.out), "policy_drifted")
    requested = {"k": str(args.drift_k), "v": str(args.drift_v), "source_weights": weights_stamp(args.model)}
    rec = D.read_drift_record(dst)
    if rec and rec.get("requested") == requested and rec.get("source") == os.path.abspath(args.model):
        say(f"drifted policy at {dst} reused (K x{rec['k_factor']}, V x{rec['v_factor']})")
        return dst, rec
    before = hf_kv_amax(args.model, amax_sequences)
    k_amax, v_amax = max(k for k, _ in before), max(v for _, v in before)
    factors = {}
    for side, text, amax in (("k", args.drift_k, k_amax), ("v", args.drift_v, v_amax)):
        f = D.parse_factor(text)
        factors[side] = D.auto_factor(amax, D.DEFAULT_MIN_FACTOR[side]) if f == D.AUTO else f
    rec = D.write_drifted_checkpoint(args.model, dst, factors["k"], factors["v"],
                                     extra={"requested": requested, "k_amax_before": k_amax, "v_amax_before": v_amax,
                                            "amax_before": before})
    after = hf_kv_amax(dst, amax_sequences)
    rec.update(k_amax_after=max(k for k, _ in after), v_amax_after=max(v for _, v in after), amax_after=after)
    with open(os.path.join(dst, D.DRIFT_RECORD), "w") as f:
        json.dump(rec, f, indent=1)
    say(f"drifted policy -> {dst}: K x{rec['k_factor']} (amax {k_amax:.3g} -> {rec['k_amax_after']:.3g}), "
        f"V x{rec['v_factor']} (amax {v_amax:.3g} -> {rec['v_amax_after']:.3g}); E4M3 max 448")
    return dst, rec


def task_calibration_batch(task, n: int = 64, seed: int = 7) -> list:
    """In-context KV calibration sequences for the toy task: training-distribution problems with their answers
    (the engine's default batch, 4 x 512 tokens of text, is out of the toy's vocabulary and 128-token context)."""
    import random

    import train_toy_policy as T

    return [T.prompt_ids(a, b, task) + T.answer_ids(a, b, task)
            for a, b in T.sample_problems(random.Random(seed), n, "train", task)]


def resolve_kv_calibration(args, task) -> str:
    """The calibration batch file of the calibrate arm ('' = the engine's built-in default)."""
    if "fp8_kv_calibrate" not in args.arms or args.kv_calibration == "default":
        return ""
    if args.kv_calibration != "task":
        return os.path.abspath(args.kv_calibration)
    if task is None:
        return ""
    path = os.path.join(os.path.abspath(args.out), "kv_calibration.json")
    with open(path, "w") as f:
        json.dump(task_calibration_batch(task), f)
    return path


def _file_digest(path: str) -> str:
    if not path:
        return ""
    with open(path, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:16]


def _fp8rl_lines(log_path: str) -> list:
    with open(log_path, errors="replace") as f:
        return [ln[ln.index("[fp8rl]"):].strip()[:400] for ln in f if "[fp8rl]" in ln][:20]


def _plot_primary(args, prompts, bf16, fp8, title):
    kl_cont, kl_prompt, kl_by_pos = [], [], {}
    for i, pr in enumerate(prompts):
        for j, (p, q) in enumerate(zip(bf16["score"][i]["dists"], fp8["score"][i]["dists"])):
            if p and q:
                kl = kl_divergence(p, q)[0]
                if j + 1 >= len(pr):
                    kl_cont.append(kl)
                    kl_by_pos.setdefault(j + 1 - len(pr), []).append(kl)
                else:
                    kl_prompt.append(kl)
    try:
        plot({"kl_cont": kl_cont, "kl_prompt": kl_prompt, "kl_by_pos": kl_by_pos, "title": title},
             os.path.join(args.out, "accuracy.png"))
    except (ImportError, OSError, ValueError, RuntimeError, AttributeError) as e:  # the numbers matter more
        say(f"plot failed: {e!r}")


ENGINE_ERRORS = (RuntimeError, ValueError, TimeoutError, KeyError)  # engine start / request failures


class _Run:
    """One call's engines: stored records reused (--reuse), the rest run while the deadline allows."""

    def __init__(self, args, prompts, top_k, stop_ids, records_dir, kv_calibration, keep_records):
        self.args, self.prompts, self.top_k, self.stop_ids = args, prompts, top_k, stop_ids
        self.records_dir, self.kv_calibration, self.keep = records_dir, kv_calibration, keep_records
        self.deadline = time.time() + args.deadline_s if args.deadline_s > 0 else None
        self.recs, self.missing, self.failed = {}, [], {}

    def _signature(self, policy_dir, name, conts):
        a = self.args
        cal = self.kv_calibration if name == "fp8_kv_calibrate" else ""
        return AK.signature(model=policy_dir, weights=weights_stamp(policy_dir), name=name,
                            prompts=AK.prompts_digest(self.prompts), conts=AK.prompts_digest(conts or []),
                            top_k=self.top_k, max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed,
                            chunk=a.chunk, mem=a.mem_fraction_static, prefill_graph=a.prefill_cuda_graph,
                            engine_arg=a.engine_arg, quantization=None if name == "bf16" else a.quantization,
                            kv_calibration=[cal, _file_digest(cal)])

    def engine(self, policy, policy_dir, name, conts):
        """The record of one engine (stored, or run now); None when the deadline leaves no time to start it."""
        a = self.args
        path = AK.record_path(self.records_dir, policy, name)
        sig = self._signature(policy_dir, name, conts)
        rec = AK.load_record(path, sig) if a.reuse else None
        if rec is not None:
            say(f"{policy}/{name}: reusing {path}")
        elif self.deadline is not None and self.deadline - time.time() < a.min_engine_s:
            say(f"SKIP {policy}/{name}: {self.deadline - time.time():.0f} s left of --deadline-s (needs "
                f"{a.min_engine_s:.0f} s); call again with --reuse")
            self.missing.append(f"{policy}/{name}")
            return None
        else:
            ename = AK.engine_name(policy, name)
            log_path = os.path.join(a.out, f"engine_{ename}.log")
            open(log_path, "w").close()  # one engine's log, not an earlier call's
            quant = None if name == "bf16" else a.quantization
            try:
                rec = run_engine(ename, a, self.prompts, a.max_new_tokens, self.top_k,
                                 None if name == "bf16" else conts, quant, log_path, self.stop_ids, model=policy_dir,
                                 engine_kwargs={} if name == "bf16" else AK.arm_engine_kwargs(name, quant),
                                 options={} if name == "bf16" else AK.arm_options(name, self.kv_calibration))
            except ENGINE_ERRORS as e:  # one broken arm must not cost the others (several arms only)
                if not self.keep:
                    raise
                say(f"FAILED {policy}/{name}: {e!r} (log {log_path})")
                self.failed[f"{policy}/{name}"] = f"{type(e).__name__}: {e}"[:500]
                return None
            rec["fp8rl"] = _fp8rl_lines(log_path)
            if self.keep:
                AK.save_record(path, sig, rec)
        self.recs[(policy, name)] = rec
        return rec


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_all = time.time()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    top_k = args.top_k or (vocab if vocab <= 256 else 20)
    top_k = min(top_k, vocab)
    prompts, answers, task, problems = load_prompts(args, tok)
    import train_toy_policy as T

    if args.max_new_tokens is None:
        args.max_new_tokens = T.max_answer_tokens(task) if task is not None else 32
    AK.require_options(sorted({k for arm in args.arms for k in AK.arm_options(arm)}))
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    several = args.arms != ["fp8"] or args.policies != ["original"]
    records_dir = os.path.abspath(args.records_dir or os.path.join(args.out, "records"))
    kv_calibration = resolve_kv_calibration(args, task)
    meta = {"model": os.path.abspath(args.model), "quantization": args.quantization, "n_prompts": len(prompts),
            "top_k": top_k, "vocab_size": vocab, "kl_exact": top_k >= vocab, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "task": task, "arms": args.arms, "policies": args.policies,
            "kv_calibration": kv_calibration, "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    say(f"{len(prompts)} prompts, top-{top_k} logprobs (vocab {vocab}{', exact KL' if meta['kl_exact'] else ''}), "
        f"max_new_tokens {args.max_new_tokens}, arms {args.arms}, policies {args.policies}")

    policy_dirs = {"original": os.path.abspath(args.model)}
    if "drifted" in args.policies:
        amax_seqs = [list(p) for p in prompts[:DRIFT_AMAX_PROMPTS]]
        if task is not None:  # the answers too: the K/V range of generated tokens
            amax_seqs = [s + T.answer_ids(a, b, task) for s, (a, b) in zip(amax_seqs, problems)]
        policy_dirs["drifted"], meta["drift"] = prepare_drifted(args, amax_seqs)
    decode_fn = None
    if task is not None:
        def decode_fn(ids):
            return T.decode_answer(ids, task)

    run = _Run(args, prompts, top_k, stop_ids, records_dir, kv_calibration, keep_records=several)
    table, hf_used = {}, {}
    for policy in args.policies:
        pdir = policy_dirs[policy]
        bf16 = run.engine(policy, pdir, "bf16", None)
        if bf16 is None:
            run.missing += [f"{policy}/{arm}" for arm in args.arms if f"{policy}/bf16" in run.missing]
            continue
        conts = [g["output_ids"] for g in bf16["gen"]]
        for arm in args.arms:
            run.engine(policy, pdir, arm, conts)
        present = [n for n in ["bf16", *args.arms] if (policy, n) in run.recs]
        hf, hf_acc = None, None
        if not args.no_hf_reference and len(present) > 1:
            t = time.time()
            hf, hf_acc = hf_reference(pdir, prompts, {n: [g["output_ids"] for g in run.recs[(policy, n)]["gen"]]
                                                      for n in present}, task, problems)
            hf_used[policy] = True
            say(f"HF reference ({policy}) scored in {time.time() - t:.0f} s")
        for arm in present[1:]:
            res = compare(prompts, bf16, run.recs[(policy, arm)], {"bf16": hf["bf16"], "fp8": hf[arm]} if hf else None,
                          answers, decode_fn)
            if hf_acc is not None:
                res["task_exact_match_hf"] = hf_acc
            table.setdefault(policy, {})[arm] = res
    diffs = {n: AK.record_diff(run.recs[("original", n)], run.recs[("drifted", n)]) for n in ["bf16", *args.arms]
             if ("original", n) in run.recs and ("drifted", n) in run.recs}
    meta["missing"], meta["failed"] = run.missing, run.failed
    meta["kv_scales"] = {f"{p}/{n}": r.get("kv_scales") for (p, n), r in run.recs.items() if "kv_scales" in r}
    meta["seconds_total"] = time.time() - t_all

    text_parts, metrics, examples = [], None, []
    primary = next(((p, a) for p in args.policies for a in args.arms if a in table.get(p, {})), None)
    if primary is not None:
        p, a = primary
        bf16, arm_rec = run.recs[(p, "bf16")], run.recs[(p, a)]
        metrics = table[p][a]
        label = args.quantization if a == "fp8" else f"{args.quantization} + {AK.ARM_DESC[a]}"
        pmeta = {**meta, "quantization": label, "engine_bf16_s": bf16["seconds"], "engine_fp8_s": arm_rec["seconds"],
                 "fp8rl": arm_rec.get("fp8rl", [])}
        meta.update({k: pmeta[k] for k in ("engine_bf16_s", "engine_fp8_s", "fp8rl")})
        _plot_primary(args, prompts, bf16, arm_rec,
                      f"BF16 vs {label}: next-token KL ({os.path.basename(policy_dirs[p])})")
        examples = [{"prompt": prompts[i], "bf16": bf16["gen"][i]["output_ids"], "fp8": arm_rec["gen"][i]["output_ids"]}
                    for i in range(min(5, len(prompts)))]
        text_parts.append(format_table(metrics, pmeta))
    if several:
        text_parts.append(AK.format_arms_table(table, diffs, meta))
    out = {"meta": meta, "metrics": metrics, "examples": examples}
    if several:
        out.update(arms=table, cross_policy=diffs)
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    text = "\n\n".join(text_parts) or "no arm was measured (see the log)"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text, flush=True)
    return 1 if run.failed else (3 if run.missing else 0)


if __name__ == "__main__":
    sys.exit(main())
