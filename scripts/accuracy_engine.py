"""The GPU side of scripts/accuracy_regression.py: `run_engine` (one in-process `sglang.Engine` generating from the
prompts and scoring prompt + continuation, its fds 1/2 redirected to its log), its KV-scale telemetry, the HF
transformers BF16 reference (`hf_reference`) and the KL plot. torch, SGLang, transformers and matplotlib are
imported lazily, inside the functions."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import accuracy_kv as AK  # scripts/accuracy_kv.py: the FP8-KV arms, pure
from accuracy_console import console, say
from accuracy_metrics import output_logprobs, scoring_dists, scoring_token_logprobs

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
