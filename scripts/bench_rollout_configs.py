"""The configs of scripts/bench_rollout.py and the command lines they make: each config's model folder, flags and
environment (`config_spec`), the run order with BF16 on extra attention backends (`plan_runs`), and bench_one_batch's
flags for a sweep of batch sizes and lengths (`bench_flags`, `sweep_order`, `profile_flags`)."""

from __future__ import annotations

import kv_measure as KV  # scripts/kv_measure.py: attention backends, the KV flags, backend env

CONFIGS = ["bf16", "fp8_online_blockwise", "block_prequant", "fp8_channel"]
# opt-in: FP8 KV cache
KV_CONFIGS = ["fp8_online_blockwise_kv", "fp8_online_blockwise_kv_static", "fp8_online_blockwise_kv_sglang_write",
              "fp8_online_blockwise_kv_fa3", "fp8_online_blockwise_kv_splitkv", "fp8_online_blockwise_kv_bf16q",
              "fp8_online_blockwise_kv_forms", "fp8_online_blockwise_kv_noforms",
              "fp8_online_blockwise_kv_lean", "bf16_kv"]
EXTRA_CONFIGS = ["fp8_online_noselect", *KV_CONFIGS]  # opt-in (--configs)
_FP8_KV = ["--kv-cache-dtype", "fp8_e4m3"]
DECODE_ATTENTION_FLAG = "--fp8rl-decode-attention"
DECODE_QUERY_FLAG = "--fp8rl-decode-query"
FORMS_FLAG = "--fp8rl-split-kv-forms"
MAX_BATCH_FLAG = "--fp8rl-split-kv-max-batch"
# every form of the split-KV kernel (kernels/split_kv_plan.FORMS): the config that measures them in the served step
ALL_FORMS = [FORMS_FLAG, "single_plan,step_plan,fused_merge"]
# none of them: the kernel as it ran before the forms, against which the default forms are measured
NO_FORMS = [FORMS_FLAG, "none"]
# every opt-in that takes launches out of the FP8-KV decode step: the candidate for the next defaults
LEAN = [DECODE_QUERY_FLAG, "bf16", "--fp8rl-producer-quant", "on"]
_ONLINE = ["--quantization", "fp8_online_blockwise"]


def flag_value(flags: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a server's flags (``--flag value`` or ``--flag=value``; the last one, as argparse
    takes it), or None where it is absent."""
    val = None
    for i, f in enumerate(flags):
        if f == flag and i + 1 < len(flags):
            val = flags[i + 1]
        elif f.startswith(flag + "="):
            val = f.split("=", 1)[1]
    return val


def model_names(moe: bool) -> tuple[str, str]:
    return ("qwen3-30b-a3b", "qwen3-30b-a3b-block") if moe else ("qwen3-8b", "qwen3-8b-block")


def _base_spec(cfg: str, moe: bool) -> dict:
    plain, block = model_names(moe)
    specs = {
        "bf16": (plain, [], "0"),
        "fp8_online_blockwise": (plain, _ONLINE, "0"),
        "block_prequant": (block, [], "1"),
        "fp8_channel": (plain, ["--quantization", "fp8"], "1"),
        "fp8_online_noselect": (plain, [*_ONLINE, "--fp8rl-gemm-select", "off"], "0"),
        "fp8_online_blockwise_kv": (plain, [*_ONLINE, *_FP8_KV], "0"),
        "fp8_online_blockwise_kv_static": (plain, [*_ONLINE, *_FP8_KV, KV.KV_SCALES_FLAG, "static"], "0"),
        "fp8_online_blockwise_kv_sglang_write": (plain, [*_ONLINE, *_FP8_KV, KV.KV_WRITE_FLAG, "sglang"], "0"),
        "fp8_online_blockwise_kv_fa3": (plain, [*_ONLINE, *_FP8_KV, DECODE_ATTENTION_FLAG, "fa3"], "0"),
        "fp8_online_blockwise_kv_splitkv": (plain, [*_ONLINE, *_FP8_KV, DECODE_ATTENTION_FLAG, "split_kv"], "0"),
        "fp8_online_blockwise_kv_bf16q": (plain, [*_ONLINE, *_FP8_KV, DECODE_QUERY_FLAG, "bf16"], "0"),
        "fp8_online_blockwise_kv_forms": (plain, [*_ONLINE, *_FP8_KV, *ALL_FORMS], "0"),
        "fp8_online_blockwise_kv_noforms": (plain, [*_ONLINE, *_FP8_KV, *NO_FORMS], "0"),
        "fp8_online_blockwise_kv_lean": (plain, [*_ONLINE, *_FP8_KV, *LEAN], "0"),
        "bf16_kv": (plain, _FP8_KV, "0"),
    }
    if cfg not in specs:
        raise ValueError(f"unknown config {cfg!r}; choose from {CONFIGS + EXTRA_CONFIGS}")
    model, flags, refill = specs[cfg]
    return {"model": model, "flags": list(flags), "env": {"FP8RL_BENCH_REFILL": refill}}


def config_spec(cfg: str, moe: bool = False, backend: str = KV.DEFAULT_ATTENTION_BACKEND) -> dict:
    """model folder name, extra bench flags, extra env for one config on one attention backend."""
    spec = _base_spec(cfg, moe)
    spec["env"].update(KV.backend_env(spec["flags"], backend))
    return spec


def run_label(cfg: str, backend: str, main_backend: str) -> str:
    """Result label: the config's name on the run's backend, `config@backend` on another one."""
    return cfg if backend == main_backend else f"{cfg}@{backend}"


def plan_runs(configs, main_backend: str, bf16_backends=()) -> list[tuple[str, str, str]]:
    """(label, config, backend) in run order; BF16 on each extra backend runs right after BF16 (or first)."""
    extra = [b for b in dict.fromkeys(bf16_backends) if b != main_backend]
    runs = []
    for cfg in dict.fromkeys(configs):
        runs.append((run_label(cfg, main_backend, main_backend), cfg, main_backend))
        if cfg == "bf16":
            runs += [(run_label(cfg, b, main_backend), cfg, b) for b in extra]
    if "bf16" not in configs:
        runs = [(run_label("bf16", b, main_backend), "bf16", b) for b in extra] + runs
    return runs


def _lens(output_len) -> list[int]:
    return [int(output_len)] if isinstance(output_len, int) else [int(x) for x in output_len]


def bench_flags(model_path: str, batch_sizes, input_len, output_len, mem_fraction: float,
                result_file: str, run_name: str, repeat: int = 1, prefill_graph: bool = False,
                attention_backend: str = KV.DEFAULT_ATTENTION_BACKEND) -> list[str]:
    """bench_one_batch flags of one config; input_len and output_len are each one length or a list (one process runs
    every combination)."""
    bs_sweep = [str(b) for b in list(batch_sizes) * max(1, repeat)]
    graph_bs = [str(b) for b in sorted({int(b) for b in batch_sizes})]
    prefill = [] if prefill_graph else ["--disable-prefill-cuda-graph"]
    return ["--model-path", model_path, "--load-format", "dummy", "--attention-backend", attention_backend,
            "--sampling-backend", "pytorch", "--grammar-backend", "none", "--dtype", "bfloat16",
            "--batch-size", *bs_sweep, "--input-len", *[str(x) for x in _lens(input_len)],
            "--output-len", *[str(x) for x in _lens(output_len)],
            *prefill, "--cuda-graph-bs-decode", *graph_bs,
            "--mem-fraction-static", str(mem_fraction), "--result-filename", result_file, "--run-name", run_name]


def sweep_order(batch_sizes, output_len, repeat: int = 1) -> list[tuple[int, int]]:
    """(bs, output_len) in the order bench_one_batch runs them (itertools.product over bs, input, output)."""
    return [(int(b), ol) for b in list(batch_sizes) * max(1, repeat) for ol in _lens(output_len)]


def profile_flags(prefix: str, output_len, steps: int) -> list[str]:
    start = max(1, min(64, min(_lens(output_len)) // 2))
    return ["--profile", "--profile-stage", "decode", "--profile-start-step", str(start), "--profile-steps",
            str(steps), "--profile-activities", "GPU", "--profile-prefix", prefix]
