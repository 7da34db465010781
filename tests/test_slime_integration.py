"""slime (THUDM/slime) and Miles (radixark/miles) against the plugin, driven by their own code (tests/trainers/).

(a) Launch. slime and Miles register SGLang's server flags as ``--sglang-*`` in their own argparse parser, in the
    driver, where no SGLang plugin is loaded: ``--sglang-quantization fp8_online_blockwise`` is an "invalid choice".
    ``python -m sglang_fp8rl.integrations.slime train.py ...`` registers the choice first. Each rollout Ray actor then
    builds ``ServerArgs(**kwargs)`` (slime's ``_compute_server_args``), whose ``__post_init__`` rejects a quantization
    method it does not know, also when it comes from a ``--sglang-config`` YAML override (no argparse involved):
    ``sglang_fp8rl.integrations.ray_worker_setup`` (the job's Ray ``worker_process_setup_hook``) loads SGLang's
    plugins there first. Every step is shown failing without the helper, and passing with it, on a BF16 model path.

(b) Weight updates. slime's and Miles' senders turn a tiny Qwen3's Megatron state dict into what an engine receives:
    their converters (Megatron -> HF names, vocab padding trimmed), their FP8 quantizers (slime's Triton kernel under
    the Triton interpreter: float32 scales; Miles' ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0`` path: SGLang's
    ``per_block_cast_to_fp8``, power-of-two scales), their buckets (one flattened buffer mixing FP8 codes, float32
    scales and BF16), their HTTP bodies (recorded), slime's empty bucket for a rank with nothing to send, and the
    broadcast transport (real gloo broadcast from a trainer process). The payloads are replayed through SGLang's real
    WeightUpdater with the plugin: every answer ok, BF16 payloads bit-identical to a cold load, FP8 payloads stored
    exactly as sent. Gloo cannot broadcast float8 tensors, so the broadcast path carries BF16 here (NCCL carries FP8).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from sgl_model import (
    HERE,
    TINY,
    as_bytes,
    assert_same_params,
    assert_update_matches_cold_load,
    random_state_dict,
    run_worker,
    write_checkpoint,
    write_w0_w1,
)
from update_group import GROUP_TIMEOUT, join_update_group

pytestmark = pytest.mark.slow

REPO = os.path.dirname(HERE)
QUANTIZATION = "fp8_online_blockwise"
QUANT = ("--quantization", QUANTIZATION)
# the quantization_config of a DeepSeek-style FP8 checkpoint: what slime/Miles read from --hf-checkpoint's config.json
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
MODEL_NAME = "qwen3config"  # slime/Miles: type(AutoConfig.from_pretrained(hf_checkpoint)).__name__.lower()
BUCKET_BYTES = 1 << 20  # --update-weight-buffer-size: 4-5 buckets per update of the tiny model
GROUP = "slime-pp_0"  # slime's UpdateWeightFromDistributed group name (PP rank 0)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MEGATRON = "module.module."


# ---------------------------------------------------------------------------------------------------------------------
# helpers run in fresh interpreters (SGLang's and Triton's process-global state)


def run_here(function: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Call ``function(*args)`` of this module in a fresh interpreter, from the repository root."""
    code = f"import sys; sys.path[:0] = [{HERE!r}]; import test_slime_integration as t; t.{function}(*{args!r})"
    proc_env = dict(os.environ, **(env or {}))
    proc_env.pop("FP8RL_OPTIONS", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=proc_env, timeout=timeout,
                         cwd=REPO, check=False)
    if res.returncode != 0:
        raise AssertionError(f"{function} failed (rc={res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}")
    return res


def slime_namespace(sglang_ns: argparse.Namespace, hf_checkpoint: str) -> argparse.Namespace:
    """slime's parsed args: its ``--sglang-*`` namespace plus the slime/Megatron args its engine launch reads."""
    args = argparse.Namespace(**vars(sglang_ns))
    args.__dict__.update(hf_checkpoint=hf_checkpoint, rollout_num_gpus_per_engine=1, seed=1234, num_gpus_per_node=1,
                         colocate=True, debug_rollout_only=False, actor_num_gpus_per_node=1, actor_num_nodes=1,
                         offload_rollout=False, use_rollout_routing_replay=False, fp16=False, rollout_external=False)
    return args


def _parse_or_error(parse) -> tuple[object, str]:
    """(namespace, "") or (None, argparse's error message)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parse(), ""
        except SystemExit:
            return None, err.getvalue()


def launch_checks(model_dir: str, work: str) -> None:
    """The launch path of slime (and Miles' parser), step by step, in a process where no plugin was loaded."""
    import trainers.miles_vendored as miles
    import trainers.slime_vendored as slime
    from sglang.srt import server_args as sgl_server_args
    from sglang.srt.server_args import ServerArgs

    from sglang_fp8rl.integrations import slime as integration

    res: dict = {}
    yaml_path = os.path.join(work, "sglang_config.yaml")
    with open(yaml_path, "w") as f:
        f.write("sglang:\n  - name: actor\n    server_groups:\n      - worker_type: regular\n        num_gpus: 1\n"
                f"        overrides:\n          quantization: {QUANTIZATION}\n")
    base = ["train.py", "--rollout-num-gpus-per-engine", "1", "--sglang-device", "cpu"]
    argv = [*base, "--sglang-quantization", QUANTIZATION]

    def slime_parse(arguments):
        sys.argv = list(arguments)
        return slime.sglang_parse_args()

    def miles_parse(arguments):
        return miles.add_sglang_arguments(argparse.ArgumentParser(add_help=False)).parse_known_args(arguments)[0]

    def server_kwargs(ns, overrides=None):
        args = slime_namespace(ns, model_dir)
        slime.validate_args(args)
        return slime._compute_server_args(args, 0, "127.0.0.1:29500", 29501, "127.0.0.1", 30000,
                                          sglang_overrides=overrides)[0]

    def build(kwargs):
        try:
            server_args = ServerArgs(**kwargs)
        except ValueError as e:
            return {"error": str(e)}
        return {"quantization": server_args.quantization, "model_path": server_args.model_path}

    res["choice_registered_at_start"] = QUANTIZATION in sgl_server_args.QUANTIZATION_CHOICES
    # 1. the driver's parsers, as slime/Miles build them
    res["slime_cli_without"] = _parse_or_error(lambda: slime_parse(argv))[1]
    res["miles_cli_without"] = _parse_or_error(lambda: miles_parse(argv[1:]))[1]
    # 2. --sglang-config overrides skip argparse, but the rollout actor's ServerArgs(**kwargs) rejects the method
    ns, error = _parse_or_error(lambda: slime_parse([*base, "--sglang-config", yaml_path]))
    assert ns is not None, error
    model = slime.SglangConfig.from_yaml(yaml_path).models[0]
    model.resolve(slime_namespace(ns, model_dir))
    yaml_kwargs = server_kwargs(ns, model.server_groups[0].overrides)
    res["yaml_kwargs"] = {k: yaml_kwargs.get(k) for k in ("quantization", "model_path", "config")}
    res["yaml_server_args_without"] = build(yaml_kwargs)
    # 3. the launcher: python -m sglang_fp8rl.integrations.slime train.py ARGS (a train.py that parses as slime's)
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(f"import json, sys\nsys.path.insert(0, {HERE!r})\n"
                "from trainers.slime_vendored import sglang_parse_args\n"
                "args = sglang_parse_args()\njson.dump({'quantization': args.sglang_quantization, 'name': __name__, "
                f"'argv': sys.argv, 'path0': sys.path[1]}}, open({os.path.join(work, 'train_out.json')!r}, 'w'))\n")
    integration.main([script, *argv[1:]])
    with open(os.path.join(work, "train_out.json")) as f:
        res["launcher"] = json.load(f)
    ns, error = _parse_or_error(lambda: slime_parse(argv))
    assert ns is not None, error
    res["slime_cli_with"] = ns.sglang_quantization
    miles_ns, error = _parse_or_error(lambda: miles_parse([*argv[1:], "--eval-sglang-quantization", QUANTIZATION]))
    assert miles_ns is not None, error
    res["miles_cli_with"] = [miles_ns.sglang_quantization, miles_ns.eval_sglang_quantization]
    cli_kwargs = server_kwargs(ns)
    res["cli_kwargs"] = {k: cli_kwargs.get(k) for k in ("quantization", "model_path")}
    # 4. the rollout actor: without the worker hook its ServerArgs still rejects the method; with it, both paths build
    res["cli_server_args_before_hook"] = build(cli_kwargs)
    integration.ray_worker_setup()
    integration.register_quantization_choice()
    res["cli_server_args"] = build(cli_kwargs)
    res["yaml_server_args"] = build(yaml_kwargs)
    res["choice_count"] = sgl_server_args.QUANTIZATION_CHOICES.count(QUANTIZATION)
    res["ray_hook"] = integration.RAY_SETUP_HOOK
    with open(os.path.join(work, "launch.json"), "w") as f:
        json.dump(res, f)


# ---------------------------------------------------------------------------------------------------------------------
# the trainers' side: a Megatron state dict, their converters/quantizers/buckets, and what the engine receives


def to_megatron(sd: dict[str, torch.Tensor], dims: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """An HF Qwen3 state dict as Megatron-Core holds it (what slime's/Miles' converters take): q/k/v interleaved per
    query group in linear_qkv, gate|up in linear_fc1, norms fused into the linears, the vocab padded to 128 rows."""
    h, hd, groups = dims["hidden_size"], dims["head_dim"], dims["num_key_value_heads"]
    q_per_group = dims["num_attention_heads"] // groups
    g = torch.Generator().manual_seed(seed)

    def padded(t):  # Megatron pads the vocab; the converters must drop these rows
        return torch.cat([t, torch.randn(-t.shape[0] % 128, h, generator=g).to(t.dtype)])

    out = {MEGATRON + "embedding.word_embeddings.weight": padded(sd["model.embed_tokens.weight"]),
           MEGATRON + "output_layer.weight": padded(sd["lm_head.weight"]),
           MEGATRON + "decoder.final_layernorm.weight": sd["model.norm.weight"]}
    for i in range(dims["num_hidden_layers"]):
        hf, mg = f"model.layers.{i}.", f"{MEGATRON}decoder.layers.{i}."
        q = sd[hf + "self_attn.q_proj.weight"].view(groups, q_per_group * hd, h)
        k = sd[hf + "self_attn.k_proj.weight"].view(groups, hd, h)
        v = sd[hf + "self_attn.v_proj.weight"].view(groups, hd, h)
        out.update({
            mg + "self_attention.linear_qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, h),
            mg + "self_attention.linear_qkv.layer_norm_weight": sd[hf + "input_layernorm.weight"],
            mg + "self_attention.linear_proj.weight": sd[hf + "self_attn.o_proj.weight"],
            mg + "self_attention.q_layernorm.weight": sd[hf + "self_attn.q_norm.weight"],
            mg + "self_attention.k_layernorm.weight": sd[hf + "self_attn.k_norm.weight"],
            mg + "mlp.linear_fc1.weight": torch.cat([sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]]),
            mg + "mlp.linear_fc1.layer_norm_weight": sd[hf + "post_attention_layernorm.weight"],
            mg + "mlp.linear_fc2.weight": sd[hf + "mlp.down_proj.weight"],
        })
    return out


def trainer_args(dims: dict) -> argparse.Namespace:
    """The args slime's/Miles' converters and bucketing read (a Qwen3 run with one trainer rank)."""
    return argparse.Namespace(vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"],
                              num_attention_heads=dims["num_attention_heads"],
                              num_query_groups=dims["num_key_value_heads"], kv_channels=dims["head_dim"],
                              q_lora_rank=None, update_weight_buffer_size=BUCKET_BYTES, colocate=True)


def _param_infos(vendored, megatron: dict) -> list:
    """slime/Miles ParamInfo of each local param, sorted by name as ``_get_megatron_local_param_infos`` sorts them."""
    return [vendored.ParamInfo(name=n, dtype=t.dtype, shape=t.shape, attrs={}, size=t.numel() * t.element_size(),
                               src_rank=0) for n, t in sorted(megatron.items())]


def slime_chunks(slime, sd: dict, quantization_config: dict | None) -> list[list[tuple[str, torch.Tensor]]]:
    """slime's HF chunks of one update: its buckets of Megatron params, each converted (and quantized)."""
    args, megatron = trainer_args(TINY), to_megatron(sd, TINY)
    return [[hf for info in bucket
             for hf in slime.convert_to_hf(args, MODEL_NAME, info.name, megatron[info.name], quantization_config)]
            for bucket in slime.pack_param_info_buckets(_param_infos(slime, megatron), args.update_weight_buffer_size)]


def miles_chunks(miles, sd: dict, quantization_config: dict | None) -> list[list[tuple[str, torch.Tensor]]]:
    """Miles' HF chunks of one update: its update units packed into buckets, each param converted (and quantized)."""
    args, megatron = trainer_args(TINY), to_megatron(sd, TINY)
    infos = _param_infos(miles, megatron)
    units = miles.get_named_update_units([i.name for i in infos], miles.get_atomic_update_groups(args, MODEL_NAME))
    return [[hf for info in bucket
             for hf in miles.convert_to_hf(args, MODEL_NAME, info.name, megatron[info.name], quantization_config)]
            for bucket in miles._pack_update_units(args, infos, units)]


def engine_buckets(requests: list, rank: int = 0) -> list[dict]:
    """What TP rank ``rank`` of the engine decodes from each recorded update_weights_from_tensor body."""
    from sglang.srt.utils import MultiprocessingSerializer

    return [MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][rank])
            for endpoint, body in requests if endpoint == "update_weights_from_tensor"]


def http_summary(requests: list) -> list:
    """The recorded HTTP bodies without the serialized tensors (their count kept)."""
    return [(endpoint, {k: (len(v) if k == "serialized_named_tensors" else v) for k, v in body.items()})
            for endpoint, body in requests]


def make_payloads(work: str) -> None:
    """Run slime's and Miles' senders (Triton interpreter for slime's FP8 kernel) and save what the engine gets."""
    import trainers.miles_vendored as miles
    import trainers.slime_vendored as slime

    sd = {name: torch.load(os.path.join(work, f"{name}.pt")) for name in ("w0", "w1", "w2")}
    out: dict = {}

    def slime_colocated(chunks, gather_world_size=1, rank=0):
        engine = slime.SGLangEngine()
        slime.dist.gather_world_size = gather_world_size
        for chunk in chunks:
            slime._send_to_colocated_engine(chunk, ipc_engine=slime.RayActor(engine),
                                            ipc_gather_src=0, ipc_gather_group="ipc-gather", weight_version=1)
        return {"buckets": engine_buckets(engine.requests, rank), "http": http_summary(engine.requests),
                "sent": dict(kv for chunk in chunks for kv in chunk)}

    def miles_colocated(chunks):
        engine = slime.RayActor(miles.SGLangEngine())
        selector = miles.weight_update_selector(argparse.Namespace())
        miles.begin_weight_update([engine], selector)
        for chunk in chunks:
            refs, _ = miles._send_to_colocated_engine(chunk, ipc_engine=engine, ipc_gather_src=0,
                                                               ipc_gather_group="ipc-gather", selector=selector,
                                                               weight_version=1)
            miles._check_weight_sync_results(refs, is_lora=False)
        miles.end_weight_update([engine])
        requests = engine.actor.requests
        return {"buckets": engine_buckets(requests), "http": http_summary(requests),
                "sent": dict(kv for chunk in chunks for kv in chunk)}

    out["slime_bf16"] = slime_colocated(slime_chunks(slime, sd["w1"], None))
    # a chunk sent by a 2-rank gather group whose rank 1 had nothing: TP rank 1 of the engine gets slime's empty bucket
    out["slime_empty"] = slime_colocated(slime_chunks(slime, sd["w1"], None)[:1], gather_world_size=2, rank=1)
    out["slime_fp8"] = slime_colocated(slime_chunks(slime, sd["w2"], FP8_CONFIG))
    os.environ["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "0"  # Miles reads it unconditionally; "0": SGLang's pow2 cast
    out["miles_fp8"] = miles_colocated(miles_chunks(miles, sd["w2"], FP8_CONFIG))
    out["miles_bf16"] = miles_colocated(miles_chunks(miles, sd["w1"], None))
    torch.save(out, os.path.join(work, "payloads.pt"))
    # the broadcast path's chunks (BF16: gloo has no float8), sent later by distributed_trainer
    torch.save([("slime", slime_chunks(slime, sd["w0"], None)), ("miles", miles_chunks(miles, sd["w1"], None))],
               os.path.join(work, "dist_plan.pt"))


def distributed_trainer(work: str, port: str) -> None:
    """Trainer rank 0 of the weight-update group: slime's, then Miles', update_weights_from_distributed per chunk; each
    HTTP body is written to dist_body_<i>.json before its broadcast (the engine scenario reads them in order)."""
    import trainers.miles_vendored as miles
    import trainers.slime_vendored as slime
    from sglang.srt.utils import init_custom_process_group  # as slime.utils.distributed_utils.init_process_group

    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                      group_name=GROUP, timeout=GROUP_TIMEOUT)
    count = 0

    class FileEngine(slime.SGLangEngine):
        def _make_request(self, endpoint, payload=None):
            nonlocal count
            super()._make_request(endpoint, payload)
            path = os.path.join(work, f"dist_body_{count}.json")
            with open(path + ".tmp", "w") as f:
                json.dump([endpoint, self.requests[-1][1]], f)
            os.replace(path + ".tmp", path)
            count += 1

    class MilesFileEngine(FileEngine):
        update_weights_from_distributed = miles.SGLangEngine.update_weights_from_distributed

    for sender, chunks in torch.load(os.path.join(work, "dist_plan.pt"), weights_only=False):
        for chunk in chunks:
            if sender == "slime":
                slime.update_weights_from_distributed(GROUP, group, 1, [slime.RayActor(FileEngine())], chunk)
            else:
                miles.update_weights_from_distributed(GROUP, group, 1, [slime.RayActor(MilesFileEngine())], chunk,
                                                      selector="all")


def scenario_slime_miles(runner, extra: dict) -> dict:
    """tests/sgl_worker.py's "updates" scenario on the colocated payloads, then the broadcast path from a trainer
    process: each recorded HTTP body's names/dtypes/shapes/group_name/load_format, as the scheduler passes them."""
    import sgl_worker

    from sglang_fp8rl.compat.updates import update_from_distributed

    model = runner.torch_runner.model
    initial = sgl_worker.snapshot(model)
    out = sgl_worker.scenario_updates(runner, extra)
    out["initial"] = initial
    updater = sgl_worker.updater_of(runner.torch_runner)
    work = extra["work"]

    def start_trainer(port: int) -> subprocess.Popen:
        # os._exit after the last broadcast: gloo's destructors can abort a process at exit (tests/dist_trainer.py)
        code = (f"import os, sys; sys.path[:0] = [{HERE!r}]; import test_slime_integration as t; "
                f"t.distributed_trainer({work!r}, {str(port)!r}); sys.stdout.flush(); os._exit(0)")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, cwd=REPO)

    trainer = join_update_group(updater, start_trainer, GROUP)
    out["dist_bodies"], out["dist_answers"], out["dist_params_after"] = [], [], []
    for i in range(extra["dist_requests"]):
        path, deadline = os.path.join(work, f"dist_body_{i}.json"), time.time() + 300
        while not os.path.exists(path):
            assert trainer.poll() is None and time.time() < deadline, trainer.communicate()[0][-4000:]
            time.sleep(0.05)
        with open(path) as f:
            endpoint, body = json.load(f)
        out["dist_bodies"].append([endpoint, {k: v for k, v in body.items() if k not in ("names", "shapes")}])
        out["dist_answers"].append(update_from_distributed(
            updater, names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
            group_name=body["group_name"], load_format=body.get("load_format")))
        out["dist_params_after"].append(sgl_worker.snapshot(model))
    log, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, log[-4000:]
    out["ptrs_after"] = sgl_worker.pointers(model)
    out["final_params"] = sgl_worker.snapshot(model)
    out["logits"] = sgl_worker.logits_for(runner)
    return out


def run_scenario(model_dir: str, work, extra: dict) -> dict:
    """``scenario_slime_miles`` in a fresh tests/sgl_worker.py process (registered there under that name)."""
    out_path = os.path.join(str(work), "slime_miles.out.pt")
    argv = ["sgl_worker.py", "slime_miles", model_dir, out_path, json.dumps(extra), *QUANT]
    code = (f"import sys; sys.path[:0] = [{HERE!r}]; import sgl_worker, test_slime_integration as t; "
            f"sgl_worker.SCENARIOS['slime_miles'] = t.scenario_slime_miles; sys.argv = {argv!r}; sgl_worker.main()")
    env = dict(os.environ)
    env.pop("FP8RL_OPTIONS", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
                         check=False)
    if res.returncode != 0:
        raise AssertionError(f"slime_miles worker failed (rc={res.returncode}):\n{res.stdout[-4000:]}\n"
                             f"{res.stderr[-8000:]}")
    return torch.load(out_path, weights_only=False)


# ---------------------------------------------------------------------------------------------------------------------
# expectations


def assert_bytes(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.equal(as_bytes(got), as_bytes(want)), what


def assert_fp8_stored_as_sent(params: dict, sent: dict) -> None:
    """Every linear holds the sender's FP8 codes and float32 scales (fused q|k|v and gate|up in the engine's order);
    every other tensor the sender's BF16 bytes."""
    for layer in range(TINY["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                             ("self_attn.o_proj", ("self_attn.o_proj",)), ("mlp.down_proj", ("mlp.down_proj",))):
            for suffix in (".weight", ".weight_scale_inv"):
                want = torch.cat([sent[p + part + suffix] for part in parts])
                assert_bytes(params[p + fused + suffix], want, p + fused + suffix)
    bf16 = [n for n in sent if not n.endswith("_scale_inv") and not any(f".{x}." in n for x in LINEARS)]
    assert len(bf16) == 3 + 4 * TINY["num_hidden_layers"]
    for name in bf16:
        assert_bytes(params[name], sent[name], name)


def assert_quantized_payload(sent: dict, scales: str) -> None:
    """The sender quantized every linear (FP8 codes, float32 block scales) and nothing else."""
    for name, tensor in sent.items():
        if name.endswith("_scale_inv"):
            assert tensor.dtype == torch.float32 and tensor.dim() == 2, name
            if scales == "pow2":
                assert torch.equal(tensor, torch.exp2(torch.log2(tensor).round())), name
        elif any(f".{x}." in name for x in LINEARS):
            assert tensor.dtype == torch.float8_e4m3fn and name + "_scale_inv" in sent, name
        else:
            assert tensor.dtype == torch.bfloat16, name


def assert_mixed_bucket(buckets: list[dict]) -> None:
    """slime/Miles put FP8 codes, float32 scales and BF16 tensors in one flattened buffer (SGLang's multi-dtype
    FlattenedTensorBucket), not one bucket per dtype."""
    assert any({m.dtype for m in b["metadata"]} == {torch.float8_e4m3fn, torch.float32, torch.bfloat16}
               for b in buckets), [sorted({str(m.dtype) for m in b["metadata"]}) for b in buckets]


# ---------------------------------------------------------------------------------------------------------------------
# tests


def test_slime_launch_needs_the_choice_in_the_driver_and_the_plugin_in_the_rollout_actor(tmp_path):
    """slime's parser (and Miles') refuses the flag without the helper and accepts it with it; the rollout actor's
    ServerArgs, from the flag or from --sglang-config, refuses the method until the Ray worker hook has loaded SGLang's
    plugins, then builds a real ServerArgs with quantization fp8_online_blockwise on the BF16 model path."""
    model_dir = str(tmp_path / "bf16")
    write_checkpoint(model_dir, TINY, seed=60)
    run_here("launch_checks", model_dir, str(tmp_path))
    with open(tmp_path / "launch.json") as f:
        res = json.load(f)
    assert not res["choice_registered_at_start"]
    for parser in ("slime_cli_without", "miles_cli_without"):
        assert f"argument --sglang-quantization: invalid choice: '{QUANTIZATION}'" in res[parser], res[parser]
    # --sglang-config passes argparse by, but the actor's ServerArgs knows no such method
    assert res["yaml_kwargs"]["quantization"] == QUANTIZATION and res["yaml_kwargs"]["model_path"] == model_dir
    assert f"Unknown quantization method: {QUANTIZATION}" in res["yaml_server_args_without"]["error"]
    # the launcher runs train.py as `python train.py` would, with the choice registered
    assert res["launcher"] == {"quantization": QUANTIZATION, "name": "__main__", "path0": str(tmp_path), "argv": [
        str(tmp_path / "train.py"), "--rollout-num-gpus-per-engine", "1", "--sglang-device", "cpu",
        "--sglang-quantization", QUANTIZATION]}
    assert res["slime_cli_with"] == QUANTIZATION and res["miles_cli_with"] == [QUANTIZATION, QUANTIZATION]
    assert res["cli_kwargs"] == {"quantization": QUANTIZATION, "model_path": model_dir}
    assert f"Unknown quantization method: {QUANTIZATION}" in res["cli_server_args_before_hook"]["error"]
    assert res["cli_server_args"] == {"quantization": QUANTIZATION, "model_path": model_dir}
    assert res["yaml_server_args"] == {"quantization": QUANTIZATION, "model_path": model_dir}
    assert res["choice_count"] == 1  # the helper and the plugin's own registration do not add it twice
    assert res["ray_hook"] == "sglang_fp8rl.integrations.ray_worker_setup"


def test_launcher_runs_as_a_module():
    """`python -m sglang_fp8rl.integrations.slime` is the launcher; without a script it prints its usage."""
    res = subprocess.run([sys.executable, "-m", "sglang_fp8rl.integrations.slime"], capture_output=True, text=True,
                         timeout=120, cwd=REPO, check=False)
    assert res.returncode == 1
    assert "usage: python -m sglang_fp8rl.integrations.slime TRAIN_SCRIPT.py" in res.stderr


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """Payloads of slime and Miles (made once), replayed on one engine loaded from W0, plus a cold load of W1."""
    d = tmp_path_factory.mktemp("slime")
    w0, w1 = write_w0_w1(d)
    w2 = random_state_dict(TINY, seed=12)
    for name, sd in (("w0", w0), ("w1", w1), ("w2", w2)):
        torch.save(sd, d / f"{name}.pt")
    run_here("make_payloads", str(d), env={"TRITON_INTERPRET": "1"})
    payloads = torch.load(d / "payloads.pt", weights_only=False)
    order = ("slime_bf16", "slime_empty", "slime_fp8", "miles_fp8", "miles_bf16")
    requests, ends = [], {}
    for key in order:
        requests += [{"kind": "bucket", "bucket": b} for b in payloads[key]["buckets"]]
        ends[key] = len(requests) - 1
    path = d / "requests.pt"
    torch.save(requests, path)
    plan = torch.load(d / "dist_plan.pt", weights_only=False)
    dist_ends = [len(plan[0][1]) - 1, len(plan[0][1]) + len(plan[1][1]) - 1]
    out = run_scenario(str(d / "w0"), d, {"requests": str(path), "work": str(d), "dist_requests": dist_ends[-1] + 1})
    cold = run_worker("load", str(d / "w1"), str(d / "cold_w1.pt"), *QUANT)
    return {"payloads": payloads, "out": out, "ends": ends, "dist_ends": dist_ends, "cold": cold, "sd": (w0, w1, w2)}


def test_slime_and_miles_payloads_are_what_their_trainers_send(replay):
    """The payloads come from the trainers' own code: BF16 names/values equal the checkpoint's (vocab padding dropped),
    FP8 payloads quantize exactly the linears (slime: float32 scales; Miles with NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0:
    power-of-two scales) in mixed-dtype flattened buckets, and the HTTP bodies are what the engines receive."""
    payloads, w1 = replay["payloads"], replay["sd"][1]
    for key, sd in (("slime_bf16", w1), ("miles_bf16", w1)):
        sent = payloads[key]["sent"]
        assert sent.keys() == sd.keys(), key
        for name in sd:
            assert_bytes(sent[name], sd[name], (key, name))
    assert_quantized_payload(payloads["slime_fp8"]["sent"], scales="fp32")
    assert_quantized_payload(payloads["miles_fp8"]["sent"], scales="pow2")
    for key in ("slime_fp8", "miles_fp8"):
        assert_mixed_bucket(payloads[key]["buckets"])
        assert len(payloads[key]["buckets"]) > 1
    for endpoint, body in payloads["slime_bf16"]["http"] + payloads["slime_fp8"]["http"]:
        assert endpoint == "update_weights_from_tensor"
        assert body == {"serialized_named_tensors": 1, "load_format": "flattened_bucket", "flush_cache": False,
                        "weight_version": "1"}
    assert payloads["slime_empty"]["http"][0][1]["serialized_named_tensors"] == 2
    (empty,) = payloads["slime_empty"]["buckets"]
    assert empty["flattened_tensor"].numel() == 0 and empty["metadata"] == []
    for key in ("miles_fp8", "miles_bf16"):
        http = payloads[key]["http"]
        assert http[0] == ("begin_weight_update", {"selector": "all"}) and http[-1] == ("end_weight_update", {})
        for endpoint, body in http[1:-1]:
            assert endpoint == "update_weights_from_tensor"
            assert body == {"serialized_named_tensors": 1, "load_format": "flattened_bucket", "flush_cache": False,
                            "selector": "all", "weight_version": "1"}


def test_slime_and_miles_colocated_updates_apply_exactly(replay):
    """Through SGLang's WeightUpdater with the plugin: slime's BF16 buckets give a cold load of W1 bit for bit, its
    empty bucket is a no-op, slime's and Miles' FP8 buckets are stored exactly as sent, Miles' BF16 buckets give W1."""
    out, ends, cold, payloads = replay["out"], replay["ends"], replay["cold"], replay["payloads"]
    assert all(ok for ok, _ in out["answers"]), out["answers"]
    after = out["params_after"]
    assert_same_params(after[ends["slime_bf16"]], cold["params"])
    assert_same_params(after[ends["slime_empty"]], after[ends["slime_bf16"]])
    assert_fp8_stored_as_sent(after[ends["slime_fp8"]], payloads["slime_fp8"]["sent"])
    assert_fp8_stored_as_sent(after[ends["miles_fp8"]], payloads["miles_fp8"]["sent"])
    assert_same_params(after[ends["miles_bf16"]], cold["params"])
    assert out["ptrs_before"] == out["ptrs_after"]


def test_slime_and_miles_broadcast_updates_apply_exactly(replay):
    """The broadcast path: slime's update_weights_from_distributed of W0, then Miles' of W1, received by SGLang over a
    real gloo group: the engine equals its own cold load of W0, then a cold load of W1 (parameters and logits)."""
    out, (slime_end, miles_end) = replay["out"], replay["dist_ends"]
    assert all(ok for ok, _ in out["dist_answers"]), out["dist_answers"]
    for endpoint, body in out["dist_bodies"]:
        assert endpoint == "update_weights_from_distributed" and body["group_name"] == GROUP
        assert set(body["dtypes"]) == {"bfloat16"} and body["weight_version"] == "1" and not body["flush_cache"]
    assert all("selector" not in body for _, body in out["dist_bodies"][:slime_end + 1])
    assert all(body["selector"] == "all" for _, body in out["dist_bodies"][slime_end + 1:])
    assert_same_params(out["dist_params_after"][slime_end], out["initial"])
    assert_same_params(out["dist_params_after"][miles_end], replay["cold"]["params"])
    assert_update_matches_cold_load({"answers": out["answers"] + out["dist_answers"], **{
        k: out[k] for k in ("ptrs_before", "ptrs_after", "final_params", "logits")}}, replay["cold"])
