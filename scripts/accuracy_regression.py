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
  fp8_kv_fa3        fp8_kv_calibrate decoding on FA3 (installed) with --fp8rl-decode-attention fa3 (FA3's own FP8
                    decode at every batch: the split-KV kernel's "before")
  fp8_kv_splitkv    fp8_kv_calibrate decoding on FA3 (installed) with --fp8rl-decode-attention split_kv (the split-KV
                    kernel at every batch), the query cast to E4M3 as SGLang casts it
  fp8_kv_splitkv_bf16q  the same with --fp8rl-decode-query bf16 (the kernel reads the BF16 query): the pair isolates
                    the query's cast
  fp8_kv_splitkv_lean   fp8_kv_splitkv_bf16q with --fp8rl-producer-quant on (the norm and SiLU write the linears'
                    FP8 codes): every opt-in that takes launches out of the decode step, against the two above
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
import json
import os
import sys
import time

import accuracy_kv as AK  # scripts/accuracy_kv.py: the FP8-KV arms, pure
from accuracy_console import say
from accuracy_driver import (
    DRIFT_AMAX_PROMPTS,
    _plot_primary,
    _Run,
    load_prompts,
    prepare_drifted,
    resolve_kv_calibration,
)
from accuracy_engine import hf_reference
from accuracy_metrics import compare, format_table


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
                   help="calibration batch of the arms that calibrate: 'task' (in-context task sequences with --task, "
                        "else the engine's default), 'default' (the engine's), or a JSON file of token-id lists")
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
