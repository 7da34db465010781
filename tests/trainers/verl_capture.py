"""Run verl's own rollout code on CPU and capture what it hands to SGLang (verl 0.9.1, imported from its wheel).

Two seams, each the last call before verl's code leaves for an SGLang process:

* :func:`verl_server_args` — ``SGLangHttpServer.launch_server`` (verl/workers/rollout/sglang_rollout/
  async_sglang_server.py) builds the keyword arguments of ``ServerArgs(**args)``; the module's ``ServerArgs`` is
  swapped for a subclass of SGLang's real one (so verl's ``dataclasses.fields(ServerArgs)`` probe still sees the
  real fields) whose construction records the arguments and stops the launch.
* :func:`verl_update_requests` — ``ServerAdapter.update_weights`` (verl/workers/rollout/sglang_rollout/
  sglang_rollout.py) quantizes with ``SGLangFP8QuantizerHelper`` (verl/utils/sglang/sglang_fp8_utils.py over
  verl/utils/fp8_utils.py and verl/utils/kernel/fp8_kernel.py) when ``rollout.quantization=fp8``, buckets with
  ``get_named_tensor_buckets`` (verl/workers/rollout/sglang_rollout/utils.py) and calls SGLang's
  ``sglang.srt.weight_sync.utils.update_weights`` once per bucket; that call (CUDA-IPC serialization, a gather over
  the inference TP group, an HTTP post) is replaced by a recorder, so each recorded list is the ``(name, tensor)``
  list of one ``update_weights_from_tensor`` request as SGLang's WeightUpdater receives it.

The trainer side of a weight sync is :func:`trainer_weights`: the (name, tensor) stream verl's FSDP engine yields
(``FSDPEngine.get_per_tensor_param``): the HF model's ``state_dict()`` in its own order, Transformers-5 packed MoE
experts expanded by verl's ``unfuse_moe_params`` (verl/workers/engine/fsdp/utils.py), at the policy's dtype.

What runs on CPU that would not run as-is:
* verl's quantizer takes its Triton kernel whenever triton imports; there is no GPU here, and verl catches the
  kernel's failure and sends that weight unquantized, so the captures use the PyTorch fallback of the same module
  (``scaled_fp8_blockwise`` with ``_DISABLE_TRITON_FP8``, as ``VERL_DISABLE_TRITON_FP8=1`` selects it). The two
  round differently (Triton: scale = amax / 448, codes = x * (1 / scale); fallback: codes = x * (448 / amax),
  scale = 1 / (448 / amax)), which the engine must not care about: it stores the codes and scales it is sent;
* ``quant_weights_by_name`` asks ``torch.distributed.get_rank()`` before each weight (for a log line); without a
  process group that raises, which verl's ``except`` would also turn into a silent BF16 send — answered with 0;
* ``_to_ipc_device`` moves CPU tensors to ``get_device_id()`` (the current CUDA device) for CUDA IPC: here "cpu".
Any "Failed to quantize" error verl logs makes the capture raise instead of returning a half-quantized sync.

Everything verl changes in this process is put back afterwards: environment variables, SGLang's
``engine._set_envs_and_config`` (verl's sglang_rollout module replaces it when imported), the patched names.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

VERL_VERSION = "0.9.1"
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------------------------
# importing verl without letting it change this process


@contextlib.contextmanager
def _kept_environment():
    """Restore os.environ, the root logger (``import verl`` calls logging.basicConfig) and SGLang's engine-level
    ``_set_envs_and_config`` however the block ends."""
    environ = dict(os.environ)
    root_handlers, root_level = list(logging.root.handlers), logging.root.level
    engine = sys.modules.get("sglang.srt.entrypoints.engine")
    set_envs = getattr(engine, "_set_envs_and_config", None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        logging.root.handlers[:] = root_handlers
        logging.root.setLevel(root_level)
        engine = engine or sys.modules.get("sglang.srt.entrypoints.engine")
        if engine is not None and set_envs is not None:
            engine._set_envs_and_config = set_envs


_MODULES: SimpleNamespace | None = None


def verl_modules() -> SimpleNamespace:
    """verl's modules the captures use (imported once)."""
    global _MODULES
    if _MODULES is not None:
        return _MODULES
    from sglang_fp8rl.cpu_runner import install_cpu_stubs

    install_cpu_stubs()
    import sglang.srt.entrypoints.engine  # noqa: F401  (so that _kept_environment can put its hook back)

    with _kept_environment():
        os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
        verl = importlib.import_module("verl")
        mods = SimpleNamespace(
            verl=verl,
            config=importlib.import_module("verl.workers.config"),
            replica=importlib.import_module("verl.workers.rollout.replica"),
            server=importlib.import_module("verl.workers.rollout.sglang_rollout.async_sglang_server"),
            rollout=importlib.import_module("verl.workers.rollout.sglang_rollout.sglang_rollout"),
            bucket_utils=importlib.import_module("verl.workers.rollout.sglang_rollout.utils"),
            fp8_utils=importlib.import_module("verl.utils.fp8_utils"),
            fp8_kernel=importlib.import_module("verl.utils.kernel.fp8_kernel"),
            sglang_fp8=importlib.import_module("verl.utils.sglang.sglang_fp8_utils"),
            fsdp_utils=_load_fsdp_engine_utils(verl),
        )
    _MODULES = mods
    return mods


def _load_fsdp_engine_utils(verl) -> Any:
    """verl/workers/engine/fsdp/utils.py by itself: its package __init__ imports the whole FSDP engine (peft,
    accelerate, datasets, pandas, ...), while ``unfuse_moe_params`` needs only torch."""
    path = os.path.join(os.path.dirname(verl.__file__), "workers", "engine", "fsdp", "utils.py")
    spec = importlib.util.spec_from_file_location("verl_fsdp_engine_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verl_import_error() -> str | None:
    """Why verl's modules do not import here (None when they do)."""
    try:
        from importlib.metadata import version

        installed = version("verl")
    except Exception as e:  # noqa: BLE001
        return f"verl is not installed ({e!r})"
    if installed != VERL_VERSION:
        return f"verl {installed} is installed; these captures are written against verl {VERL_VERSION}"
    try:
        verl_modules()
    except Exception as e:  # noqa: BLE001
        return f"verl {installed} does not import: {type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# verl's config objects


def model_config(model_path: str) -> Any:
    """verl's HFModelConfig for a local checkpoint folder (tokenizer, generation config, AutoConfig as verl loads)."""
    return verl_modules().config.HFModelConfig(path=model_path)


def rollout_config(**overrides) -> Any:
    """verl's RolloutConfig for a single-GPU SGLang rollout; ``overrides`` are RolloutConfig fields, and
    ``update_weights_bucket_megabytes`` goes to its CheckpointEngineConfig."""
    config = verl_modules().config
    overrides = copy.deepcopy(overrides)  # verl pops keys out of engine_kwargs
    checkpoint = {}
    if "update_weights_bucket_megabytes" in overrides:
        checkpoint["update_weights_bucket_megabytes"] = overrides.pop("update_weights_bucket_megabytes")
    fields = {"name": "sglang", "tensor_model_parallel_size": 1, "data_parallel_size": 1}
    fields.update(overrides)
    return config.RolloutConfig(checkpoint_engine=config.CheckpointEngineConfig(**checkpoint), **fields)


# ---------------------------------------------------------------------------------------------------------------------
# (a) the server arguments


class _Captured(Exception):
    def __init__(self, kwargs: dict):
        super().__init__("ServerArgs captured")
        self.kwargs = kwargs


def verl_server_args(model_path: str, rollout_overrides: dict | None = None, env: dict | None = None,
                     rollout_mode: str = "hybrid") -> dict:
    """The keyword arguments verl's ``SGLangHttpServer.launch_server`` passes to ``ServerArgs(**args)`` for a
    rollout configured with ``rollout_overrides`` (RolloutConfig fields, e.g. ``quantization="fp8"``,
    ``engine_kwargs={"sglang": {...}}``); ``env`` is set while verl runs (e.g. ``SGLANG_FP8_IGNORED_LAYERS``)."""
    mods = verl_modules()
    real = mods.server.ServerArgs

    class CapturingServerArgs(real):  # dataclasses.fields() of it are the real ServerArgs' fields
        def __new__(cls, **kwargs):
            raise _Captured(dict(kwargs))

    with _kept_environment():
        os.environ.update(env or {})
        server = mods.server.SGLangHttpServer(
            config=rollout_config(**(rollout_overrides or {})), model_config=model_config(model_path),
            rollout_mode=mods.replica.RolloutMode(rollout_mode), workers=[], replica_rank=0, node_rank=0, nnodes=1,
            cuda_visible_devices="0", base_gpu_id=0)
        mods.server.ServerArgs = CapturingServerArgs
        try:
            asyncio.run(server.launch_server())
        except _Captured as captured:
            return captured.kwargs
        finally:
            mods.server.ServerArgs = real
    raise AssertionError("verl's launch_server returned without constructing ServerArgs")


# the ServerArgs fields a CPU ModelRunner takes from verl's arguments (the rest place the server on GPUs, size its
# memory, pick CUDA kernels, or start HTTP/metrics; the CPU worker sets its own: sglang_fp8rl.cpu_runner)
CPU_FIELDS = ("quantization", "json_model_override_args", "load_format", "dtype")


def server_cli(args: dict, fields: Iterable[str] = CPU_FIELDS) -> list[str]:
    """SGLang command-line flags for the given fields of verl's ``ServerArgs`` arguments (``None`` left out)."""
    out = []
    for name in fields:
        value = args.get(name)
        if value is None:
            continue
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


# ---------------------------------------------------------------------------------------------------------------------
# (b) the weight-update requests


def _hf_model_on_meta(model_path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def trainer_weights(model_path: str, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) stream verl's FSDP engine yields for a weight sync of a model whose HF-named, per-expert
    weights are ``state_dict``: the Transformers model's ``state_dict()`` names in order (packed
    ``experts.gate_up_proj`` / ``experts.down_proj`` for Qwen3-MoE), at ``dtype`` (the FSDP parameters' dtype: FP32 or
    BF16), through verl's ``unfuse_moe_params``."""
    model = _hf_model_on_meta(model_path)
    tied = getattr(model.config, "tie_word_embeddings", False)

    def packed(name: str) -> torch.Tensor:
        if name in state_dict:
            return state_dict[name]
        if tied and name == "lm_head.weight":
            return state_dict["model.embed_tokens.weight"]
        base, _, kind = name.rpartition(".")
        experts = range(model.config.num_experts)
        if kind == "gate_up_proj":
            return torch.stack([torch.cat([state_dict[f"{base}.{e}.gate_proj.weight"],
                                           state_dict[f"{base}.{e}.up_proj.weight"]]) for e in experts])
        if kind == "down_proj":
            return torch.stack([state_dict[f"{base}.{e}.down_proj.weight"] for e in experts])
        raise KeyError(f"no weight for the trainer's parameter {name}")

    def stream():
        for name, meta in model.state_dict().items():
            tensor = packed(name)
            assert tuple(tensor.shape) == tuple(meta.shape), (name, tensor.shape, meta.shape)
            yield name, tensor.to(dtype)

    return verl_modules().fsdp_utils.unfuse_moe_params(stream(), model.config.model_type)


class _FakeEngine:
    """What ServerAdapter.update_weights calls on its engine besides the update itself."""

    async def flush_cache(self):
        return None


class _FakeMesh:
    """``device_mesh["infer_tp"]`` of a one-rank inference TP group (ServerAdapter._is_server_tp_leader)."""

    def __getitem__(self, key):
        return SimpleNamespace(get_local_rank=lambda: 0, mesh=torch.tensor([0]))


class _QuantizeFailure(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def verl_update_requests(model_path: str, weights: Iterable[tuple[str, torch.Tensor]], fp8: bool,
                         bucket_bytes: int, env: dict | None = None,
                         rollout_overrides: dict | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """The ``update_weights_from_tensor`` requests verl's ``ServerAdapter.update_weights`` sends for one weight sync
    of ``weights`` (see :func:`trainer_weights`), in order, each as its list of (name, tensor).

    ``fp8``: ``rollout.quantization=fp8`` (verl quantizes on the trainer side; ServerAdapter.__init__ puts its
    block-128 quantization_config on the model config first). ``bucket_bytes``: a whole number of MiB goes through
    ``checkpoint_engine.update_weights_bucket_megabytes`` as verl reads it; any other size is handed to verl's own
    ``get_named_tensor_buckets`` in place of the size verl computed (that config field is whole MiB)."""
    mods = verl_modules()
    rollout = mods.rollout
    overrides = dict(rollout_overrides or {})
    overrides["quantization"] = "fp8" if fp8 else None
    overrides["update_weights_bucket_megabytes"] = max(1, bucket_bytes // MIB)
    requests: list[list[tuple[str, torch.Tensor]]] = []

    async def record(engine, params_batch, device_mesh_key, device_mesh, load_format=None):
        assert load_format is None and device_mesh_key == "infer_tp"
        requests.append([(name, tensor.detach()) for name, tensor in params_batch])

    real_buckets = rollout.get_named_tensor_buckets

    def buckets(iterable, _verl_bytes, fusion_groups=()):
        return real_buckets(iterable, bucket_bytes, fusion_groups=fusion_groups)

    failures = _QuantizeFailure()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_kept_environment())
        os.environ.update({"RANK": "0", "RAY_LOCAL_WORLD_SIZE": "1", **(env or {})})
        stack.enter_context(_patched(rollout, "sgl_update_weights", record))
        stack.enter_context(_patched(rollout, "get_device_id", lambda: "cpu"))
        if bucket_bytes % MIB:
            stack.enter_context(_patched(rollout, "get_named_tensor_buckets", buckets))
        if not torch.distributed.is_initialized():
            stack.enter_context(_patched(torch.distributed, "get_rank", lambda group=None: 0))
        # the PyTorch fallback of verl's quantizer (its Triton kernel needs a GPU; see the module docstring)
        stack.enter_context(_patched(mods.fp8_kernel, "_DISABLE_TRITON_FP8", True))
        mods.fp8_utils.logger.addHandler(failures)
        stack.callback(mods.fp8_utils.logger.removeHandler, failures)
        adapter = rollout.ServerAdapter(config=rollout_config(**overrides), model_config=model_config(model_path),
                                        device_mesh=_FakeMesh())
        adapter._engine = _FakeEngine()
        asyncio.run(adapter.update_weights(iter(weights)))
    if failures.messages:
        raise RuntimeError(f"verl's FP8 quantizer failed (it would have sent these weights unquantized): "
                           f"{failures.messages[:3]}")
    return requests


def verl_quant_config(model_path: str, env: dict | None = None) -> dict:
    """The quantization_config verl's FP8 mode builds for this model (``build_sglang_fp8_quant_config``): what it
    injects into SGLang and what its trainer-side quantizer reads."""
    mods = verl_modules()
    with _kept_environment():
        os.environ.update(env or {})
        return mods.sglang_fp8.build_sglang_fp8_quant_config(model_config(model_path).hf_config)


def verl_ignores(param_name: str, ignored_layers: Iterable[str]) -> bool:
    """verl's own ``_matches_ignored_layer`` over a list of ignored layers."""
    match = verl_modules().sglang_fp8._matches_ignored_layer
    return any(match(param_name, layer) for layer in ignored_layers)


def server_args_fields() -> set[str]:
    """The field names of the installed SGLang's ServerArgs (the names verl's arguments must use)."""
    from sglang.srt.server_args import ServerArgs

    return {f.name for f in dataclasses.fields(ServerArgs)}
