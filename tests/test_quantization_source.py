"""Where a quantization_config under ``--quantization fp8_online_blockwise`` comes from, judged at start through
SGLang's real ServerArgs and ModelConfig (the launcher, and every scheduler, builds one) and its real model loading.

Served: a block-128 dynamic E4M3 config a trainer injects with ``--json-model-override-args`` on a BF16 checkpoint
(verl's FP8 rollout mode, tests/test_verl_integration.py). Refused at start, each with what to send instead: an
injected config of another scheme, and a checkpoint quantized on disk (its own config.json, or FP8 codes with
``weight_scale_inv`` in its safetensors), whatever was injected.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from sgl_model import SGLANG_BLOCK_FP8, TINY, run_worker, write_checkpoint, write_fp8_checkpoint

from sglang_fp8rl.server_args import ENV_VAR

NAME = "fp8_online_blockwise"
QUANT = ("--quantization", NAME)
PER_TENSOR = {k: v for k, v in SGLANG_BLOCK_FP8.items() if k != "weight_block_size"}
# what the plugin's refusals of an injected config must never say: that config did not come with the checkpoint
CHECKPOINT_BLAME = ("already quantized", "point --model-path")


@pytest.fixture(scope="module")
def plugins_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A BF16 checkpoint, SGLang's own block-FP8 checkpoint of it, and the same FP8 tensors under a BF16 config
    (one file, and sharded with an index)."""
    d = tmp_path_factory.mktemp("quant_source")
    write_checkpoint(str(d / "bf16"), TINY, seed=3)
    write_fp8_checkpoint(str(d / "fp8"), TINY, seed=3)
    sd = write_fp8_checkpoint(str(d / "fp8_tensors_only"), TINY, seed=3, with_config=False)
    # the same, sharded as large checkpoints are: an index names every tensor and its file
    shutil.copytree(d / "fp8_tensors_only", d / "fp8_sharded")
    (d / "fp8_sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in sd}}))
    return {name: str(d / name) for name in ("bf16", "fp8", "fp8_tensors_only", "fp8_sharded")}


def inject(config: dict) -> tuple[str, str]:
    """verl's flag: a quantization_config put over the checkpoint's config.json."""
    return "--json-model-override-args", json.dumps({"quantization_config": config})


def start(model_dir: str, *flags: str):
    """What a server's start builds: SGLang's ServerArgs from the command line (the launcher) and the ModelConfig that
    every process builds from them; returns that ModelConfig."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import prepare_server_args

    return ModelConfig.from_server_args(prepare_server_args(["--model-path", model_dir, "--device", "cpu", *flags]))


@pytest.fixture
def no_options(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_injected_block_128_request_on_bf16_starts(plugins_loaded, ckpts, no_options):
    """The supported setting: verl's injected block-128 config on the BF16 checkpoint is served by our method."""
    assert start(ckpts["bf16"], *QUANT, *inject(SGLANG_BLOCK_FP8)).quantization == NAME


@pytest.mark.parametrize("injected, unsupported", [
    (dict(SGLANG_BLOCK_FP8, weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
    (PER_TENSOR, r"no weight_block_size"),
    (dict(SGLANG_BLOCK_FP8, activation_scheme="static", fmt="e5m2"), r"activation_scheme 'static'.*fmt 'e5m2'"),
], ids=["block-64", "per-tensor", "static-e5m2"])
def test_injected_config_of_another_scheme_says_what_to_send(plugins_loaded, ckpts, no_options, injected,
                                                              unsupported):
    """An injected quantization_config that is not block-128 dynamic E4M3, on a BF16 checkpoint, is refused at start
    by a message about the injected config: what in it is unsupported, the config to send instead, or our flag
    alone; never that the checkpoint is quantized."""
    with pytest.raises(ValueError) as refused:
        start(ckpts["bf16"], *QUANT, *inject(injected))
    message = str(refused.value)
    assert re.search(unsupported, message), message
    assert "--json-model-override-args" in message and "--quantization fp8_online_blockwise alone" in message, message
    assert '"weight_block_size": [128, 128]' in message and '"activation_scheme": "dynamic"' in message, message
    assert not any(blame in message for blame in CHECKPOINT_BLAME), message


@pytest.mark.parametrize("ckpt, injected, evidence", [
    ("fp8", SGLANG_BLOCK_FP8, r"config\.json has a quantization_config \(quant_method 'fp8'\)"),
    ("fp8", None, r"config\.json has a quantization_config \(quant_method 'fp8'\)"),
    ("fp8_tensors_only", SGLANG_BLOCK_FP8,
     (r"FP8 weights \(model\.layers\.\d+\.\S+_proj\.weight: F8_E4M3 in "
      r"model\.safetensors\) though its config\.json has no quantization_config")),
    ("fp8_tensors_only", None, r"F8_E4M3 in model\.safetensors"),
    ("fp8_sharded", SGLANG_BLOCK_FP8, r"_proj\.weight_scale_inv in model\.safetensors\.index\.json"),
], ids=["config-injected", "config", "tensors-injected", "tensors", "sharded-tensors-injected"])
def test_checkpoint_quantized_on_disk_is_refused_at_start(plugins_loaded, ckpts, no_options, ckpt, injected,
                                                          evidence):
    """A checkpoint quantized on disk is refused when the server starts, with verl's matching injected config too
    (that config replaces the checkpoint's in SGLang's model config, so it is the checkpoint's own files that tell),
    saying why and what to run instead."""
    flags = (*QUANT, *(inject(injected) if injected else ()))
    with pytest.raises(ValueError) as refused:
        start(ckpts[ckpt], *flags)
    message = str(refused.value)
    assert "quantized on disk" in message and re.search(evidence, message), message
    assert "--quantization fp8" in message and "point --model-path at its BF16 checkpoint" in message, message


def test_checkpoint_quantized_on_disk_still_starts_with_sglangs_fp8(plugins_loaded, ckpts, no_options):
    """The alternative the refusal names: the same checkpoint starts with SGLang's own fp8 method, and with no
    --quantization (SGLang reads its quantization_config)."""
    assert start(ckpts["fp8"], "--quantization", "fp8").quantization == "fp8"
    assert start(ckpts["fp8"]).quantization == "fp8"


def test_checkpoint_quantized_on_disk_never_reaches_the_loader(ckpts, tmp_path):
    """verl's launch on a block-FP8 checkpoint, through SGLang's real ModelRunner: the worker stops at start with
    the refusal, not in the weight loader on the first FP8 tensor."""
    with pytest.raises(AssertionError) as failed:
        run_worker("load", ckpts["fp8"], str(tmp_path / "x.pt"), *QUANT, *inject(SGLANG_BLOCK_FP8), timeout=300)
    log = str(failed.value)
    assert "quantized on disk" in log, log[-3000:]
    assert "expected a BF16/FP16/FP32 tensor" not in log, log[-3000:]
