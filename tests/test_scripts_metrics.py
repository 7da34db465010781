"""CPU tests of the GPU measurement scripts' pure parts: metrics, log/trace parsing, tables, task, CLI wiring."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import accuracy_metrics as AM
import accuracy_regression as AR
import bench_rollout as BR
import bench_rollout_configs as BRC
import bench_rollout_report as BRR
import bench_startup as BS
import kernel_trace as KT
import make_models as MM
import pytest
import train_toy_policy as TT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _softmax_logs(logits):
    m = max(logits)
    z = m + math.log(sum(math.exp(x - m) for x in logits))
    return [x - z for x in logits]


# ---------------------------------------------------------------------------------------------------------------
# accuracy metrics
# ---------------------------------------------------------------------------------------------------------------

def test_kl_exact_full_vocab():
    lp = _softmax_logs([2.0, 1.0, 0.5, -1.0])
    lq = _softmax_logs([1.8, 1.2, 0.4, -0.7])
    want = sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))
    kl, cov, n = AM.kl_divergence(dict(enumerate(lp)), dict(enumerate(lq)))
    assert kl == pytest.approx(want, rel=1e-9)
    assert cov == pytest.approx(1.0)
    assert n == 4


def test_kl_identical_is_zero_and_asymmetric_otherwise():
    lp = dict(enumerate(_softmax_logs([0.3, 0.1, -2.0])))
    assert AM.kl_divergence(lp, lp)[0] == pytest.approx(0.0, abs=1e-15)
    lq = dict(enumerate(_softmax_logs([3.0, 0.1, -2.0])))
    assert AM.kl_divergence(lp, lq)[0] != pytest.approx(AM.kl_divergence(lq, lp)[0])


def test_kl_topk_intersection_renormalizes_and_reports_coverage():
    full_p = _softmax_logs([3.0, 2.0, 1.0, 0.0, -1.0])
    full_q = _softmax_logs([2.9, 2.1, 0.0, 1.0, -1.0])
    p = {0: full_p[0], 1: full_p[1], 2: full_p[2]}  # top-3 of P
    q = {0: full_q[0], 1: full_q[1], 3: full_q[3]}  # top-3 of Q
    kl, cov, n = AM.kl_divergence(p, q)
    assert n == 2
    assert cov == pytest.approx(math.exp(full_p[0]) + math.exp(full_p[1]))
    rp = _softmax_logs([full_p[0], full_p[1]])
    rq = _softmax_logs([full_q[0], full_q[1]])
    assert kl == pytest.approx(sum(math.exp(a) * (a - b) for a, b in zip(rp, rq)))
    assert math.isnan(AM.kl_divergence({0: 0.0}, {1: 0.0})[0])


def test_top_entries_and_argmax():
    d = AM.top_entries_to_dict([(-0.1, 5, None), (-2.5, 7, "x")])
    assert d == {5: -0.1, 7: -2.5}
    assert AM.top_entries_to_dict(None) == {}
    assert AM.argmax_token(d) == 5
    assert AM.argmax_token({}) is None


def test_token_mult_prob_error_matches_nemo_rl_definition():
    assert AM.token_mult_prob_error([-0.5, -1.0], [-0.5, -1.0]) == pytest.approx(1.0)
    a, b = [-0.1, -2.0, -0.3], [-0.2, -1.5, -0.3]
    want = (math.exp(0.1) + math.exp(0.5) + math.exp(0.0)) / 3
    assert AM.token_mult_prob_error(a, b) == pytest.approx(want)
    assert AM.token_mult_prob_error(b, a) == pytest.approx(want)  # symmetric in |delta|
    assert AM.token_mult_prob_error([None, -1.0], [-3.0, -1.0]) == pytest.approx(1.0)  # None skipped
    assert math.isnan(AM.token_mult_prob_error([], []))


def test_prefix_and_percentile():
    assert AM.matching_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert AM.matching_prefix_len([], [1]) == 0
    assert AM.matching_prefix_len([1, 2], [1, 2]) == 2
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert AM.percentile(xs, 50) == 3.0
    assert AM.percentile(xs, 99) == pytest.approx(4.96)  # numpy linear interpolation
    assert AM.percentile([float("nan")], 50) != AM.percentile([float("nan")], 50)
    s = AM.summarize([0.1, 0.2, 0.3])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.2) and s["max"] == 0.3
    assert AM.summarize([])["mean"] is None


def _meta_for(seq, dist_fn, out_tokens=1):
    """A fake SGLang meta_info for a scoring request with logprob_start_len=0."""
    top = [None] + [[(lp, t, None) for t, lp in dist_fn(j).items()] for j in range(1, len(seq))]
    tok = [(None, seq[0], None)] + [(dist_fn(j)[seq[j]], seq[j], None) for j in range(1, len(seq))]
    return {"input_top_logprobs": top, "input_token_logprobs": tok,
            "output_top_logprobs": [[(-0.1, 1, None)]] * out_tokens,
            "output_token_logprobs": [(-0.1, 1, None)] * out_tokens}


def test_scoring_dists_alignment():
    seq = [1, 4, 5, 6]
    dist = lambda j: {t: math.log(0.25) for t in range(4, 8)}  # noqa: E731
    meta = _meta_for(seq, dist)
    d = AM.scoring_dists(meta, len(seq))
    assert len(d) == 3 and d[0] == {4: math.log(0.25), 5: math.log(0.25), 6: math.log(0.25), 7: math.log(0.25)}
    lps = AM.scoring_token_logprobs(meta, len(seq))
    assert lps == [pytest.approx(math.log(0.25))] * 3
    # fewer rows than tokens (e.g. a cached prefix): aligned at the end, missing rows empty / None
    short = {"input_top_logprobs": meta["input_top_logprobs"][1:],
             "input_token_logprobs": meta["input_token_logprobs"][1:]}
    assert AM.scoring_dists(short, len(seq)) == d
    assert AM.scoring_token_logprobs(short, len(seq)) == lps
    shorter = {"input_top_logprobs": meta["input_top_logprobs"][2:]}
    assert AM.scoring_dists(shorter, len(seq)) == [{}] + d[1:]
    assert AM.output_logprobs(meta) == [-0.1]


def _record(prompts, conts, shift=0.0, gen=None):
    """Synthetic engine record: uniform-ish dists, optionally shifted toward token 4."""
    rec = {"gen": [], "score": []}
    for i, (p, c) in enumerate(zip(prompts, conts)):
        seq = p + c
        dists, lps = [], []
        for j in range(1, len(seq)):
            d = dict(enumerate(_softmax_logs([shift if t == 4 else 0.0 for t in range(8)])))
            dists.append(d)
            lps.append(d[seq[j]])
        rec["score"].append({"dists": dists, "token_logprobs": lps})
        out = gen[i] if gen else c
        rec["gen"].append({"output_ids": out, "logprobs": [math.log(0.5)] * len(out)})
    return rec


def test_compare_end_to_end():
    prompts = [[1, 5, 6], [1, 7]]
    conts = [[4, 4, 2], [5, 2]]
    bf = _record(prompts, conts)
    same = AM.compare(prompts, bf, _record(prompts, conts))
    assert same["kl_all"]["max"] == pytest.approx(0.0, abs=1e-12)
    assert same["greedy_identical_fraction"] == 1.0
    assert same["tmpe_fp8_vs_bf16_engine_scoring"] == pytest.approx(1.0)
    assert same["kl_continuation"]["n"] == 5 and same["kl_prompt"]["n"] == 3
    fp = _record(prompts, conts, shift=0.5, gen=[[4, 4, 2], [6, 2]])
    hf = {"bf16": [[math.log(0.5)] * 3, [math.log(0.5)] * 2], "fp8": [[math.log(0.25)] * 3, [math.log(0.5)] * 2]}
    r = AM.compare(prompts, bf, fp, hf=hf, task_answers=[1, 2], decode_fn=lambda ids: len(ids) - 2)
    assert r["kl_continuation"]["mean"] > 0
    assert r["greedy_identical_fraction"] == 0.5
    assert r["greedy_mean_matching_prefix"] == pytest.approx((3 + 0) / 2)
    assert r["tmpe_bf16_rollout_vs_hf_bf16"] == pytest.approx(1.0)
    assert r["tmpe_fp8_rollout_vs_hf_bf16"] == pytest.approx((3 * 2.0 + 2 * 1.0) / 5)
    assert r["top1_agreement_continuation"] == 0.0  # shift makes token 4 the FP8 argmax; BF16 ties -> token 0
    assert r["task_exact_match_bf16"] == 0.5
    text = AM.format_table(r, {"model": "m", "quantization": "fp8_online_blockwise", "n_prompts": 2, "top_k": 8,
                               "kl_exact": True})
    assert "token_mult_prob_error FP8 rollout vs HF BF16" in text and "exact full-vocabulary KL" in text


# ---------------------------------------------------------------------------------------------------------------
# bench_rollout: log parsing, tables, traces, CLI
# ---------------------------------------------------------------------------------------------------------------

LOG = """\
[   1.0] [2026-11-22 10:00:00 TP0] [fp8rl] 252 linear layers: fp8_online_blockwise W 128x128 fp32 scales, A 1x128 dynamic
[   2.0] [2026-11-22 10:00:01 TP0] [bench_rollout] quant methods: {'QKVParallelLinear:Fp8LinearMethod': 36}
[  20.0] [2026-11-22 10:00:20 TP0] Load weight end. elapsed=3.21 s, type=Qwen3ForCausalLM, quant=fp8, fmt=e4m3, avail mem=70.12 GB, mem usage=8.81 GB.
[  21.0] [2026-11-22 10:00:21 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 335592, K size: 23.04 GB, V size: 23.04 GB
[  60.0] max_total_num_tokens=335592
[  61.0] Warmup ...
[  61.5] Prefill. latency: 0.50000 s, throughput:  65536.00 token/s
[  61.6] Decode 0. Batch size: 64, latency: 0.00800 s, throughput:   8000.00 token/s
[  62.0] Decode.  median latency: 0.00800 s, median throughput:   8000.00 token/s
[  62.1] Total. latency:  0.800 s, throughput:  20000.00 token/s
[  62.2] Benchmark ...
[  62.7] Prefill. latency: 0.49110 s, throughput:  66718.00 token/s
[  62.8] Decode 0. Batch size: 64, latency: 0.00776 s, throughput:   8245.00 token/s
[  70.0] Decode.  median latency: 0.00776 s, median throughput:   8245.00 token/s
[  70.1] Total. latency:  8.479 s, throughput:  11828.00 token/s
[  70.2] skipping (256, 512, 1024) due to max batch size limit
[  70.3] [bench_rollout] gemm calls (eager + CUDA-graph capture; replays run no Python): {'deepgemm block': 1584}
"""  # noqa: E501  (SGLang's log lines as they are written)


def test_parse_log_facts_and_rows():
    info = BRR.parse_log(LOG)
    assert info["weight_gib"] == pytest.approx(8.81)
    assert info["kv_tokens"] == 335592
    assert info["kv_dtype"] == "torch.bfloat16"
    assert info["fp8rl"][0].startswith("[fp8rl] 252 linear layers")
    assert info["quant_methods"] and "Fp8LinearMethod" in info["quant_methods"][0]
    assert "deepgemm block" in info["gemm_calls"]
    assert info["skipped_bs"] == [256]
    assert info["error_tail"] == []
    rows = BRR.parse_rows_from_log(LOG)
    assert len(rows) == 1  # the warmup pass is not a result
    assert rows[0]["batch_size"] == 64 and rows[0]["median_decode_throughput"] == 8245.0
    assert rows[0]["prefill_throughput"] == 66718.0 and rows[0]["overall_throughput"] == 11828.0


def test_parse_log_kv_fallback_and_traceback():
    text = ("KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1234, KV size: 1.00 GB\n"
            "Traceback (most recent call last):\n  File x\nRuntimeError: boom\n")
    info = BRR.parse_log(text)
    assert info["kv_tokens"] == 1234 and info["weight_gib"] is None
    assert info["error_tail"][0].startswith("Traceback") and info["error_tail"][-1] == "RuntimeError: boom"


def _row(bs, prefill, decode, total):
    return {"batch_size": bs, "prefill_throughput": prefill, "median_decode_throughput": decode,
            "median_decode_latency": bs / decode, "overall_throughput": total}


def test_ratios_targets_and_summary():
    results = {
        "bf16": {"rc": 0, "rows": [_row(64, 44000, 6300, 14700), _row(128, 43500, 9450, 19700)], "weight_gib": 15.28,
                 "kv_tokens": 288517},
        "fp8_online_blockwise": {"rc": 0, "rows": [_row(64, 60000, 8250, 19800), _row(128, 65000, 13500, 24000)],
                                 "weight_gib": 8.81, "kv_tokens": 335592, "fp8rl": ["[fp8rl] scheme"]},
        "block_prequant": {"rc": 0, "rows": [_row(64, 66700, 8245, 19828), _row(128, 65053, 9431, 21871)]},
        "fp8_channel": {"rc": 1, "rows": [], "status": "failed rc=1", "skipped_bs": []},
    }
    best = BRR.last_pass(results)
    assert BRR.ratio(best, "fp8_online_blockwise", "bf16", 128, "decode") == pytest.approx(13500 / 9450)
    assert BRR.ratio(best, "fp8_online_blockwise", "fp8_channel", 128, "decode") is None
    t = {(x["num"], x["den"], x["metric"], x["bs"]): x for x in BRR.check_targets(best)}
    assert t[("fp8_online_blockwise", "bf16", "decode", 128)]["status"] == "PASS"  # 1.429 >= 1.40
    assert t[("fp8_online_blockwise", "block_prequant", "prefill", 64)]["status"] == "FAIL"  # 60000 / 66700
    assert t[("fp8_online_blockwise", "block_prequant", "decode", 64)]["status"] == "PASS"  # 8250 / 8245
    text = BRR.format_summary(results, {"model_desc": "Qwen3-8B-shaped", "input_len": 512, "output_len": 1024,
                                       "batch_sizes": [64, 128]})
    assert "| fp8_online_blockwise | 128 | 65,000 | 13,500 |" in text
    assert "| fp8_channel | 64 | failed rc=1 |" in text
    assert "online/bf16 decode @bs128 >= 1.40: 1.429 PASS" in text
    assert "online / block_prequant" in text


def test_ratio_target_threshold_edges():
    results = {"fp8_online_blockwise": {"rows": [_row(64, 98, 98, 1)]},
               "block_prequant": {"rows": [_row(64, 100, 100, 1)]}}
    t = BRR.check_targets(BRR.last_pass(results))
    by = {(x["metric"], x["den"]): x for x in t}
    assert by[("decode", "block_prequant")]["status"] == "PASS"  # 0.98 >= 0.98
    assert by[("decode", "bf16")]["status"] == "n/a"


def test_last_pass_takes_the_repeat():
    results = {"bf16": {"rows": [_row(64, 1, 1, 1), _row(128, 1, 1, 1), _row(64, 2, 2, 2)]}}
    assert BRR.last_pass(results)[("bf16", 64)]["prefill_throughput"] == 2


def test_kernel_classes_and_trace_summary(tmp_path):
    assert KT.classify_kernel("void deep_gemm::sm90_fp8_gemm_1d2d_impl<...>") == "fp8 gemm"
    assert KT.classify_kernel("_per_token_group_quant_fp8") == "act quant"
    assert KT.classify_kernel("_fwd_kernel_stage1") == "attention"
    for ours in ("_decode_attn_plan_kernel", "_decode_attn_split_kernel", "_decode_attn_merge_kernel"):
        assert KT.classify_kernel(ours) == "attention"  # the split-KV decode's three launches
    assert KT.classify_kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm (bf16)"
    assert KT.classify_kernel("void flashinfer::norm::FusedAddRMSNormKernel") == "norm/rope/act"
    assert KT.classify_kernel("memcpy_thing") == "other"
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "void deep_gemm::sm90_fp8_gemm_1d2d_impl", "dur": 300.0},
        {"ph": "X", "cat": "kernel", "name": "void deep_gemm::sm90_fp8_gemm_1d2d_impl", "dur": 300.0},
        {"ph": "X", "cat": "kernel", "name": "_per_token_group_quant_fp8", "dur": 100.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0},
        {"ph": "i", "cat": "kernel", "name": "instant", "dur": 5.0},
    ]}
    p = tmp_path / "x_decode.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump(trace, f)
    tot = KT.kernel_totals(KT.load_trace(str(p)))
    assert tot == {"void deep_gemm::sm90_fp8_gemm_1d2d_impl": [600.0, 2], "_per_token_group_quant_fp8": [100.0, 1]}
    s = KT.format_kernel_summary(tot, "x", steps=2)
    assert "0.350 ms GPU kernel time per decode step" in s
    assert "fp8 gemm 85.7%" in s
    assert "no GPU kernel events" in KT.format_kernel_summary({}, "y")


def test_cli_defaults_and_moe():
    a = BR.parse_args([])
    assert a.batch_sizes == [64, 128] and a.output_len == 1024 and a.input_len == 512
    assert a.mem_fraction_static == 0.7 and a.configs == BRC.CONFIGS
    a = BR.parse_args(["--batch-sizes", "1", "8", "32", "64", "128", "256", "--output-len", "64"])
    assert a.batch_sizes == [1, 8, 32, 64, 128, 256] and a.output_len == 64
    m = BR.parse_args(["--moe"])
    assert m.batch_sizes == [32, 64] and m.output_len == 512 and m.mem_fraction_static == 0.88
    assert BRC.config_spec("block_prequant", moe=True)["model"] == "qwen3-30b-a3b-block"
    assert BRC.config_spec("fp8_online_blockwise")["flags"] == ["--quantization", "fp8_online_blockwise"]
    assert BRC.config_spec("fp8_channel")["env"]["FP8RL_BENCH_REFILL"] == "1"
    assert BRC.config_spec("fp8_online_blockwise")["env"]["FP8RL_BENCH_REFILL"] == "0"
    with pytest.raises(ValueError):
        BRC.config_spec("nope")


def test_bench_flags_parse_with_sglang_bench_one_batch():
    """Every config's flags are accepted by SGLang 0.5.17's own bench_one_batch parser (real sglang on CPU)."""
    import argparse

    one_batch = pytest.importorskip("sglang.benchmark.one_batch")
    from sglang.srt import server_args as SA

    if "fp8_online_blockwise" not in SA.QUANTIZATION_CHOICES:  # the plugin adds it at load_plugins() time
        SA.add_quantization_method_choices(["fp8_online_blockwise"])
    for cfg in BRC.CONFIGS:
        argv = (BRC.bench_flags("/m/qwen3-8b", [64, 128], 512, 1024, 0.7, "/tmp/r.jsonl", cfg, repeat=2)
                + BRC.config_spec(cfg)["flags"] + BRC.profile_flags(cfg, 1024, 3))
        parser = argparse.ArgumentParser()
        SA.ServerArgs.add_cli_args(parser)
        one_batch.BenchArgs.add_cli_args(parser)
        ns = parser.parse_args(argv)
        ba = one_batch.BenchArgs.from_cli_args(ns)
        assert ba.batch_size == (64, 128, 64, 128) and ba.output_len == (1024,)
        assert ns.cuda_graph_bs_decode == [64, 128] and ns.disable_prefill_cuda_graph
        assert ba.profile and ba.profile_stage == "decode" and ba.profile_activities == ("GPU",)
        assert ns.quantization == {"bf16": None, "block_prequant": None, "fp8_channel": "fp8",
                                   "fp8_online_blockwise": "fp8_online_blockwise"}[cfg]
    # --prefill-graph keeps SGLang's prefill CUDA graphs (the server default)
    argv = BRC.bench_flags("/m/qwen3-8b", [1, 8], 512, 64, 0.7, "/tmp/r.jsonl", "bf16", prefill_graph=True)
    parser = argparse.ArgumentParser()
    SA.ServerArgs.add_cli_args(parser)
    one_batch.BenchArgs.add_cli_args(parser)
    assert not parser.parse_args(argv).disable_prefill_cuda_graph


# ---------------------------------------------------------------------------------------------------------------
# toy task, tokenizer, models, CLIs
# ---------------------------------------------------------------------------------------------------------------

def test_addition_task_roundtrip_and_split():
    import random

    task = dict(TT.DEFAULT_TASK)
    assert TT.prompt_text(123, 4567, task) == "32100+76540="
    assert TT.answer_text(123, 4567, task) == "096400"
    ans = TT.answer_ids(123, 4567, task)
    assert ans[-1] == TT.EOS and TT.decode_answer(ans, task) == 4690
    assert TT.decode_answer([TT.EOS], task) is None
    var = dict(task, pad_operands=False)
    assert TT.prompt_text(123, 4567, var) == "321+7654="
    assert TT.decode_answer(TT.answer_ids(123, 4567, var), var) == 4690
    tr = TT.sample_problems(random.Random(0), 300, "train", task)
    te = TT.test_problems(300, seed=1, task=task)
    assert not any(TT.is_test(a, b) for a, b in tr) and all(TT.is_test(a, b) for a, b in te)
    assert all(100 <= a <= 99999 and 100 <= b <= 99999 for a, b in tr + te)
    assert TT.test_problems(50, seed=3) == TT.test_problems(50, seed=3)
    assert 0.02 < sum(TT.is_test(a, b) for a, b in TT.sample_problems(random.Random(1), 2000, "train", task)
                      + te) / 2300 < 0.2
    assert len(TT.prompt_ids(1, 2, task)) == 13 and TT.max_answer_tokens(task) == 7


def test_toy_tokenizer_matches_task_ids(tmp_path):
    tok = TT.build_tokenizer()
    assert tok(TT.prompt_text(123, 4567)).input_ids == TT.prompt_ids(123, 4567)
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    t2 = AutoTokenizer.from_pretrained(tmp_path)
    assert t2(TT.prompt_text(5, 77)).input_ids == TT.prompt_ids(5, 77)
    assert (t2.bos_token_id, t2.eos_token_id, t2.pad_token_id) == (TT.BOS, TT.EOS, TT.PAD)
    assert t2.decode(TT.answer_ids(123, 4567), skip_special_tokens=True) == "096400"
    assert len(t2) <= TT.VOCAB_SIZE


def test_train_toy_policy_tiny_cpu_smoke(tmp_path):
    out = tmp_path / "toy"
    rc = TT.main(["--out", str(out), "--max-seconds", "2", "--hidden", "64", "--layers", "1", "--heads", "1",
                  "--kv-heads", "1", "--head-dim", "64", "--intermediate", "128", "--batch-size", "16",
                  "--eval-every-s", "1000", "--final-eval-n", "8", "--device", "cpu"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["vocab_size"] == TT.VOCAB_SIZE and cfg["eos_token_id"] == TT.EOS
    assert (out / "model.safetensors").exists() and json.loads((out / "task.json").read_text())["pad_operands"]
    rep = json.loads((out / "train_report.json").read_text())
    assert rep["final_eval_n"] == 8 and 0.0 <= rep["heldout_exact_match_bf16_hf_greedy"] <= 1.0
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out)
    assert m.config.num_hidden_layers == 1


def test_a_prefix_puts_a_long_context_before_the_same_problem():
    """--prefix-len N: N digits and spaces before the operands, the same for a problem every time, different between
    problems; the answer unchanged; the model's and tokenizer's context grow to hold the sequence."""
    task = dict(TT.DEFAULT_TASK)
    assert "prefix_len" not in task and TT.context_length(task) == TT.MIN_CONTEXT == 128
    long = dict(task, prefix_len=300)
    text = TT.prompt_text(123, 4567, long)
    assert text == TT.filler(123, 4567, 300) + " " + TT.prompt_text(123, 4567, task) and len(text) == 300 + 1 + 12
    assert set(text[:300]) <= set(TT.FILLER_CHARS) and len(set(text[:300])) == len(TT.FILLER_CHARS)
    assert TT.prompt_text(123, 4567, long) == text and TT.filler(124, 4567, 300) != text[:300]
    assert TT.answer_ids(123, 4567, long) == TT.answer_ids(123, 4567, task)
    assert len(TT.prompt_ids(123, 4567, long)) == 1 + 313
    # the whole sequence (bos, prompt, answer with eos) fits the context, the next power of two from 128
    assert TT.context_length(long) == 512 and TT.context_length(dict(task, prefix_len=2048)) == 4096
    assert TT.context_length(dict(task, prefix_len=107)) == 128 and TT.context_length(dict(task, prefix_len=108)) == 256
    tok = TT.build_tokenizer(TT.context_length(long))
    assert tok(text).input_ids == TT.prompt_ids(123, 4567, long) and tok.model_max_length == 512
    with pytest.raises(SystemExit):
        TT.parse_args(["--out", "x", "--prefix-len", "-1"])


def test_train_toy_policy_with_a_prefix_cpu_smoke(tmp_path):
    out = tmp_path / "toy_long"
    rc = TT.main(["--out", str(out), "--max-seconds", "2", "--hidden", "64", "--layers", "1", "--heads", "1",
                  "--kv-heads", "1", "--head-dim", "64", "--intermediate", "128", "--batch-size", "4",
                  "--eval-every-s", "1000", "--final-eval-n", "4", "--device", "cpu", "--prefix-len", "200"])
    assert rc == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 256
    task = json.loads((out / "task.json").read_text())
    assert task["prefix_len"] == 200 and len(TT.prompt_ids(5, 77, task)) == 1 + 200 + 1 + 12
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert tok(TT.prompt_text(5, 77, task)).input_ids == TT.prompt_ids(5, 77, task) and tok.model_max_length == 256


def test_the_suite_trains_and_judges_a_prefix_toy_in_a_folder_of_its_own(tmp_path):
    """TOY_ARGS trains another toy policy beside the plain one, and the accuracy arms take that one, with their own
    records (a warm machine keeps both)."""
    from suite_stage import stage_command_lines

    args = "--prefix-len 2048 --batch-size 128"
    (train,) = stage_command_lines(tmp_path, "kv_acc", "train_toy_policy.py", TOY_ARGS=args)
    a = TT.parse_args(train.split("train_toy_policy.py", 1)[1].split())
    toy = f"{tmp_path}/work/toy_prefix_len_2048_batch_size_128"
    assert a.out == toy and a.prefix_len == 2048 and a.batch_size == 128
    os.makedirs(toy, exist_ok=True)
    open(os.path.join(toy, "model.safetensors"), "w").close()
    (acc,) = stage_command_lines(tmp_path, "kv_acc", "accuracy_regression.py", TOY_ARGS=args)
    assert f"--model {toy} " in acc and f"--records-dir {toy}_kv_acc_records " in acc
    (plain,) = stage_command_lines(tmp_path, "kv_acc", "train_toy_policy.py", unset=("TOY_ARGS",))
    assert f"--out {tmp_path}/work/toy " in plain + " " and "--prefix-len" not in plain


def test_default_toy_shapes_are_block_aligned():
    a = TT.parse_args(["--out", "x"])
    assert a.max_seconds == 180 and 4 <= a.layers <= 6
    for d in (a.hidden, a.intermediate, a.heads * a.head_dim, a.kv_heads * a.head_dim):
        assert d % 128 == 0


def test_make_models(tmp_path):
    for name in MM.ALL:
        MM.write(str(tmp_path), name)
    c8 = json.loads((tmp_path / "qwen3-8b" / "config.json").read_text())
    assert (c8["hidden_size"], c8["num_hidden_layers"], c8["num_attention_heads"], c8["num_key_value_heads"],
            c8["head_dim"], c8["intermediate_size"], c8["vocab_size"]) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert "quantization_config" not in c8
    cb = json.loads((tmp_path / "qwen3-8b-block" / "config.json").read_text())
    assert cb["quantization_config"] == MM.BLOCK_QUANT_CONFIG
    moe = json.loads((tmp_path / "qwen3-30b-a3b" / "config.json").read_text())
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (moe["hidden_size"], moe["num_hidden_layers"], moe["num_attention_heads"], moe["num_key_value_heads"],
            moe["head_dim"], moe["moe_intermediate_size"], moe["num_experts"], moe["num_experts_per_tok"],
            moe["vocab_size"], moe["norm_topk_prob"], moe["decoder_sparse_step"], moe["mlp_only_layers"]) == \
        (2048, 48, 32, 4, 128, 768, 128, 8, 151936, True, 1, [])
    assert json.loads((tmp_path / "qwen3-30b-a3b-block" / "config.json").read_text())["quantization_config"]
    from transformers import AutoConfig, AutoTokenizer

    ac = AutoConfig.from_pretrained(tmp_path / "qwen3-30b-a3b")
    assert ac.num_experts == 128 and ac.head_dim == 128
    assert AutoTokenizer.from_pretrained(tmp_path / "qwen3-small").eos_token_id is not None
    assert MM.ensure(str(tmp_path), ["qwen3-8b"]) == [str(tmp_path / "qwen3-8b")]


def test_scripts_import_light_and_help_works():
    code = (f"import sys; sys.path[:0] = [{SCRIPTS!r}, {os.path.join(SCRIPTS, 'gpu')!r}]; import bench_rollout, "
            "accuracy_regression, train_toy_policy, make_models; bad = [m for m in ('torch', 'sglang', "
            "'transformers', 'matplotlib') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    for s in ["bench_rollout.py", "accuracy_regression.py", "train_toy_policy.py", "gpu/make_models.py"]:
        r = subprocess.run([sys.executable, os.path.join(SCRIPTS, s), "--help"], capture_output=True, text=True,
                           cwd=ROOT, timeout=60)
        assert r.returncode == 0, (s, r.stderr[-2000:])
        assert "usage" in r.stdout.lower() or "make_models" in r.stdout or "usage:" in r.stdout


def test_bench_rollout_dry_run(capsys):
    assert BR.main(["--dry-run", "--out", "/tmp/never_written_fp8rl", "--configs", "bf16", "block_prequant"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-8b-block" in out and "FP8RL_BENCH_REFILL=1" in out and "_child" in out
    assert not os.path.exists("/tmp/never_written_fp8rl")


def test_suite_script_syntax():
    subprocess.run(["bash", "-n", os.path.join(SCRIPTS, "gpu", "run_gpu_suite.sh")], check=True)


@pytest.mark.parametrize("exclude", [None, "fp8rl_n64_sk4_pdl deepgemm_sms_124", "change"])
def test_gemm_ab_stage_runs_the_roofline_twice_the_second_without_the_candidates(tmp_path, exclude):
    """run_gpu_suite.sh gemm_ab: two roofline runs whose command lines parse with decode_roofline's own parser, the
    same cells, the second excluding (by names the server checks at start) what GEMM_AB_EXCLUDE names, or with the
    flags of GEMM_AB_CHANGE."""
    import shlex

    import decode_roofline
    from suite_stage import stage_command_lines

    from sglang_fp8rl.kernels import gemm_select as gs

    env = {} if exclude is None else {"GEMM_AB_CHANGE": "--fp8rl-producer-quant on"} if exclude == "change" \
        else {"GEMM_AB_EXCLUDE": exclude}
    lines = stage_command_lines(tmp_path, "gemm_ab", "scripts/decode_roofline.py",
                                unset=("GEMM_AB_EXCLUDE", "GEMM_AB_ARGS", "GEMM_AB_CHANGE"), **env)
    assert len(lines) == 2
    # the stand-in python3 records "$*": the one argument --extra-args=... comes back split at its spaces (it is last)
    runs = [decode_roofline.parse_args([*shlex.split(ln.partition(" --extra-args=")[0])[2:],
                                        f"--extra-args={ln.partition(' --extra-args=')[2]}"]) for ln in lines]
    assert runs[0].configs == runs[1].configs == ["fp8_online_blockwise"]
    assert runs[0].batch_sizes == runs[1].batch_sizes == [1, 8, 32] and runs[0].contexts == [4096, 12288]
    assert runs[0].attention_backend == "triton" and runs[0].profile_cells == [] and runs[0].check_cells == []
    assert runs[0].extra_args == "" and runs[0].out != runs[1].out
    if exclude == "change":
        assert runs[1].extra_args == "--fp8rl-producer-quant on"
        from sglang_fp8rl.server_args import parse_args

        assert parse_args(runs[1].extra_args.split()).producer_quant == "on"
        return
    names = (exclude or "fp8rl_n64_sk4_pdl").split()
    assert runs[1].extra_args.split() == [w for name in names for w in ("--fp8rl-gemm-exclude", name)]
    assert gs.check_excluded(names) == tuple(names)


def _suite_stage_args(stage: str) -> list[str]:
    """The bench_rollout.py arguments a run_gpu_suite.sh stage passes, with its shell expansions given values."""
    import re
    import shlex

    text = open(os.path.join(SCRIPTS, "gpu", "run_gpu_suite.sh")).read()
    block = text[text.index(f"\n    {stage})"):]
    block = block[:block.index(";;")].replace("\\\n", " ")
    block = re.sub(r"\$\{[A-Z_]+:-\}", "", re.sub(r"\$\(\([^)]*\)\)", "100", block))
    block = re.sub(r'"?\$[A-Z]+(/[a-z_]*)?"?', "/tmp/x", block)
    return shlex.split(block[block.index("scripts/bench_rollout.py") + len("scripts/bench_rollout.py"):])


@pytest.mark.parametrize("stage", ["tail", "eager"])
def test_suite_stages_parse_with_bench_rollout(stage):
    """The tail and eager stages' arguments are accepted by bench_rollout.py (a value starting with -- must be
    written --extra-args=VALUE)."""
    a = BR.parse_args(_suite_stage_args(stage))
    assert a.attention_backend == "fa3"
    if stage == "tail":
        assert a.input_lens == [4096, 8192] and a.batch_sizes == [1, 4, 16] and a.profile_decode
    else:
        assert a.extra_args == "--disable-cuda-graph" and a.batch_sizes == [64, 256, 384]


def test_run_config_streams_log_and_enforces_timeout(tmp_path):
    log = tmp_path / "a.log"
    code = f"import sys; sys.stdout.write({LOG!r})"
    r = BR.run_config("x", [sys.executable, "-c", code], dict(os.environ), str(log), timeout_s=60)
    assert r["rc"] == 0 and not r["timed_out"]
    assert BRR.parse_log(log.read_text())["kv_tokens"] == 335592
    r = BR.run_config("y", [sys.executable, "-c", "import time; print('hi', flush=True); time.sleep(60)"],
                      dict(os.environ), str(tmp_path / "b.log"), timeout_s=2)
    assert r["timed_out"] and r["rc"] != 0 and r["wall_s"] < 30
    assert "hi" in (tmp_path / "b.log").read_text()


def test_bench_rollout_main_with_fake_runs(tmp_path, monkeypatch):
    """main() end to end (models, per-config parsing, summary, results.json, logs.tgz) with the bench faked."""
    import tarfile

    def fake_run(cfg, cmd, env, log_path, timeout_s):
        assert "_child" in cmd and env["SGLANG_JIT_DEEPGEMM_PRECOMPILE"] == "0"
        with open(log_path, "w") as f:
            f.write(LOG)
        jl = cmd[cmd.index("--result-filename") + 1]
        with open(jl, "w") as f:
            dec = {"bf16": 6000.0, "fp8_online_blockwise": 9000.0}[cfg]
            f.write(json.dumps(dict(_row(64, 40000.0, dec, 10000.0), input_len=512, output_len=64)) + "\n")
        return {"rc": 0, "timed_out": False, "wall_s": 1.0}

    monkeypatch.setattr(BR, "run_config", fake_run)
    out = tmp_path / "out"
    rc = BR.main(["--configs", "bf16", "fp8_online_blockwise", "--batch-sizes", "64", "--output-len", "64",
                  "--model-dir", str(tmp_path / "models"), "--out", str(out)])
    assert rc == 0
    assert sorted(os.listdir(out)) == ["logs.tgz", "results.json", "summary.md"]
    res = json.loads((out / "results.json").read_text())
    assert res["results"]["fp8_online_blockwise"]["weight_gib"] == pytest.approx(8.81)
    assert any(r["num"] == "fp8_online_blockwise" and r["den"] == "bf16" and r["decode"] == pytest.approx(1.5)
               for r in res["ratios"])
    assert "| online / bf16 | 64 |" in (out / "summary.md").read_text()
    with tarfile.open(out / "logs.tgz") as tf:
        names = tf.getnames()
    assert "raw/bf16.log" in names and "raw/env.txt" in names
    assert (tmp_path / "models" / "qwen3-8b" / "config.json").exists()


def test_bench_rollout_tail_table_with_several_prompt_lengths(tmp_path, monkeypatch):
    """--input-len 4096 8192: one process per config runs both lengths (SGLang's own parser reads the flags), the
    main tables keep the first length, the tail table gives per-(context, bs) step times, speed-ups and the bs-1 8k
    target."""
    import argparse

    one_batch = pytest.importorskip("sglang.benchmark.one_batch")
    from sglang.srt import server_args as SA

    step = {("bf16", 4096): 0.0072, ("bf16", 8192): 0.0080, ("fp8_online_blockwise", 4096): 0.0048,
            ("fp8_online_blockwise", 8192): 0.0060}
    seen = []

    def fake_run(cfg, cmd, env, log_path, timeout_s):
        flags = cmd[cmd.index("_child") + 1:]
        seen.append(flags)
        with open(log_path, "w") as f:
            f.write(LOG)
        with open(flags[flags.index("--result-filename") + 1], "w") as f:
            for il in (4096, 8192):
                for bs in (1, 4):
                    lat = step[(cfg, il)] * (1 + bs / 100)
                    f.write(json.dumps(dict(_row(bs, 40000.0, bs / lat, 1000.0), median_decode_latency=lat,
                                            input_len=il, output_len=64)) + "\n")
        return {"rc": 0, "timed_out": False, "wall_s": 1.0}

    monkeypatch.setattr(BR, "run_config", fake_run)
    out = tmp_path / "out"
    assert BR.main(["--configs", "bf16", "fp8_online_blockwise", "--batch-sizes", "1", "4", "--input-len", "4096",
                    "8192", "--output-len", "64", "--model-dir", str(tmp_path / "models"), "--out", str(out)]) == 0
    if "fp8_online_blockwise" not in SA.QUANTIZATION_CHOICES:
        SA.add_quantization_method_choices(["fp8_online_blockwise"])
    parser = argparse.ArgumentParser()
    SA.ServerArgs.add_cli_args(parser)
    one_batch.BenchArgs.add_cli_args(parser)
    assert one_batch.BenchArgs.from_cli_args(parser.parse_args(seen[1])).input_len == (4096, 8192)
    res = json.loads((out / "results.json").read_text())
    by = {(r["input_len"], r["bs"]): r for r in res["tail"]}
    assert by[(8192, 1)]["speedup"]["fp8_online_blockwise"] == pytest.approx(0.0080 / 0.0060)
    assert by[(4096, 4)]["step_ms"]["bf16"] == pytest.approx(7.2 * 1.04)
    text = (out / "summary.md").read_text()
    assert "input 4096" in text and "## The tail" in text
    assert "| 8192 | 1 | 8.08 | 6.06 | 1.333 |" in text
    assert "target fp8_online_blockwise/bf16 decode @bs1, context 8192 >= 1.40: 1.333 FAIL" in text
    # the main ratio table is the first length's: 7.2 / 4.8 at bs 1
    assert any(r["bs"] == 1 and r["decode"] == pytest.approx(1.5) for r in res["ratios"])


class _FakeEngine:
    """Stands in for sglang.Engine: a fixed 'model' p(next | last token), answers in SGLang's meta_info format."""

    instances = []

    def __init__(self, **kw):
        self.kw = kw
        self.shift = 0.3 if kw.get("quantization") else 0.0
        _FakeEngine.instances.append(self)
        # like the engine's scheduler subprocess: straight to the (redirected) fd 1
        os.write(1, b"[2026-11-22 TP0] [fp8rl] fake scheme line\n" if kw.get("quantization") else b"bf16 engine\n")

    def _dist(self, last):
        logits = [0.0] * 32
        logits[(last * 7 + 3) % 17] = 4.0
        logits[TT.EOS] = 1.0 + self.shift
        lp = _softmax_logs(logits)
        return dict(enumerate(lp))

    def _top(self, d, k):
        return [(lp, t, None) for t, lp in sorted(d.items(), key=lambda kv: -kv[1])[:k]]

    def generate(self, input_ids, sampling_params, return_logprob, top_logprobs_num, logprob_start_len):
        assert return_logprob and logprob_start_len == 0
        outs = []
        for ids in input_ids:
            top_in = [None] + [self._top(self._dist(ids[j - 1]), top_logprobs_num) for j in range(1, len(ids))]
            tok_in = [(None, ids[0], None)] + [(self._dist(ids[j - 1])[ids[j]], ids[j], None)
                                               for j in range(1, len(ids))]
            out, last, top_out, tok_out = [], ids[-1], [], []
            for _ in range(sampling_params["max_new_tokens"]):
                d = self._dist(last)
                t = max(d, key=d.get)
                out.append(t)
                top_out.append(self._top(d, top_logprobs_num))
                tok_out.append((d[t], t, None))
                last = t
                if t in sampling_params.get("stop_token_ids", []):
                    break
            outs.append({"output_ids": out, "meta_info": {
                "input_top_logprobs": top_in, "input_token_logprobs": tok_in, "output_top_logprobs": top_out,
                "output_token_logprobs": tok_out, "finish_reason": {"type": "stop"}}})
        return outs

    def shutdown(self):
        pass


def test_accuracy_regression_main_with_fake_engine(tmp_path, monkeypatch):
    sglang = pytest.importorskip("sglang")
    monkeypatch.setattr(sglang, "Engine", _FakeEngine, raising=False)
    model = tmp_path / "toy"
    model.mkdir()
    TT.build_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"vocab_size": TT.VOCAB_SIZE}))
    (model / "task.json").write_text(json.dumps(TT.DEFAULT_TASK))
    out = tmp_path / "acc"
    rc = AR.main(["--model", str(model), "--task", "addition", "--out", str(out), "--n-prompts", "10", "--chunk", "4",
                  "--no-hf-reference"])
    assert rc == 0
    res = json.loads((out / "accuracy.json").read_text())
    m = res["metrics"]
    assert res["meta"]["kl_exact"] and res["meta"]["top_k"] == TT.VOCAB_SIZE and res["meta"]["n_prompts"] == 10
    assert m["kl_prompt"]["n"] == 10 * 12 and m["kl_continuation"]["n"] > 0 and m["kl_all"]["mean"] > 0
    assert 0.0 <= m["greedy_identical_fraction"] <= 1.0 and "task_exact_match_fp8" in m
    assert res["meta"]["fp8rl"] == ["[fp8rl] fake scheme line"]
    assert "[fp8rl] fake scheme line" in (out / "engine_fp8.log").read_text()
    assert [e.kw.get("quantization") for e in _FakeEngine.instances[-2:]] == [None, "fp8_online_blockwise"]
    kw = _FakeEngine.instances[-1].kw
    assert (kw["attention_backend"], kw["sampling_backend"], kw["grammar_backend"]) == ("triton", "pytorch", "none")
    assert kw["mem_fraction_static"] == 0.3 and kw["disable_radix_cache"] and kw["cuda_graph_bs_decode"] == [4]
    assert "KL(BF16‖FP8) continuation positions" in (out / "summary.md").read_text()


# ---------------------------------------------------------------------------------------------------------------------
# bench_startup.py: log parsing and the cache folders a cold start empties


def test_bench_startup_parses_the_gemm_select_lines():
    log = "\n".join([
        "[2026-11-22 06:44:00] Load weight end. elapsed=1.64 s",
        "[2026-11-22 06:44:30] [fp8rl] gemm_select: measured 6 entries for 4 shapes in 29.3 s (budget 20 s)",
        "[2026-11-22 06:44:30] [fp8rl] fp8_online_blockwise: linear layers block=144, channel=0, bf16=0",
    ])
    info = BS.parse_log(log)
    assert info["gemm_measured_entries"] == 6 and info["gemm_measure_s"] == 29.3
    assert len(info["fp8rl_lines"]) == 2 and not info["deepgemm_precompile"]
    assert BS.parse_log("Entering DeepGEMM JIT Pre-Compile session.")["deepgemm_precompile"]
    assert BS.parse_log("")["gemm_measured_entries"] == 0


def test_bench_startup_parses_the_warmup_and_capture_lines():
    from sglang_fp8rl.kernels import gemm_select, jit_warmup

    summary = jit_warmup.WarmupResult(jobs=412, done=412, workers=12, wall_s=17.25, job_s=130.0).summary()
    variants = jit_warmup.WarmupResult(jobs=20, done=19, failed=1, errors=["x"], workers=12, wall_s=5.0).summary()
    log = "\n".join([
        "[2026-11-22 06:44:00] " + gemm_select.WARMUP_LOG % ("94 CUDA-graph token counts", summary),
        "[2026-11-22 06:44:10] " + gemm_select.WARMUP_LOG % ("the num_sms variants to measure", variants),
        "[2026-11-22 06:48:24] Capture target prefill CUDA graph end. elapsed=13.71 s, mem usage=1.50 GB.",
        "[2026-11-22 06:48:32] Capture target decode CUDA graph end. elapsed=7.14 s, mem usage=0.22 GB.",
    ])
    info = BS.parse_log(log)
    assert info["jit_warmup_s"] in (22.2, 22.3)  # both rounds; summary() rounds to 0.1 s
    assert info["jit_warmup_launches"] == "412/412 x12 + 19/20 x12"
    assert (info["capture_prefill_s"], info["capture_decode_s"]) == (13.71, 7.14)
    assert BS.parse_log("")["capture_prefill_s"] is None and BS.parse_log("")["jit_warmup_s"] == 0.0


def test_bench_startup_parses_the_worker_count_decision():
    from sglang_fp8rl.kernels import gemm_select, jit_warmup

    decision = jit_warmup.decide_workers(-1, 1, 30 << 30, 80 << 30, 0.5, 40 << 30, cpus=16)
    log = "[2026-11-22 06:43:58] " + gemm_select.WORKERS_LOG % (decision.describe(), "")
    assert (BS.parse_log(log)["jit_workers"], BS.parse_log(log)["jit_workers_requested"]) == (4, 12)
    assert BS.parse_log("")["jit_workers"] is None


def test_bench_startup_cold_caches_cover_every_jit_cache(tmp_path):
    env = BS.cache_env(str(tmp_path))
    assert set(env) == {"TRITON_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "FP8RL_GEMM_SELECT_CACHE", "TORCHINDUCTOR_CACHE_DIR",
                        "TVM_FFI_CACHE_DIR"}
    assert all(v.startswith(str(tmp_path)) for v in env.values())
    from sglang_fp8rl.kernels import gemm_select

    assert gemm_select.ENV_CACHE == "FP8RL_GEMM_SELECT_CACHE"
