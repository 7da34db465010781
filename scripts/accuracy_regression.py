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

  python scripts/accuracy_regression.py --model /tmp/toy_policy --task addition --out /tmp/acc
  python scripts/accuracy_regression.py --model /path/Qwen3-0.6B --prompts prompts.txt --max-new-tokens 64 --out /tmp/acc

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
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

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
    """NeMo-RL's token_mult_prob_error: mean over tokens of exp(|logp_a - logp_b|) (1.0 = identical)."""
    pairs = [(a, b) for a, b in zip(lp_a, lp_b) if a is not None and b is not None]
    if not pairs:
        return float("nan")
    return sum(math.exp(abs(a - b)) for a, b in pairs) / len(pairs)


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
    kl_by_pos = {}
    for i, pr in enumerate(prompts):
        P, Q = bf16["score"][i]["dists"], fp8["score"][i]["dists"]
        for j, (p, q) in enumerate(zip(P, Q)):
            if not p or not q:
                continue
            kl, c, _ = kl_divergence(p, q)
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
        lines.append(f"| token_mult_prob_error FP8 rollout vs HF BF16 | {_fmt(res['tmpe_fp8_rollout_vs_hf_bf16'], '{:.5f}')} |")
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


def run_engine(name, args, prompts, max_new_tokens, top_k, score_conts, quantization, log_path, stop_ids):
    """Generate from `prompts`, then score prompt + score_conts[i] (or prompt + own continuation if None)."""
    import sglang

    kwargs = dict(model_path=args.model, tokenizer_path=args.model, dtype="bfloat16", attention_backend="triton",
                  sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=args.mem_fraction_static,
                  disable_radix_cache=True, random_seed=args.seed, log_level=args.log_level,
                  cuda_graph_bs_decode=[args.chunk], disable_prefill_cuda_graph=not args.prefill_cuda_graph)
    if quantization:
        kwargs["quantization"] = quantization
    for kv in args.engine_arg:
        k, v = kv.split("=", 1)
        kwargs[k] = json.loads(v) if v[:1] in "[{0123456789-" or v in ("true", "false", "null") else v
    sp = {"temperature": args.temperature, "max_new_tokens": max_new_tokens}
    if stop_ids:
        sp["stop_token_ids"] = list(stop_ids)
    rec = {"gen": [], "score": []}
    t0 = time.time()
    with redirect_fds(log_path):
        os.write(1, f"[accuracy] engine {name}: {json.dumps(kwargs)}\n".encode())
        engine = sglang.Engine(**kwargs)
        t_start = time.time() - t0
        say(f"engine {name} up in {t_start:.0f} s (log {log_path})")
        try:
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
        sys.path.insert(0, HERE)
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
    return p.parse_args(argv)


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
        sys.path.insert(0, HERE)
        import train_toy_policy as T

        task = dict(T.DEFAULT_TASK)
        tj = os.path.join(args.model, "task.json")
        if os.path.exists(tj):
            with open(tj) as f:
                task.update(json.load(f))
        probs = T.test_problems(args.n_prompts, seed=4242, task=task)
        return [T.prompt_ids(a, b, task) for a, b in probs], [a + b for a, b in probs], task, probs
    raise SystemExit("give --task addition or --prompts FILE")


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
    if args.max_new_tokens is None:
        if task is not None:
            sys.path.insert(0, HERE)
            import train_toy_policy as T

            args.max_new_tokens = T.max_answer_tokens(task)
        else:
            args.max_new_tokens = 32
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    meta = {"model": os.path.abspath(args.model), "quantization": args.quantization, "n_prompts": len(prompts),
            "top_k": top_k, "vocab_size": vocab, "kl_exact": top_k >= vocab, "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature, "task": task, "argv": sys.argv,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    say(f"{len(prompts)} prompts, top-{top_k} logprobs (vocab {vocab}{', exact KL' if meta['kl_exact'] else ''}), "
        f"max_new_tokens {args.max_new_tokens}")

    bf16 = run_engine("bf16", args, prompts, args.max_new_tokens, top_k, None, None,
                      os.path.join(args.out, "engine_bf16.log"), stop_ids)
    conts = [g["output_ids"] for g in bf16["gen"]]
    fp8 = run_engine("fp8", args, prompts, args.max_new_tokens, top_k, conts, args.quantization,
                     os.path.join(args.out, "engine_fp8.log"), stop_ids)
    meta["engine_bf16_s"], meta["engine_fp8_s"] = bf16["seconds"], fp8["seconds"]
    with open(os.path.join(args.out, "engine_fp8.log"), errors="replace") as f:
        meta["fp8rl"] = [ln[ln.index("[fp8rl]"):].strip()[:400] for ln in f if "[fp8rl]" in ln][:20]

    hf, hf_acc = None, None
    if not args.no_hf_reference:
        t = time.time()
        hf, hf_acc = hf_reference(args.model, prompts, {"bf16": conts, "fp8": [g["output_ids"] for g in fp8["gen"]]},
                                  task, problems)
        say(f"HF reference scored in {time.time() - t:.0f} s")

    decode_fn = None
    if task is not None:
        import train_toy_policy as T

        decode_fn = lambda ids: T.decode_answer(ids, task)  # noqa: E731
    res = compare(prompts, bf16, fp8, hf, answers, decode_fn)
    if hf_acc is not None:
        res["task_exact_match_hf"] = hf_acc
    meta["seconds_total"] = time.time() - t_all

    # per-position detail for the plot
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
        plot({"kl_cont": kl_cont, "kl_prompt": kl_prompt, "kl_by_pos": kl_by_pos,
              "title": f"BF16 vs {args.quantization}: next-token KL ({os.path.basename(os.path.abspath(args.model))})"},
             os.path.join(args.out, "accuracy.png"))
    except (ImportError, OSError, ValueError, RuntimeError) as e:  # the numbers matter more than the picture
        say(f"plot failed: {e!r}")
    examples = [{"prompt": prompts[i], "bf16": bf16["gen"][i]["output_ids"], "fp8": fp8["gen"][i]["output_ids"]}
                for i in range(min(5, len(prompts)))]
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        json.dump({"meta": meta, "metrics": res, "examples": examples}, f, indent=1, default=str)
    text = format_table(res, meta)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
