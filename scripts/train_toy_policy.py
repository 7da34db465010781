#!/usr/bin/env python3
"""Train a small Qwen3 (transformers Qwen3ForCausalLM) on multi-digit addition; save an HF checkpoint SGLang can serve.

Task ("addition", reversed digits): the prompt is `<bos>` + the two operands, zero-padded to 5 digits and
written least-significant digit first, + `=`; the answer is the sum zero-padded to 6 digits, also reversed, then
`<eos>`. Operands have 3-5 significant digits. Example: 123 + 4567 = 4690 is `<bos>32100+76540=` -> `096400<eos>`.
Reversed digits put the carry chain in generation order and the fixed width keeps every digit at a fixed offset,
which is what should let a 4-layer model reach high exact match within the budget (expected ~1-2 min on one H100;
not measured yet). --no-pad-operands drops the zero padding (harder: offsets then depend on the lengths). A
deterministic hash of (a, b) holds out 1/20 of all operand pairs (`is_test`); training never sees them,
evaluation uses only them. --prefix-len N puts N characters of digits and spaces before the operands (drawn from
a seed of (a, b), so a problem's prompt is always the same) and a space after them: the answer is unchanged, but every
decode step of it reads a KV cache of N more tokens, which is what an FP8-KV attention kernel is judged on at long
contexts (the plain task's whole sequence is 20 tokens).

Model: hidden 512, 4 layers, 4 q heads x head_dim 128, 2 kv heads, intermediate 1536 (every GEMM dimension a
multiple of 128, so every linear layer is eligible for 128x128 blockwise FP8), vocab 32 (17 used: <pad> <bos>
<eos> <unk> 0-9 + = space, the rest unused), untied embeddings. Trained in fp32 master weights with bf16 autocast,
AdamW, loss on answer tokens only, lr warmup + cosine over --max-seconds; stops early once held-out exact match
reaches --target-acc. Saved in bf16 (safetensors) with config.json (torch_dtype bfloat16), generation_config.json,
a PreTrainedTokenizerFast (WordLevel over single characters; loads with AutoTokenizer and in SGLang) and task.json
(read by scripts/accuracy_regression.py --task addition). Final held-out exact match uses HF greedy decoding
(model.generate, do_sample=False; prompts grouped by length so no padding is involved).

  python scripts/train_toy_policy.py --out /tmp/toy_policy             # <= 180 s of training on one GPU
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+= ")
PAD, BOS, EOS, UNK = 0, 1, 2, 3
VOCAB = {t: i for i, t in enumerate(SPECIALS + CHARS)}
VOCAB_SIZE = 32  # model vocab (padded); the tokenizer uses the first len(VOCAB)
FILLER_CHARS = "0123456789 "  # what a --prefix-len prompt's prefix is drawn from
MIN_CONTEXT = 128  # the plain task's context length (max_position_embeddings, the tokenizer's model_max_length)

DEFAULT_TASK = {"task": "addition", "min_digits": 3, "max_digits": 5, "reverse_operands": True,
                "reverse_answer": True, "pad_operands": True, "test_mod": 20,
                "format": "<bos>{a}+{b}={answer}<eos>; every number least-significant digit first; with pad_operands "
                          "operands zero-padded to max_digits and the answer to max_digits+1"}


# ----------------------------------------------------------------------------------------------------------------
# task (pure python; shared with accuracy_regression.py)
# ----------------------------------------------------------------------------------------------------------------

def is_test(a: int, b: int, test_mod: int = 20) -> bool:
    """Deterministic held-out split over operand pairs (about 1/test_mod of pairs)."""
    h = (a * 2654435761 + b * 40503 + (a ^ b) * 97) % 1000003
    return h % test_mod == 0


def _digits(n: int, reverse: bool, width: int = 0) -> str:
    s = str(n).zfill(width)
    return s[::-1] if reverse else s


def filler(a: int, b: int, n: int) -> str:
    """The n characters of digits and spaces a --prefix-len prompt of (a, b) starts with (the same every time)."""
    import random

    rng = random.Random(a * 1_000_003 + b)
    return "".join(rng.choice(FILLER_CHARS) for _ in range(n))


def prompt_text(a: int, b: int, task: dict = DEFAULT_TASK) -> str:
    """Prompt without the <bos> (the tokenizer's post-processor adds it)."""
    w = task["max_digits"] if task.get("pad_operands") else 0
    n = task.get("prefix_len", 0)
    head = f"{filler(a, b, n)} " if n else ""
    return f"{head}{_digits(a, task['reverse_operands'], w)}+{_digits(b, task['reverse_operands'], w)}="


def answer_text(a: int, b: int, task: dict = DEFAULT_TASK) -> str:
    w = task["max_digits"] + 1 if task.get("pad_operands") else 0
    return _digits(a + b, task["reverse_answer"], w)


def encode_chars(text: str) -> list[int]:
    return [VOCAB.get(ch, UNK) for ch in text]


def prompt_ids(a: int, b: int, task: dict = DEFAULT_TASK) -> list[int]:
    return [BOS] + encode_chars(prompt_text(a, b, task))


def answer_ids(a: int, b: int, task: dict = DEFAULT_TASK) -> list[int]:
    return encode_chars(answer_text(a, b, task)) + [EOS]


def decode_answer(ids, task: dict = DEFAULT_TASK):
    """Generated ids -> the integer they spell (None if malformed). Stops at <eos>/<pad>."""
    inv = {i: t for t, i in VOCAB.items()}
    s = []
    for i in ids:
        i = int(i)
        if i in (EOS, PAD):
            break
        s.append(inv.get(i, "?"))
    s = "".join(s)
    if not s or not s.isdigit():
        return None
    return int(s[::-1] if task["reverse_answer"] else s)


def sample_problems(rng, n: int, split: str, task: dict = DEFAULT_TASK) -> list[tuple[int, int]]:
    """n operand pairs from the train or test split (rng: random.Random)."""
    assert split in ("train", "test")
    want_test = split == "test"
    out = []
    lo_d, hi_d, mod = task["min_digits"], task["max_digits"], task["test_mod"]
    while len(out) < n:
        la, lb = rng.randint(lo_d, hi_d), rng.randint(lo_d, hi_d)
        a, b = rng.randint(10 ** (la - 1), 10 ** la - 1), rng.randint(10 ** (lb - 1), 10 ** lb - 1)
        if is_test(a, b, mod) == want_test:
            out.append((a, b))
    return out


def test_problems(n: int, seed: int = 12345, task: dict = DEFAULT_TASK) -> list[tuple[int, int]]:
    import random

    return sample_problems(random.Random(seed), n, "test", task)


def max_answer_tokens(task: dict = DEFAULT_TASK) -> int:
    return task["max_digits"] + 1 + 1  # sum has at most max_digits+1 digits, plus <eos>


def context_length(task: dict = DEFAULT_TASK) -> int:
    """The model's and tokenizer's context: the smallest power of two >= MIN_CONTEXT that holds a whole sequence."""
    longest = 1 + task.get("prefix_len", 0) + 1 + 2 * task["max_digits"] + 2 + max_answer_tokens(task)
    n = MIN_CONTEXT
    while n < longest:
        n *= 2
    return n


def build_tokenizer(max_length: int = MIN_CONTEXT):
    """PreTrainedTokenizerFast: one token per character (WordLevel), <bos> prepended by the post-processor."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", BOS)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.model_max_length = max_length
    return fast


def model_config(args, task: dict = DEFAULT_TASK):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                      intermediate_size=args.intermediate, hidden_act="silu",
                      max_position_embeddings=context_length(task),
                      rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False, attention_dropout=0.0,
                      tie_word_embeddings=False, use_cache=True, use_sliding_window=False,
                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, torch_dtype="bfloat16")
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


# ----------------------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------------------

def make_batch(rng, n, task, device):
    import torch

    probs = sample_problems(rng, n, "train", task)
    seqs, starts = [], []
    for a, b in probs:
        p, ans = prompt_ids(a, b, task), answer_ids(a, b, task)
        seqs.append(p + ans)
        starts.append(len(p))
    L = max(len(s) for s in seqs)
    ids = torch.tensor([s + [PAD] * (L - len(s)) for s in seqs], dtype=torch.long)
    # loss on the answer tokens only (HF shifts labels inside the loss: label j is predicted at position j - 1)
    labels = torch.tensor([[-100] * st + s[st:] + [-100] * (L - len(s)) for s, st in zip(seqs, starts)],
                          dtype=torch.long)
    if device.type == "cuda":
        ids, labels = ids.pin_memory(), labels.pin_memory()
    return ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def greedy_exact_match(model, problems, task, device, batch_size=512):
    """HF greedy decoding (model.generate, do_sample=False), prompts grouped by length (no padding)."""
    import torch

    by_len = {}
    for a, b in problems:
        by_len.setdefault(len(prompt_ids(a, b, task)), []).append((a, b))
    correct, total, examples = 0, 0, []
    model.eval()
    with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                         enabled=device.type == "cuda"):
        for _, group in sorted(by_len.items()):
            for i in range(0, len(group), batch_size):
                chunk = group[i:i + batch_size]
                x = torch.tensor([prompt_ids(a, b, task) for a, b in chunk], device=device)
                out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                     max_new_tokens=max_answer_tokens(task), do_sample=False,
                                     eos_token_id=EOS, pad_token_id=PAD)
                gen = out[:, x.shape[1]:].tolist()
                for (a, b), g in zip(chunk, gen):
                    ok = decode_answer(g, task) == a + b
                    correct += ok
                    total += 1
                    if len(examples) < 5:
                        examples.append({"a": a, "b": b, "ok": bool(ok), "gen_ids": g})
    model.train()
    return correct / max(1, total), examples


def mark_config_bf16(out: str) -> None:
    """Name BF16 as the dtype of the checkpoint saved in ``out`` (its config.json), in both of HF's spellings."""
    path = os.path.join(out, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    cfg.setdefault("dtype", "bfloat16")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--max-seconds", type=float, default=180.0, help="hard budget for the training loop")
    p.add_argument("--target-acc", type=float, default=0.995, help="stop early at this held-out exact match")
    p.add_argument("--eval-every-s", type=float, default=15.0)
    p.add_argument("--eval-n", type=int, default=512, help="held-out problems per periodic evaluation")
    p.add_argument("--final-eval-n", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--min-digits", type=int, default=3)
    p.add_argument("--max-digits", type=int, default=5)
    p.add_argument("--no-pad-operands", action="store_true", help="variable-width operands (harder)")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="characters of digits and spaces before the operands (long-context decodes; default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    a = p.parse_args(argv)
    if a.prefix_len < 0:
        p.error(f"--prefix-len must be >= 0, got {a.prefix_len}")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    import random

    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    t_start = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    task = dict(DEFAULT_TASK, min_digits=args.min_digits, max_digits=args.max_digits,
                pad_operands=not args.no_pad_operands, prefix_len=args.prefix_len)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = model_config(args, task)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01,
                            fused=device.type == "cuda")
    eval_set = test_problems(args.eval_n, seed=777, task=task)
    print(f"[train_toy] device {device}, {n_params / 1e6:.1f} M params, task {task['min_digits']}-"
          f"{task['max_digits']} digit addition (reversed), batch {args.batch_size}, budget {args.max_seconds:.0f} s",
          flush=True)

    history, step, acc, last_eval, t0 = [], 0, 0.0, time.time(), time.time()
    loss_ema = None
    while True:
        elapsed = time.time() - t0
        if elapsed >= args.max_seconds:
            break
        frac = min(1.0, elapsed / args.max_seconds)
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, labels = make_batch(rng, args.batch_size, task, device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            lv = loss.item()
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
        if time.time() - last_eval >= args.eval_every_s:
            acc, _ = greedy_exact_match(model, eval_set, task, device)
            last_eval = time.time()
            history.append({"step": step, "s": round(last_eval - t0, 1), "loss_ema": loss_ema, "lr": lr,
                            "heldout_em": acc})
            print(f"[train_toy] step {step:6d}  {last_eval - t0:6.1f} s  loss {loss_ema or loss.item():.4f}"
                  f"  lr {lr:.2e}  held-out EM {acc:.4f}", flush=True)
            if acc >= args.target_acc:
                print(f"[train_toy] target {args.target_acc} reached, stopping", flush=True)
                break
    train_s = time.time() - t0

    final_set = test_problems(args.final_eval_n, seed=12345, task=task)
    model_bf16 = model.to(torch.bfloat16)
    final_acc, examples = greedy_exact_match(model_bf16, final_set, task, device)

    os.makedirs(args.out, exist_ok=True)
    model_bf16.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                                                    do_sample=False, max_new_tokens=max_answer_tokens(task))
    model_bf16.save_pretrained(args.out, safe_serialization=True)
    build_tokenizer(context_length(task)).save_pretrained(args.out)
    mark_config_bf16(args.out)
    with open(os.path.join(args.out, "task.json"), "w") as f:
        json.dump(task, f, indent=1)
    report = {"steps": step, "train_seconds": round(train_s, 1), "total_seconds": round(time.time() - t_start, 1),
              "params_m": round(n_params / 1e6, 2), "heldout_exact_match_bf16_hf_greedy": final_acc,
              "final_eval_n": len(final_set), "history": history, "examples": examples, "args": vars(args),
              "device": str(torch.cuda.get_device_name(0)) if device.type == "cuda" else "cpu"}
    with open(os.path.join(args.out, "train_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"[train_toy] saved {args.out}: {step} steps in {train_s:.0f} s; held-out exact match (HF greedy, bf16, "
          f"n={len(final_set)}): {final_acc:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
