"""Per-shape block-FP8 GEMM selection: measure at load, cache on disk, look up at apply time.

For a block-FP8 linear (weight [N, K] e4m3fn, ``weight_scale_inv`` [N/128, K/128] float32, 1x128 activation groups
quantized inside the candidate) and an M bucket it picks one named candidate. One job per module:

* :mod:`.buckets`: M buckets and the (N, K, M bucket) keys;
* :mod:`.candidates`: the candidates, what each can run (``Candidate.can_implement``), the chooser;
* :mod:`.measure`: one candidate's measurement (first call, float64 check, CUDA-graph timing);
* :mod:`.tune`: the two-phase measurement loop (``autotune``) and its settings;
* :mod:`.cache`: the on-disk cache (``Entry``), keyed by environment;
* :mod:`.prepare`: load-time preparation (``prepare_model``): JIT warm-up, lookup, measurement, install, log;
* :mod:`.lookup`: apply-time lookup (``apply_selected``).
"""

from sglang_fp8rl.kernels.gemm_select.buckets import (
    DEFAULT_MAX_M,
    bucket_points,
    buckets_upto,
    captured_in,
    m_bucket,
    parse_shape_key,
    shape_key,
    wanted_keys,
)
from sglang_fp8rl.kernels.gemm_select.cache import (
    ENV_CACHE,
    SCHEMA,
    Entry,
    cache_path,
    cached_choice,
    env_entries,
    env_info,
    env_key,
    format_table,
    load_cache,
    load_entries,
    merge_entries,
    save_cache,
)
from sglang_fp8rl.kernels.gemm_select.candidates import (
    ALL_OURS_CONFIGS,
    BLOCK,
    DEFAULT,
    DEFAULT_SMS,
    FUSED_CONFIGS,
    FUSED_FORMS,
    FUSED_PREFIX,
    MIN_GAIN,
    OURS_CONFIGS,
    OURS_MAX_M,
    OURS_PREFIX,
    OWN_QUANT_CONFIGS,
    OWN_QUANT_FORMS,
    PDL_CONFIGS,
    PREFETCH_FORMS,
    SMS_PREFIX,
    TRITON,
    Candidate,
    candidate_names,
    check_excluded,
    choose,
    make_candidates,
    ours_name,
    server_candidates,
)
from sglang_fp8rl.kernels.gemm_select.lookup import apply_selected, install, installed, reset_state, select
from sglang_fp8rl.kernels.gemm_select.measure import (
    REL_TOL,
    Bench,
    block_scaled_reference,
    check_columns,
    linear_bytes,
    measure_copy_gbs,
    random_block_weight,
    rel_error,
    time_graph,
)
from sglang_fp8rl.kernels.gemm_select.prepare import (
    GEMM_SELECT_MODES,
    WARMUP_LOG,
    WORKERS_LOG,
    Agree,
    PrepareRequest,
    Runtime,
    agreed_entries,
    prepare_model,
    prepare_shapes,
    variant_streams,
    warmup_streams,
)
from sglang_fp8rl.kernels.gemm_select.tune import (
    ALT_BELOW,
    DEFAULT_BUDGET_S,
    VARIANT_BELOW,
    TuneSettings,
    autotune,
    measure_alternatives,
    measure_defaults,
)

__all__ = [
    "Agree", "agreed_entries",
    "ALL_OURS_CONFIGS", "ALT_BELOW", "BLOCK", "DEFAULT", "DEFAULT_BUDGET_S", "DEFAULT_MAX_M", "DEFAULT_SMS",
    "ENV_CACHE", "FUSED_CONFIGS", "FUSED_FORMS", "FUSED_PREFIX", "GEMM_SELECT_MODES", "MIN_GAIN", "OURS_CONFIGS",
    "OURS_MAX_M", "OURS_PREFIX", "OWN_QUANT_CONFIGS", "OWN_QUANT_FORMS", "PDL_CONFIGS", "PREFETCH_FORMS", "REL_TOL",
    "SCHEMA", "ours_name",
    "SMS_PREFIX", "TRITON", "VARIANT_BELOW", "WARMUP_LOG", "WORKERS_LOG", "apply_selected", "autotune", "Bench",
    "block_scaled_reference", "bucket_points", "buckets_upto", "cache_path", "cached_choice", "Candidate",
    "candidate_names", "captured_in", "check_columns", "check_excluded", "choose", "Entry", "env_entries", "env_info",
    "env_key",
    "format_table", "install", "installed", "linear_bytes", "load_cache", "load_entries", "m_bucket", "make_candidates",
    "measure_alternatives", "measure_copy_gbs", "measure_defaults", "merge_entries", "parse_shape_key",
    "prepare_model", "prepare_shapes", "PrepareRequest", "random_block_weight", "rel_error", "reset_state", "Runtime",
    "save_cache", "select", "server_candidates", "shape_key", "time_graph", "TuneSettings", "variant_streams",
    "wanted_keys", "warmup_streams",
]
