"""verl's FP8 rollout mode against the plugin, with verl's own code (verl 0.9.1 from its wheel, SGLang's real classes).

verl 0.9.1 (which pins SGLang 0.5.12) runs here on CPU through tests/trainers/verl_capture.py:
* the launch: ``SGLangHttpServer.launch_server`` (verl/workers/rollout/sglang_rollout/async_sglang_server.py) builds
  ``ServerArgs(**args)``. With ``rollout.quantization=fp8`` it sets ``quantization="fp8"`` and
  ``json_model_override_args={"quantization_config": build_sglang_fp8_quant_config(hf_config)}``
  (verl/utils/sglang/sglang_fp8_utils.py: dynamic E4M3, ``weight_block_size`` [128, 128], ``ignored_layers`` from
  the model's quantization_config and ``SGLANG_FP8_IGNORED_LAYERS``), then splats ``engine_kwargs.sglang`` over it.
  The supported setting is ``rollout.quantization=fp8`` plus ``engine_kwargs.sglang.quantization=
  fp8_online_blockwise``: verl's trainer still quantizes and injects its quantization_config, the plugin serves it.
* the weight sync: ``ServerAdapter.update_weights`` (verl/workers/rollout/sglang_rollout/sglang_rollout.py) quantizes
  with ``SGLangFP8QuantizerHelper.quant_weights_by_name`` (verl/utils/fp8_utils.py, verl/utils/kernel/fp8_kernel.py:
  ``<name>`` as FP8 codes followed by ``<name>_scale_inv``, one fp32 scale per 128x128 block), buckets with
  ``get_named_tensor_buckets`` (verl/workers/rollout/sglang_rollout/utils.py; it cuts wherever a bucket is full, so a
  weight and its scale can land in different requests), and posts one ``update_weights_from_tensor`` per bucket.
  The trainer's stream is verl's FSDP engine's (verl/workers/engine/fsdp/transformer_impl.py
  ``get_per_tensor_param``): the HF state_dict in order, at the policy's dtype (FP32 or BF16), Transformers-5 packed
  MoE experts expanded per expert by ``unfuse_moe_params`` (verl/workers/engine/fsdp/utils.py).
The captured launch arguments start SGLang's CPU ModelRunner (tests/sgl_worker.py), and the captured requests are
replayed through SGLang's real WeightUpdater in the order verl sends them.

Half of the syncs start the engine the way verl does (``load_format="dummy"``: verl's first sync fills it), half from
a real checkpoint w0 (a later sync). The module is skipped when verl is not installed; ``FP8RL_REQUIRE_VERL=1`` turns
that into a failure (CI), and an installed verl that does not import fails every test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from sgl_model import (
    TINY,
    TINY_MOE,
    as_bytes,
    assert_same_params,
    assert_update_matches_cold_load,
    random_moe_state_dict,
    random_state_dict,
    run_update_requests,
    run_worker,
    save_checkpoint,
    write_checkpoint,
    write_moe_checkpoint,
)
from trainers import verl_capture as vc

pytestmark = pytest.mark.slow

VERL_INSTALLED = importlib.util.find_spec("verl") is not None
needs_verl = pytest.mark.skipif(
    not VERL_INSTALLED, reason="verl is not installed (pip install --no-deps -r requirements/verl-0.9.1.txt); "
                               "FP8RL_REQUIRE_VERL=1 makes this a failure")

QUANT = ("--quantization", "fp8_online_blockwise")
# the documented setting: verl quantizes and injects its config (rollout.quantization=fp8), the plugin serves it
VERL_FP8 = {"quantization": "fp8", "engine_kwargs": {"sglang": {"quantization": "fp8_online_blockwise"}}}
# FP8 off in verl (BF16 sync), the plugin quantizes online
VERL_BF16 = {"engine_kwargs": {"sglang": {"quantization": "fp8_online_blockwise"}}}
VERL_BLOCK_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                     "weight_block_size": [128, 128]}
MIB = 1 << 20
# 64 KiB: every FP8 weight of 64 KiB or more fills a bucket alone and its _scale_inv opens the next request
SPLIT_BYTES = 64 << 10
IGNORED_ENV = {"SGLANG_FP8_IGNORED_LAYERS": r"model.layers.0.mlp,re:model\.layers\.2\.self_attn\.[qkv]_proj"}


@pytest.fixture(scope="module")
def verl():
    """verl's modules; an installed verl that does not import fails the test (never a skip)."""
    error = vc.verl_import_error()
    if error is not None:
        pytest.fail(error)
    return vc.verl_modules()


def test_verl_is_importable_when_required():
    """CI sets FP8RL_REQUIRE_VERL=1: then a missing or broken verl fails here instead of skipping the module."""
    error = vc.verl_import_error()
    if error is not None and os.environ.get("FP8RL_REQUIRE_VERL") != "1" and not VERL_INSTALLED:
        pytest.skip(error)
    assert error is None, error


# ---------------------------------------------------------------------------------------------------------------------
# checkpoints and helpers


def checkpoints(d, dims: dict, write, random_weights, seed: int) -> dict:
    """Checkpoint folders w0 (seed) and w1 (seed + 1) under ``d``, and what the tests need of them."""
    write(str(d / "w0"), dims, seed=seed)
    w1 = random_weights(dims, seed=seed + 1)
    write(str(d / "w1"), dims, seed=seed + 1, state_dict=w1)
    return {"dir": d, "w0": str(d / "w0"), "w1_dir": str(d / "w1"), "w1": w1, "dims": dims, "_cold": None}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("verl_dense"), TINY, write_checkpoint, random_state_dict, seed=10)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return checkpoints(tmp_path_factory.mktemp("verl_moe"), TINY_MOE, write_moe_checkpoint, random_moe_state_dict,
                       seed=20)


def cold(model: dict) -> dict:
    """A cold load of w1 with the plugin (once per model)."""
    if model["_cold"] is None:
        model["_cold"] = run_worker("load", model["w1_dir"], str(model["dir"] / "cold_w1.pt"), *QUANT)
    return model["_cold"]


def launch_cli(model_path: str, rollout: dict, start: str, env: dict | None = None) -> list[str]:
    """SGLang flags from verl's own launch arguments; ``start="w0"`` loads the checkpoint instead of verl's dummy."""
    args = vc.verl_server_args(model_path, rollout, env=env)
    cli = vc.server_cli(args)
    if start == "w0":
        i = cli.index("--load-format")
        del cli[i:i + 2]
    return cli


def capture(model: dict, dtype: torch.dtype, fp8: bool, bucket_bytes: int, env: dict | None = None,
            sd: dict | None = None, path: str | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    path = path or model["w0"]
    weights = vc.trainer_weights(path, model["w1"] if sd is None else sd, dtype)
    return vc.verl_update_requests(path, weights, fp8, bucket_bytes, env=env)


def as_requests(captured) -> list[dict]:
    return [{"kind": "tensor", "tensors": named} for named in captured]


def split_pairs(captured) -> list[str]:
    """FP8 weights whose _scale_inv verl sent in a later request."""
    where = {name: i for i, named in enumerate(captured) for name, _ in named}
    return [name for name in where if name + "_scale_inv" in where and where[name + "_scale_inv"] != where[name]]


def assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.equal(as_bytes(got), as_bytes(want)), what


def engine_slot(name: str, dims: dict) -> tuple[str, int | None, int]:
    """Where SGLang keeps a sent HF weight: (fused parameter name, expert index or None, first row)."""
    head = name.removesuffix(".weight")
    m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj", head)
    if m:
        base, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down":
            return f"{base}.w2_weight", expert, 0
        return f"{base}.w13_weight", expert, 0 if proj == "gate" else dims["moe_intermediate_size"]
    m = re.fullmatch(r"(.*)\.(q|k|v)_proj", head)
    if m:
        q, kv = dims["num_attention_heads"] * dims["head_dim"], dims["num_key_value_heads"] * dims["head_dim"]
        return f"{m.group(1)}.qkv_proj.weight", None, {"q": 0, "k": q, "v": q + kv}[m.group(2)]
    m = re.fullmatch(r"(.*)\.(gate|up)_proj", head)
    if m:
        return f"{m.group(1)}.gate_up_proj.weight", None, 0 if m.group(2) == "gate" else dims["intermediate_size"]
    return name, None, 0


def assert_serves(params: dict, captured, dims: dict) -> None:
    """Every weight verl sent is what the engine serves: FP8 codes and block scales byte for byte where verl sent
    them, the BF16 value of what it sent elsewhere; and every engine parameter was written by the sync."""
    sent = {name: t for named in captured for name, t in named}
    written = set()
    for name, tensor in sent.items():
        if name.endswith("_scale_inv"):
            continue
        pname, expert, row = engine_slot(name, dims)
        if pname not in params and name == "lm_head.weight":  # tied embeddings: one parameter
            pname = "model.embed_tokens.weight"
        param = params[pname] if expert is None else params[pname][expert]
        written.add(pname)
        got = param[row:row + tensor.shape[0]]
        if tensor.dtype == torch.float8_e4m3fn:
            assert_bytes(got, tensor, name)
            scale = sent[name + "_scale_inv"]
            sparam = params[pname + "_scale_inv"] if expert is None else params[pname + "_scale_inv"][expert]
            assert_bytes(sparam[row // 128:row // 128 + scale.shape[0]], scale, name + "_scale_inv")
            written.add(pname + "_scale_inv")
        else:
            assert_bytes(got, tensor.to(torch.bfloat16), name)
    assert written == set(params), sorted(set(params) ^ written)


def assert_fp8_payload(captured, bf16_names=()) -> None:
    """verl's FP8 mode sent FP8 codes + fp32 block scales for every linear / expert weight outside ``bf16_names``."""
    sent = dict(kv for named in captured for kv in named)
    for name, tensor in sent.items():
        linear = re.search(r"_proj\.weight$", name) is not None
        if linear and name not in bf16_names:
            assert tensor.dtype == torch.float8_e4m3fn and sent[name + "_scale_inv"].dtype == torch.float32, name
        elif not name.endswith("_scale_inv"):
            assert tensor.dtype != torch.float8_e4m3fn, name


# ---------------------------------------------------------------------------------------------------------------------
# 1. launch


@needs_verl
def test_verl_launch_args_pick_the_plugin(verl, dense):
    """verl's own args: engine_kwargs.sglang.quantization overrides verl's "fp8", its block-128 config is injected,
    and every argument is a field of this SGLang's ServerArgs (verl calls ServerArgs(**args))."""
    args = vc.verl_server_args(dense["w0"], VERL_FP8)
    assert args["quantization"] == "fp8_online_blockwise"
    assert json.loads(args["json_model_override_args"]) == {"quantization_config": VERL_BLOCK_CONFIG}
    assert VERL_BLOCK_CONFIG == vc.verl_quant_config(dense["w0"])
    assert args["load_format"] == "dummy"  # verl's default: its first sync fills the engine
    assert set(args) <= vc.server_args_fields(), set(args) - vc.server_args_fields()
    # without engine_kwargs verl asks SGLang's own fp8 method; with FP8 off it injects nothing
    assert vc.verl_server_args(dense["w0"], {"quantization": "fp8"})["quantization"] == "fp8"
    off = vc.verl_server_args(dense["w0"], VERL_BF16)
    assert off["quantization"] == "fp8_online_blockwise" and json.loads(off["json_model_override_args"]) == {}
    with_env = vc.verl_server_args(dense["w0"], VERL_FP8, env=IGNORED_ENV)
    assert json.loads(with_env["json_model_override_args"])["quantization_config"]["ignored_layers"] == [
        "model.layers.0.mlp", r"re:model\.layers\.2\.self_attn\.[qkv]_proj"]


ACTOR_SERVER_ARGS = """
import json, sys
from sglang_fp8rl.cpu_runner import install_cpu_stubs
install_cpu_stubs()
from sglang.srt.server_args import ServerArgs
args = json.loads(sys.argv[1])
def build():
    try:
        return ServerArgs(**args).quantization
    except Exception as e:
        return "ERROR " + type(e).__name__ + ": " + str(e)
before = build()
if sys.argv[2] == "hook":
    import importlib
    module, _, name = sys.argv[3].rpartition(".")
    getattr(importlib.import_module(module), name)()
print(json.dumps({"before": before, "after": build()}))
"""


@needs_verl
def test_verl_actor_builds_server_args_once_the_ray_hook_loaded_the_plugin(verl, dense):
    """verl's rollout actor calls ServerArgs(**args) itself, in a Ray worker where SGLang's plugin loader has not run:
    a fresh process refuses the method; with the documented worker_process_setup_hook it builds the args."""
    from sglang_fp8rl.integrations import RAY_SETUP_HOOK

    args = dict(vc.verl_server_args(dense["w0"], VERL_FP8), device="cpu")
    args = {k: v for k, v in args.items() if isinstance(v, (str, int, float, bool, type(None), list, dict))}
    runs = {}
    for mode in ("plain", "hook"):
        res = subprocess.run([sys.executable, "-c", ACTOR_SERVER_ARGS, json.dumps(args), mode, RAY_SETUP_HOOK],
                             capture_output=True, text=True, timeout=300, cwd=str(dense["dir"]))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[mode] = json.loads(res.stdout.strip().splitlines()[-1])
    assert runs["plain"]["before"].startswith("ERROR") and "fp8_online_blockwise" in runs["plain"]["before"], runs
    assert runs["hook"]["after"] == "fp8_online_blockwise", runs


@needs_verl
def test_verl_launch_serves_blockwise_fp8(verl, dense):
    """The engine verl's arguments start serves blockwise FP8, byte-identical to a plain --quantization
    fp8_online_blockwise load of the same checkpoint (the injected config changes nothing else)."""
    out = run_worker("load", dense["w1_dir"], str(dense["dir"] / "launch.pt"),
                     *launch_cli(dense["w0"], VERL_FP8, start="w0"))
    decisions = out["report"]["decisions"]
    assert decisions and all(scheme == "block" for scheme, _ in decisions.values()), decisions
    assert_same_params(out["params"], cold(dense)["params"])
    for got, want in zip(out["logits"], cold(dense)["logits"]):
        assert torch.equal(got, want)


def hf_names(module: str) -> list[str]:
    """The HF weights an SGLang (dense) module is loaded from."""
    head, _, last = module.rpartition(".")
    shards = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(last)
    return [f"{head}.{s}.weight" for s in shards] if shards else [f"{module}.weight"]


@needs_verl
def test_verl_ignored_layers_stay_bf16(verl, dense):
    """SGLANG_FP8_IGNORED_LAYERS (a module prefix and a ``re:`` pattern), set where verl runs: verl injects them as
    ignored_layers and its trainer sends those weights in BF16; the engine keeps exactly the SGLang modules whose
    weights verl's ``_matches_ignored_layer`` matches in BF16, and the FP8 sync lands as sent."""
    ignored = IGNORED_ENV["SGLANG_FP8_IGNORED_LAYERS"].split(",")
    cli = launch_cli(dense["w0"], VERL_FP8, start="w0", env=IGNORED_ENV)
    loaded = run_worker("load", dense["w1_dir"], str(dense["dir"] / "ignored.pt"), *cli)
    decisions = loaded["report"]["decisions"]
    expected = {m for m in decisions if all(vc.verl_ignores(n, ignored) for n in hf_names(m))}
    assert expected == {"model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                        "model.layers.2.self_attn.qkv_proj"}
    assert {m for m, (scheme, _) in decisions.items() if scheme == "bf16"} == expected, decisions
    assert all(scheme == "block" for m, (scheme, _) in decisions.items() if m not in expected), decisions
    for module in expected:
        assert "ignored" in decisions[module][1], decisions[module]
    # verl's sync with the same variable: BF16 for exactly those weights, FP8 for the rest
    captured = capture(dense, torch.bfloat16, fp8=True, bucket_bytes=MIB, env=IGNORED_ENV)
    bf16_names = {n for m in expected for n in hf_names(m)}
    assert_fp8_payload(captured, bf16_names)
    sent = dict(kv for named in captured for kv in named)
    assert all(sent[n].dtype == torch.bfloat16 and n + "_scale_inv" not in sent for n in bf16_names)
    out = run_update_requests(dense["w0"], dense["dir"], "ignored_sync", as_requests(captured), *cli,
                              params_each=False)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    assert out["ptrs_before"] == out["ptrs_after"]
    assert_serves(out["final_params"], captured, TINY)
    for module in expected:  # the BF16 modules equal the cold load's
        assert_bytes(out["final_params"][module + ".weight"], loaded["params"][module + ".weight"], module)


# ---------------------------------------------------------------------------------------------------------------------
# 2. payloads


@needs_verl
@pytest.mark.parametrize("kind,dtype,start", [
    ("dense", torch.float32, "dummy"),
    ("dense", torch.bfloat16, "w0"),
    ("moe", torch.bfloat16, "dummy"),
    ("moe", torch.float32, "w0"),
], ids=["dense-fp32-dummy", "dense-bf16-w0", "moe-bf16-dummy", "moe-fp32-w0"])
def test_verl_bf16_sync_matches_cold_load(verl, request, kind, dtype, start):
    """FP8 off in verl (BF16/FP32 payload, 1 MiB buckets): the plugin engine equals a cold load of w1, bit for bit,
    logits included."""
    model = request.getfixturevalue(kind)
    captured = capture(model, dtype, fp8=False, bucket_bytes=MIB)
    assert len(captured) > 1 and all(t.dtype == dtype for named in captured for _, t in named)
    cli = launch_cli(model["w0"], VERL_BF16, start=start)
    out = run_update_requests(model["w0"], model["dir"], f"bf16_{kind}_{start}", as_requests(captured), *cli,
                              params_each=False)
    assert_update_matches_cold_load(out, cold(model))


@needs_verl
@pytest.mark.parametrize("kind,dtype,bucket,start", [
    ("dense", torch.float32, MIB, "dummy"),
    ("dense", torch.bfloat16, SPLIT_BYTES, "w0"),
    ("moe", torch.bfloat16, MIB, "w0"),
    ("moe", torch.float32, SPLIT_BYTES, "dummy"),
], ids=["dense-fp32-1MiB-dummy", "dense-bf16-split-w0", "moe-bf16-1MiB-w0", "moe-fp32-split-dummy"])
def test_verl_fp8_sync_serves_verls_codes(verl, request, kind, dtype, bucket, start):
    """verl's FP8 mode (its trainer quantizes): every request accepted, no parameter moved, and the engine serves
    exactly verl's FP8 codes and block scales (BF16 values elsewhere). With 64 KiB buckets verl sends many weights
    and their _scale_inv in different requests."""
    model = request.getfixturevalue(kind)
    captured = capture(model, dtype, fp8=True, bucket_bytes=bucket)
    assert_fp8_payload(captured)
    split = split_pairs(captured)
    if bucket == SPLIT_BYTES:
        assert len(split) >= 15 and (kind == "dense" or any(".experts." in n for n in split)), split
    else:
        assert not split, split
    cli = launch_cli(model["w0"], VERL_FP8, start=start)
    out = run_update_requests(model["w0"], model["dir"], f"fp8_{kind}_{bucket}_{start}", as_requests(captured),
                              *cli, params_each=False)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    assert out["ptrs_before"] == out["ptrs_after"]
    assert_serves(out["final_params"], captured, model["dims"])


@needs_verl
def test_verl_fp8_sync_tied_embeddings(verl, tmp_path):
    """Tied embeddings: verl's state_dict carries lm_head.weight too (the same tensor as embed_tokens); the engine
    accepts the sync and serves verl's codes."""
    from transformers import Qwen3Config

    config = Qwen3Config(max_position_embeddings=512, tie_word_embeddings=True, torch_dtype="bfloat16", **TINY)
    config.architectures = ["Qwen3ForCausalLM"]
    save_checkpoint(str(tmp_path / "w0"), config, {k: v for k, v in random_state_dict(TINY, seed=30).items()
                                                   if k != "lm_head.weight"})
    w1 = {k: v for k, v in random_state_dict(TINY, seed=31).items() if k != "lm_head.weight"}
    model = {"w0": str(tmp_path / "w0"), "w1": w1}
    captured = capture(model, torch.bfloat16, fp8=True, bucket_bytes=MIB)
    assert "lm_head.weight" in dict(kv for named in captured for kv in named)
    cli = launch_cli(model["w0"], VERL_FP8, start="dummy")
    out = run_update_requests(model["w0"], tmp_path, "tied", as_requests(captured), *cli, params_each=False)
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    assert_serves(out["final_params"], captured, TINY)
