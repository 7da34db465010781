"""`--fp8rl-*` options: on SGLang's own argument parser, validated, and carried to the scheduler processes.

SGLang builds `ServerArgs` from its dataclass fields only, so our options cannot ride on it. They travel in one
environment variable instead (`FP8RL_OPTIONS`, JSON): the launcher sets it while parsing the command line, spawned
scheduler processes inherit it, and the quantization config reads it there. `sglang.Engine` users who do not parse a
command line call :func:`set_options` (or export the variable) before creating the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import Any, Sequence

from sglang_fp8rl.kernels.attention_select import AUTO_MAX_BATCH, CAST_QUERY, UNCAST_QUERY, check_max_batch
from sglang_fp8rl.kernels.attention_select import FA3 as DECODE_ATTENTION_FA3
from sglang_fp8rl.kernels.attention_select import MODES as DECODE_ATTENTION_MODES
from sglang_fp8rl.kernels.attention_select import QUERY_MODES as DECODE_QUERY_MODES
from sglang_fp8rl.kernels.deepgemm import PRECOMPILE_ENV as DEEPGEMM_PRECOMPILE_ENV
from sglang_fp8rl.kernels.gemm_select import DEFAULT_BUDGET_S as DEFAULT_GEMM_TUNE_BUDGET_S
from sglang_fp8rl.kernels.gemm_select import GEMM_SELECT_MODES, check_excluded
from sglang_fp8rl.kernels.jit_warmup import AUTO_WORKERS as AUTO_JIT_WORKERS
from sglang_fp8rl.kernels.split_kv_plan import DEFAULT_FORMS as DEFAULT_SPLIT_KV_FORMS
from sglang_fp8rl.kernels.split_kv_plan import FORMS as SPLIT_KV_FORMS
from sglang_fp8rl.quant import SCALE_FORMATS

ENV_VAR = "FP8RL_OPTIONS"
KV_SCALE_OPTIONS = ("auto", "static", "calibrate")  # auto: calibrate with an FP8 E4M3 KV cache (kv_scales/)
KV_WRITE_OPTIONS = ("sglang", "fused")  # how calibrated K/V reach the cache (hooks/kv_cache.py)
PRODUCER_QUANT_MODES = ("off", "on")  # a linear's input quantized by the norm / SiLU that makes it (hooks/producers.py)
QUANTIZATION_NAME = "fp8_online_blockwise"
FP8_DECODE_GRAPH_MAX_BS = 512  # decode CUDA-graph capture with this method (hooks/server_args.py says why)
OPTIONS_MARK = "_fp8rl_options_added"  # set on a parser and on ServerArgs once our options are added


@dataclasses.dataclass(frozen=True)
class Fp8rlOptions:
    """Our serving options (all layers blockwise/per-channel FP8 unless listed here)."""

    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    ignore: tuple[str, ...] = ()
    scale_format: str = "fp32"
    gemm_select: str = "auto"
    gemm_tune_budget_s: float = DEFAULT_GEMM_TUNE_BUDGET_S
    gemm_exclude: tuple[str, ...] = ()
    jit_workers: int = AUTO_JIT_WORKERS
    kv_scales: str = "auto"
    kv_calibration: str = ""
    kv_write: str = "fused"
    decode_attention: str = "auto"
    decode_query: str = CAST_QUERY
    split_kv_forms: tuple[str, ...] = DEFAULT_SPLIT_KV_FORMS
    split_kv_max_batch: int = AUTO_MAX_BATCH
    producer_quant: str = "off"

    def __post_init__(self) -> None:
        for name in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--fp8rl-{name.replace('_', '-')} must be a non-negative integer, got {value!r}")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"--fp8rl-scale-format must be one of {SCALE_FORMATS}, got {self.scale_format!r}")
        if self.gemm_select not in GEMM_SELECT_MODES:
            raise ValueError(f"--fp8rl-gemm-select must be one of {GEMM_SELECT_MODES}, got {self.gemm_select!r}")
        budget = self.gemm_tune_budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget < float("inf"):
            raise ValueError(f"--fp8rl-gemm-tune-budget-s must be a finite number >= 0, got {budget!r}")
        try:
            object.__setattr__(self, "gemm_exclude", check_excluded(self.gemm_exclude))
        except ValueError as e:
            raise ValueError(f"--fp8rl-gemm-exclude: {e}") from e
        workers = self.jit_workers
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < AUTO_JIT_WORKERS:
            raise ValueError(f"--fp8rl-jit-workers must be an integer >= {AUTO_JIT_WORKERS}, got {workers!r}")
        if self.kv_scales not in KV_SCALE_OPTIONS:
            raise ValueError(f"--fp8rl-kv-scales must be one of {KV_SCALE_OPTIONS}, got {self.kv_scales!r}")
        if self.kv_write not in KV_WRITE_OPTIONS:
            raise ValueError(f"--fp8rl-kv-write must be one of {KV_WRITE_OPTIONS}, got {self.kv_write!r}")
        if self.decode_attention not in DECODE_ATTENTION_MODES:
            raise ValueError(f"--fp8rl-decode-attention must be one of {DECODE_ATTENTION_MODES}, "
                             f"got {self.decode_attention!r}")
        if self.decode_query not in DECODE_QUERY_MODES:
            raise ValueError(f"--fp8rl-decode-query must be one of {DECODE_QUERY_MODES}, got {self.decode_query!r}")
        if self.decode_query == UNCAST_QUERY and self.decode_attention == DECODE_ATTENTION_FA3:
            raise ValueError("--fp8rl-decode-query bf16 is for the split-KV kernel, which --fp8rl-decode-attention "
                             "fa3 turns off (use auto or split_kv)")
        forms = self.split_kv_forms
        if isinstance(forms, str) or not all(isinstance(f, str) for f in forms) \
                or set(forms) - set(SPLIT_KV_FORMS):
            raise ValueError(f"--fp8rl-split-kv-forms must name forms of {SPLIT_KV_FORMS}, got {forms!r}")
        object.__setattr__(self, "split_kv_forms", tuple(dict.fromkeys(forms)))
        check_max_batch(self.split_kv_max_batch)
        if self.producer_quant not in PRODUCER_QUANT_MODES:
            raise ValueError(f"--fp8rl-producer-quant must be one of {PRODUCER_QUANT_MODES}, "
                             f"got {self.producer_quant!r}")
        if not isinstance(self.kv_calibration, str):
            raise ValueError(f"--fp8rl-kv-calibration must be a path, got {self.kv_calibration!r}")
        object.__setattr__(self, "ignore", tuple(self.ignore))
        for pattern in self.ignore:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"--fp8rl-ignore {pattern!r} is not a valid regular expression: {e}") from e

    def to_json(self) -> str:
        """Serialized form for the environment variable."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Fp8rlOptions:
        """Parse and validate the environment-variable form."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_VAR} is not valid JSON ({e}): {text!r}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{ENV_VAR} must be a JSON object, got {text!r}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{ENV_VAR} has unknown option(s) {sorted(unknown)}")
        return cls(**data)


def lazy_deepgemm_compile() -> None:
    """Default SGLANG_JIT_DEEPGEMM_PRECOMPILE to 0 for our quantization (a user's explicit value wins).

    SGLang's default compiles DeepGEMM for every M up to 16k per (N, K) at the first call (about a minute per shape
    on a cold cache); lazily, only the kernels a run actually launches (CUDA-graph batch sizes, prefill chunks) are
    compiled. Spawned scheduler processes inherit the variable."""
    os.environ.setdefault(DEEPGEMM_PRECOMPILE_ENV, "0")


def set_options(options: Fp8rlOptions | None = None, **kwargs: Any) -> Fp8rlOptions:
    """Validate options and publish them to this process and the processes it spawns."""
    options = options or Fp8rlOptions(**kwargs)
    os.environ[ENV_VAR] = options.to_json()
    return options


def get_options() -> Fp8rlOptions:
    """The options in force in this process (defaults if none were set)."""
    text = os.environ.get(ENV_VAR)
    return Fp8rlOptions.from_json(text) if text else Fp8rlOptions()


_DEFAULTS = Fp8rlOptions()


def _flag(field: str) -> str:
    return "--fp8rl-" + field.replace("_", "-")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the `--fp8rl-*` group to an SGLang argument parser (idempotent); defaults come from Fp8rlOptions."""
    if getattr(parser, OPTIONS_MARK, False):
        return
    setattr(parser, OPTIONS_MARK, True)
    group = parser.add_argument_group("sglang-fp8rl (with --quantization fp8_online_blockwise)")
    d = _DEFAULTS
    group.add_argument(
        _flag("bf16_first_layers"), type=int, default=d.bf16_first_layers, metavar="N",
        help="Keep the linear layers of the first N decoder layers in BF16.",
    )
    group.add_argument(
        _flag("bf16_last_layers"), type=int, default=d.bf16_last_layers, metavar="N",
        help="Keep the linear layers of the last N decoder layers in BF16.",
    )
    group.add_argument(
        _flag("ignore"), action="append", default=None, metavar="REGEX",
        help="Keep linear layers whose module name matches REGEX (re.search) in BF16. Repeatable.",
    )
    group.add_argument(
        _flag("scale_format"), choices=SCALE_FORMATS, default=d.scale_format,
        help="Weight scales: exact amax/448 in float32, or rounded up to a power of two (pow2).",
    )
    group.add_argument(
        _flag("gemm_select"), choices=GEMM_SELECT_MODES, default=d.gemm_select,
        help="Block-FP8 GEMM per (M bucket, N, K): auto = measure missing shapes at load (cached on disk), "
             "cache = use cached measurements only, off = always SGLang's own dispatch.",
    )
    group.add_argument(
        _flag("gemm_tune_budget_s"), type=float, default=d.gemm_tune_budget_s, metavar="S",
        help="Wall-time budget of the load-time GEMM measurement (auto mode); unmeasured shapes use SGLang's GEMM.",
    )
    group.add_argument(
        _flag("gemm_exclude"), action="append", default=None, metavar="NAME",
        help="Leave the GEMM candidate NAME (e.g. fp8rl_n64_sk4_pdl; the log of a measurement lists them) out of "
             "the selection. Repeatable.",
    )
    group.add_argument(
        _flag("jit_workers"), type=int, default=d.jit_workers, metavar="N",
        help="Processes that compile DeepGEMM's kernels for the CUDA-graph sizes in parallel before capture "
             f"({AUTO_JIT_WORKERS} = by CPU count and free GPU memory, 0 = none: SGLang compiles them one by one "
             "during capture).",
    )
    group.add_argument(
        _flag("kv_scales"), choices=KV_SCALE_OPTIONS, default=d.kv_scales,
        help="FP8 KV-cache scales: calibrate = measured on the engine at load and after every complete weight "
             "update; static = SGLang's (1.0 unless the checkpoint has them); auto = calibrate with "
             "--kv-cache-dtype fp8_e4m3 on the FlashAttention-3, Triton or FlashInfer attention backend, else static.",
    )
    group.add_argument(
        _flag("kv_calibration"), default=d.kv_calibration, metavar="JSON",
        help="Calibration batch for the KV scales: a JSON list of token-id lists (default: 4 x 512 tokens of a "
             "built-in mixed text, through the model's tokenizer).",
    )
    group.add_argument(
        _flag("kv_write"), choices=KV_WRITE_OPTIONS, default=d.kv_write,
        help="How calibrated K/V are written to the FP8 cache: fused (default) = one Triton kernel per layer "
             "divides, saturates at +-448, casts and stores K and V, bit-identical to sglang = SGLang's division, "
             "cast and store plus a clamp (used wherever the kernel cannot run: no CUDA, fp32 KV scales, other "
             "cache layouts).",
    )
    group.add_argument(
        _flag("decode_attention"), choices=DECODE_ATTENTION_MODES, default=d.decode_attention,
        help="Decode attention over an FP8 E4M3 KV cache on the FlashAttention-3 backend: auto / split_kv = this "
             "package's split-KV kernel for plain one-token decode calls (FA3 for every other call), fa3 = "
             "FlashAttention-3 for all. split_kv refuses to start where the decode backend is not FA3.",
    )
    group.add_argument(
        _flag("decode_query"), choices=DECODE_QUERY_MODES, default=d.decode_query,
        help="The query of decode attention over an FP8 E4M3 KV cache on FA3: fp8 (default) = SGLang casts it to E4M3 "
             "before every call; bf16 = the split-KV kernel reads it as the model made it (no cast launch a layer, "
             "no rounding of the query), and the calls that go to FA3 still get the E4M3 query. Needs "
             "--fp8rl-decode-attention auto or split_kv.",
    )
    group.add_argument(
        _flag("split_kv_forms"), type=_forms, default=None, metavar="FORM[,FORM...]",
        help="Forms of the split-KV decode-attention kernel, each the same arithmetic with fewer launches: "
             "single_plan (a batch of one plans inside the kernels), step_plan (one plan a decode step for all "
             "layers), fused_merge (the last split of each sequence merges), or none. Default: "
             f"{','.join(d.split_kv_forms) or 'none'}.",
    )
    group.add_argument(
        _flag("split_kv_max_batch"), type=int, default=d.split_kv_max_batch, metavar="N",
        help="With --fp8rl-decode-attention auto: decode batches of at most N sequences go to the split-KV kernel, "
             f"larger ones to FA3 (default {d.split_kv_max_batch}); split_kv and fa3 ignore it.",
    )
    group.add_argument(
        _flag("producer_quant"), choices=PRODUCER_QUANT_MODES, default=d.producer_quant,
        help="on = the RMSNorm before qkv / gate_up and the SiLU-and-multiply before down also write their output's "
             "1x128 FP8 quantization, so those block-FP8 linears launch no quantizer of their own (not with "
             "deterministic inference); off (default) = SGLang's norm and SiLU kernels, each linear quantizes.",
    )


def _forms(text: str) -> tuple[str, ...]:
    """--fp8rl-split-kv-forms: a comma-separated list, or none."""
    return () if text.strip() == "none" else tuple(f.strip() for f in text.split(",") if f.strip())


def options_from_namespace(args: argparse.Namespace) -> Fp8rlOptions:
    """Build validated options from a parsed namespace (a missing attribute takes the dataclass default)."""
    values = {}
    for field in dataclasses.fields(Fp8rlOptions):
        value = getattr(args, "fp8rl_" + field.name, None)
        if value is not None:
            values[field.name] = tuple(value) if field.name in ("ignore", "gemm_exclude") else value
    return Fp8rlOptions(**values)


def parse_args(argv: Sequence[str]) -> Fp8rlOptions:
    """Parse only our options out of a command line (for scripts and tests)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    known, _ = parser.parse_known_args(list(argv))
    return options_from_namespace(known)
