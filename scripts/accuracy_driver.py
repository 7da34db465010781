"""The driver parts of scripts/accuracy_regression.py that its `main` calls: the prompts (`load_prompts`), the drifted
policy (`prepare_drifted`, sized from the HF model's K/V amax), the KV calibration batch of the arms that calibrate,
the primary arm's plot, and `_Run`: one call's engines (stored records reused with --reuse, the rest run while
--deadline-s allows)."""

from __future__ import annotations

import hashlib
import json
import os
import time

import accuracy_kv as AK  # scripts/accuracy_kv.py: the FP8-KV arms, pure
from accuracy_console import say
from accuracy_engine import plot, run_engine
from accuracy_metrics import kl_divergence


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
    """The calibration batch file of the arms that calibrate their K/V scales ('' = the engine's built-in default);
    every such arm (fp8_kv_calibrate, fp8_kv_fa3, the split-KV ones) gets the same batch, so their scales agree."""
    if not any(AK.ARM_KV_SCALES[arm] == "calibrate" for arm in args.arms) or args.kv_calibration == "default":
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
