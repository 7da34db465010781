"""Registration through SGLang's real plugin loader and argument parser (no model is built here)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from sgl_model import SGLANG_BLOCK_FP8, TINY, write_checkpoint, write_fp8_checkpoint

from sglang_fp8rl import plugin
from sglang_fp8rl.compat.versions import SUPPORTED_SGLANG, check_sglang_version
from sglang_fp8rl.server_args import DEEPGEMM_PRECOMPILE_ENV, ENV_VAR, Fp8rlOptions, get_options


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("plug") / "tiny")
    write_checkpoint(d, TINY, seed=3)
    return d


@pytest.fixture(scope="module")
def plugins_loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()


def test_entry_point_is_installed():
    """The installed distribution advertises the plugin in SGLang's group."""
    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("fp8_online_blockwise") == "sglang_fp8rl.plugin:register"


def test_load_plugins_registers_quantization(plugins_loaded):
    """After SGLang's own load_plugins(), the name is a CLI choice and maps to our config class."""
    from sglang.srt import server_args
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from sglang_fp8rl.layers.config import Fp8OnlineBlockwiseConfig

    assert "fp8_online_blockwise" in server_args.QUANTIZATION_CHOICES
    assert QUANTIZATION_METHODS["fp8_online_blockwise"] is Fp8OnlineBlockwiseConfig
    assert get_quantization_config("fp8_online_blockwise") is Fp8OnlineBlockwiseConfig


def test_register_is_idempotent(plugins_loaded):
    """Calling register() again adds nothing twice and re-patches nothing."""
    from sglang.srt import server_args
    from sglang.srt.server_args import ServerArgs

    add_before = ServerArgs.add_cli_args
    plugin.register()
    plugin.register()
    assert server_args.QUANTIZATION_CHOICES.count("fp8_online_blockwise") == 1
    assert ServerArgs.add_cli_args is add_before


def test_prepare_server_args_parses_our_options(plugins_loaded, model_dir, monkeypatch):
    """SGLang's own prepare_server_args accepts the flag and the --fp8rl-* options and publishes them."""
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(DEEPGEMM_PRECOMPILE_ENV, raising=False)
    sa = prepare_server_args([
        "--model-path", model_dir, "--device", "cpu", "--quantization", "fp8_online_blockwise",
        "--fp8rl-bf16-first-layers", "2", "--fp8rl-bf16-last-layers", "1", "--fp8rl-ignore", r"o_proj$",
        "--fp8rl-ignore", "layers\\.5\\.", "--fp8rl-scale-format", "pow2", "--fp8rl-gemm-select", "cache",
        "--fp8rl-gemm-tune-budget-s", "7.5", "--fp8rl-kv-write", "fused",
        "--fp8rl-gemm-exclude", "fp8rl_n64_sk4_pdl",
    ])
    assert sa.quantization == "fp8_online_blockwise"
    assert get_options() == Fp8rlOptions(2, 1, (r"o_proj$", "layers\\.5\\."), "pow2", "cache", 7.5,
                                         gemm_exclude=("fp8rl_n64_sk4_pdl",), kv_write="fused")
    assert os.environ[DEEPGEMM_PRECOMPILE_ENV] == "0"  # lazy DeepGEMM JIT for our quantization


@pytest.mark.parametrize("quantization, preset, expected", [
    ("fp8_online_blockwise", "1", "1"),  # the user's explicit choice wins
    (None, None, None),  # other servers are left alone
])
def test_deepgemm_precompile_default(plugins_loaded, model_dir, monkeypatch, quantization, preset, expected):
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(DEEPGEMM_PRECOMPILE_ENV, raising=False)
    if preset is not None:
        monkeypatch.setenv(DEEPGEMM_PRECOMPILE_ENV, preset)
    argv = ["--model-path", model_dir, "--device", "cpu"]
    prepare_server_args(argv + (["--quantization", quantization] if quantization else []))
    assert os.environ.get(DEEPGEMM_PRECOMPILE_ENV) == expected


def test_bad_option_value_fails_before_sglang_starts(plugins_loaded, model_dir, monkeypatch):
    """A bad value is an error naming the option; nothing is published."""
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="--fp8rl-bf16-last-layers must be a non-negative integer"):
        prepare_server_args(["--model-path", model_dir, "--device", "cpu", "--fp8rl-bf16-last-layers", "-3"])
    assert get_options() == Fp8rlOptions()


def test_options_appear_in_help(plugins_loaded):
    """`python -m sglang.launch_server --help` lists our options with help text (same parser construction)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = parser.format_help()
    for option in ("--fp8rl-bf16-first-layers", "--fp8rl-bf16-last-layers", "--fp8rl-ignore", "--fp8rl-scale-format",
                   "--fp8rl-gemm-select", "--fp8rl-gemm-tune-budget-s", "--fp8rl-kv-scales", "--fp8rl-kv-write"):
        assert option in text
    assert "fp8_online_blockwise" in text


@pytest.mark.parametrize("version,ok", [(SUPPORTED_SGLANG[0], True), (SUPPORTED_SGLANG[-1] + "+cu130", True),
                                        ("0.5.11", False), ("0.6.0", False), ("0.4.9.post1", False)])
def test_version_gate(version, ok):
    """Only the supported releases are accepted, with a message that names the installed and the supported ones."""
    if ok:
        assert check_sglang_version(version) == version
    else:
        with pytest.raises(RuntimeError, match=rf"SGLang {re.escape(version)} is not supported.*supported: "
                                               rf"{re.escape(', '.join(SUPPORTED_SGLANG))}"):
            check_sglang_version(version)


@pytest.fixture
def methods_restored(monkeypatch):
    """A failed registration replaces our method by its refusal: put SGLang's table back afterwards."""
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    monkeypatch.setitem(QUANTIZATION_METHODS, "fp8_online_blockwise", QUANTIZATION_METHODS.get("fp8_online_blockwise"))
    return QUANTIZATION_METHODS


def test_unsupported_version_fails_before_any_hook_import(monkeypatch, methods_restored):
    """The version check runs before the hooks (and SGLang's internals) are imported."""
    import sys

    def unsupported(installed=None):
        raise RuntimeError("SGLang 0.7.0 is not supported")

    monkeypatch.setattr(plugin, "check_sglang_version", unsupported)
    monkeypatch.delitem(sys.modules, "sglang_fp8rl.hooks", raising=False)
    monkeypatch.setitem(sys.modules, "sglang_fp8rl.hooks", None)  # importing it now would raise ImportError
    with pytest.raises(RuntimeError, match="0.7.0 is not supported"):
        plugin.register()


def test_failed_registration_fails_the_flag_at_start_with_the_reason(monkeypatch, caplog, methods_restored):
    """SGLang swallows plugin exceptions: the failure is an ERROR line naming this package and the fix, and the flag
    stays a valid choice whose method stops the server at start with the same reason (never a server that starts
    without the method, never only a log line)."""
    from sglang.srt import server_args
    from sglang.srt.layers.quantization import get_quantization_config

    def unsupported(installed=None):
        raise RuntimeError("SGLang 0.7.0 is not supported")

    monkeypatch.setattr(plugin, "check_sglang_version", unsupported)
    with caplog.at_level(logging.ERROR, logger="sglang_fp8rl.plugin"), pytest.raises(RuntimeError):
        plugin.register()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("sglang-fp8rl" in m and "FAILED" in m and "Fix:" in m for m in messages)
    assert "fp8_online_blockwise" in server_args.QUANTIZATION_CHOICES
    method = get_quantization_config("fp8_online_blockwise")
    for use in (lambda: method.from_config({}), lambda: method(), lambda: method.get_min_capability()):
        with pytest.raises(RuntimeError, match="unavailable: registering it FAILED: SGLang 0.7.0 is not supported"):
            use()


UNSUPPORTED_RELEASE = """
import importlib.metadata, json, sys
installed = importlib.metadata.version
importlib.metadata.version = lambda name: "0.7.0" if name == "sglang" else installed(name)
from sglang_fp8rl.cpu_runner import install_cpu_stubs
install_cpu_stubs()
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.quantization import QUANTIZATION_METHODS
def build(quantization):
    try:
        return ModelConfig(sys.argv[1], quantization=quantization).quantization
    except Exception as e:
        return "ERROR " + type(e).__name__ + ": " + str(e)
print(json.dumps({"method": QUANTIZATION_METHODS["fp8_online_blockwise"].__name__,
                  "plain": build(None), "fp8": build("fp8"), "ours": build("fp8_online_blockwise")}))
"""


def test_failed_registration_leaves_other_quantized_models_alone(tmp_path):
    """importlib.metadata reports an unsupported SGLang, so SGLang's plugin loader fails our registration (a fresh
    process: its method table stays clean here). SGLang asks every registered method whether it claims a checkpoint
    that has a quantization_config: SGLang's own block-FP8 checkpoint still builds its real ModelConfig, with no
    --quantization and with --quantization fp8; only --quantization fp8_online_blockwise fails, naming the reason."""
    write_fp8_checkpoint(str(tmp_path / "fp8"), TINY, seed=3)
    res = subprocess.run([sys.executable, "-c", UNSUPPORTED_RELEASE, str(tmp_path / "fp8")], check=False,
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    runs = json.loads(res.stdout.strip().splitlines()[-1])
    assert "FAILED: SGLang 0.7.0 is not supported" in res.stderr, res.stderr[-3000:]
    assert runs["method"] != "Fp8OnlineBlockwiseConfig", runs
    assert runs["plain"] == runs["fp8"] == SGLANG_BLOCK_FP8["quant_method"], runs
    assert runs["ours"].startswith("ERROR"), runs
    assert ("--quantization fp8_online_blockwise is unavailable: registering it FAILED: SGLang 0.7.0 is not "
            "supported") in runs["ours"], runs


def test_options_env_round_trip_and_validation(monkeypatch):
    """The env-var transport validates what it reads."""
    monkeypatch.setenv(ENV_VAR, '{"bf16_first_layers": 1, "scale_format": "pow2"}')
    assert get_options() == Fp8rlOptions(bf16_first_layers=1, scale_format="pow2")
    monkeypatch.setenv(ENV_VAR, '{"bogus": 1}')
    with pytest.raises(ValueError, match="unknown option"):
        get_options()
    monkeypatch.setenv(ENV_VAR, "not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_options()
    for bad, message in ((dict(gemm_select="fast"), "--fp8rl-gemm-select must be one of"),
                         (dict(gemm_tune_budget_s=-1.0), "--fp8rl-gemm-tune-budget-s must be"),
                         (dict(gemm_tune_budget_s=float("nan")), "--fp8rl-gemm-tune-budget-s must be"),
                         (dict(gemm_tune_budget_s=True), "--fp8rl-gemm-tune-budget-s must be")):
        with pytest.raises(ValueError, match=message):
            Fp8rlOptions(**bad)


@pytest.mark.parametrize("quantization,graphs_off,warned", [
    ("fp8_online_blockwise", True, True), ("fp8_online_blockwise", False, False), (None, True, False)])
def test_eager_decode_is_warned_about_once(plugins_loaded, model_dir, caplog, quantization, graphs_off, warned):
    """With fp8_online_blockwise and decode CUDA graphs turned off (the installed release's flags for that), one
    warning at start; none with graphs on or without our quantization (SGLang's own parser and from_cli_args)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_fp8rl.compat.runtime import no_graph_flags
    from sglang_fp8rl.hooks.server_args import EAGER_DECODE_WARNING

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = [*(no_graph_flags() if graphs_off else ()),
             *(("--quantization", quantization) if quantization else ())]
    with caplog.at_level(logging.WARNING, logger="sglang_fp8rl.hooks.server_args"):
        ServerArgs.from_cli_args(parser.parse_args(["--model-path", model_dir, "--device", "cuda", *flags]))
    said = [r for r in caplog.records if r.getMessage() == EAGER_DECODE_WARNING]
    assert len(said) == (1 if warned else 0)


@pytest.mark.parametrize("user_limit,expected", [(None, 512), (128, 128)])
def test_decode_graphs_fit_fp8_capacity(plugins_loaded, model_dir, user_limit, expected):
    """With fp8_online_blockwise the decode graphs are captured up to 512 unless the command line says otherwise
    (SGLang's own parser and from_cli_args; the flag's name is the installed release's)."""
    from sglang.srt.server_args import ServerArgs

    from sglang_fp8rl.compat.runtime import decode_graph_limit_fields

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    field, _ = decode_graph_limit_fields(parser.parse_args(["--model-path", model_dir]))
    extra = () if user_limit is None else ("--" + field.replace("_", "-"), str(user_limit))
    args = parser.parse_args(["--model-path", model_dir, "--device", "cpu", "--quantization", "fp8_online_blockwise",
                              *extra])
    ServerArgs.from_cli_args(args)
    # what SGLang's resolution starts from (on CPU, 0.5.12 then sizes its CPU graphs by its own rule)
    assert getattr(args, field) == expected
