"""The CPU side of scripts/gpu/check_server.py: its payloads (pre-quantized FP8, SGLang flattened buckets good and
damaged, HTTP bodies, checkpoint folders, the small Qwen3-MoE), its verdicts and report, its HTTP helpers against a
local stand-in server, its command line; and every bad update and pre-quantized transport it sends on the GPU, pushed
through SGLang's real WeightUpdater on CPU, so that the GPU run expects what the engine answers."""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import check_server
import pytest
import server_checks
import server_io
import server_payloads as sp
import server_report as sr
import torch
from sgl_model import TINY, TINY_MOE, run_update_requests, write_checkpoint, write_moe_checkpoint

from sglang_fp8rl.weight_sync.protocol import VALIDATE_ONLY
from sglang_fp8rl.weight_sync.validate import UpdateRejected

QUANT = ("--quantization", "fp8_online_blockwise")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny dense Qwen3 folder and the run's payloads built from it on CPU."""
    root = tmp_path_factory.mktemp("dense")
    write_checkpoint(str(root / "model"), TINY, seed=0)
    return str(root / "model"), sp.prepare(str(root / "model"), str(root / "tmp"), device="cpu")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE folder and its payloads."""
    root = tmp_path_factory.mktemp("moe")
    write_moe_checkpoint(str(root / "model"), TINY_MOE, seed=0)
    return str(root / "model"), sp.prepare(str(root / "model"), str(root / "tmp"), device="cpu")


def outputs(shift: float = 0.0) -> list[dict]:
    return [{"ids": [1, 2, 3], "logprobs": [-0.5 + shift, -0.25, -1.0]}, {"ids": [4], "logprobs": [-2.0]}]


# ---------------------------------------------------------------------------------------------------------------------
# shapes, weights, pre-quantized payloads


def test_shapes_match_the_checkpoints_sglang_loads(dense, moe):
    """hf_shapes names exactly the tensors of a real checkpoint, dense and MoE, with their shapes."""
    from safetensors.torch import load_file

    for model, p in (dense, moe):
        on_disk = load_file(os.path.join(model, "model.safetensors"))
        assert p.shapes == {n: tuple(t.shape) for n, t in on_disk.items()}
    linears = sp.fp8_linear_names(moe[1].shapes)
    assert not any(n.endswith(sp.ROUTER_SUFFIX) or n in (sp.EMBED, "lm_head.weight") for n in linears)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in linears
    assert dense[1].victim == "model.layers.0.mlp.down_proj.weight"
    assert moe[1].victim == "model.layers.0.mlp.experts.0.down_proj.weight"


def test_weights_are_deterministic_and_w1_differs_from_w2(dense):
    _, p = dense
    again = sp.make_weights(p.shapes, "cpu", sp.W1_SEED, sp.CHECK_EMBED_STD)
    assert all(torch.equal(again[n], p.w1[n]) for n in p.shapes)
    assert float(p.w1[sp.EMBED].float().std()) < 0.03  # small embeddings: outputs depend on every weight
    assert all(t.dtype == torch.bfloat16 for t in p.w1.values())
    assert all(not torch.equal(p.w1[n], p.w2[n]) for n in p.shapes)
    assert sp.make_w1(json.load(open(os.path.join(dense[0], "config.json"))), "cpu").keys() == p.w1.keys()


def test_prequantized_payload_is_checkpoint_format(dense):
    """Every FP8 linear as e4m3fn codes followed by its float32 power-of-two scale [ceil(N/128), ceil(K/128)] that
    dequantizes to the BF16 weight within FP8's rounding; the other tensors are the W1 tensors themselves."""
    from sglang_fp8rl.quant import dequantize_blockwise
    from sglang_fp8rl.weight_sync.fp8_payload import attach_scales

    _, p = dense
    names = list(p.prequant)
    for name in sp.fp8_linear_names(p.shapes):
        codes, scale = p.prequant[name], p.prequant[name + sp.SCALE_SUFFIX]
        assert names[names.index(name) + 1] == name + sp.SCALE_SUFFIX
        n, k = p.shapes[name]
        assert codes.dtype == torch.float8_e4m3fn and codes.shape == (n, k)
        assert scale.dtype == torch.float32 and scale.shape == (-(-n // 128), -(-k // 128))
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        w = p.w1[name].float()
        err = (dequantize_blockwise(codes, scale).float() - w).abs().max()
        assert err <= w.abs().max() * 2 ** -3
    assert all(p.prequant[n] is p.w1[n] for n in p.shapes if n not in sp.fp8_linear_names(p.shapes))
    paired = attach_scales(list(p.prequant.items()))  # the engine's own pairing accepts the payload
    assert [n for n, _ in paired] == list(p.shapes)


# ---------------------------------------------------------------------------------------------------------------------
# flattened buckets and HTTP bodies


def test_misaligned_bucket_is_a_real_defect(dense):
    """SGLang's own reconstruction fails on it (what took the scheduler down); the plugin refuses it by name."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from sglang_fp8rl.hooks.transport import check_bucket_metadata

    _, p = dense
    bucket = sp.misaligned_bucket(p.w2, p.victim)
    meta = bucket["metadata"]
    assert [m.name for m in meta] == [sp.PAD_NAME, p.victim] and meta[0].shape == torch.Size([])
    assert meta[1].dtype == torch.float32 and meta[1].start_idx == 2
    with pytest.raises(RuntimeError):
        FlattenedTensorBucket(flattened_tensor=bucket["flattened_tensor"], metadata=meta).reconstruct_tensors()
    with pytest.raises(UpdateRejected, match="not aligned"):
        check_bucket_metadata(bucket["flattened_tensor"], meta)


def test_unknown_dtype_bucket(dense):
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from sglang_fp8rl.hooks.transport import check_bucket_metadata

    _, p = dense
    names = [n for n in p.shapes if n.startswith("model.layers.0.")][:4]
    bucket = sp.unknown_dtype_bucket(p.w2, names)
    assert bucket["metadata"][-1].dtype == "bfloat16" and bucket["metadata"][0].dtype == torch.bfloat16
    with pytest.raises(TypeError):
        FlattenedTensorBucket(flattened_tensor=bucket["flattened_tensor"],
                              metadata=bucket["metadata"]).reconstruct_tensors()
    with pytest.raises(UpdateRejected, match=f"{names[-1]}: bucket dtype 'bfloat16'"):
        check_bucket_metadata(bucket["flattened_tensor"], bucket["metadata"])


def test_prequantized_buckets_are_aligned_and_complete(dense):
    """Split like the client (pairs together), each entry aligned; the plugin accepts every bucket, and SGLang's
    reconstruction gives back exactly the payload."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from sglang_fp8rl.hooks.transport import check_bucket_metadata

    _, p = dense
    bodies = sp.buckets_of(p.prequant, 1 << 17)
    assert len(bodies) > 2
    seen = {}
    for b in bodies:
        names = [m.name for m in b["metadata"]]
        for m in b["metadata"]:
            assert m.start_idx % torch.empty((), dtype=m.dtype).element_size() == 0
            if m.name.endswith(sp.SCALE_SUFFIX):
                assert m.name[: -len(sp.SCALE_SUFFIX)] in names
        check_bucket_metadata(b["flattened_tensor"], b["metadata"])
        seen.update(FlattenedTensorBucket(flattened_tensor=b["flattened_tensor"], metadata=b["metadata"])
                    .reconstruct_tensors())
    assert seen.keys() == p.prequant.keys()
    assert all(torch.equal(seen[n].view(torch.uint8), p.prequant[n].reshape(seen[n].shape).view(torch.uint8))
               for n in seen if seen[n].dtype == torch.float8_e4m3fn)
    assert all(torch.equal(seen[n], p.prequant[n]) for n in seen if seen[n].dtype != torch.float8_e4m3fn)


def test_http_bodies_are_what_sglangs_server_decodes(dense):
    """JSON bodies with one payload per TP rank, decoded by SGLang's own (safe) deserializer into the bucket dict or
    the (name, tensor) list that its TP worker hands to the WeightUpdater."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    _, p = dense
    bucket = sp.buckets_of(p.prequant, 1 << 17)[0]
    body = json.loads(json.dumps(sp.bucket_body(bucket, tp_size=2, flush_cache=False)))
    assert body["load_format"] == "flattened_bucket" and body["flush_cache"] is False
    raw = normalize_serialized_named_tensor_payloads(body["serialized_named_tensors"])
    assert len(raw) == 2
    back = MultiprocessingSerializer.deserialize(raw[1])
    assert all(isinstance(m, FlattenedTensorMetadata) for m in back["metadata"])
    assert torch.equal(back["flattened_tensor"], bucket["flattened_tensor"])
    named = [(p.victim, p.w2[p.victim])]
    body = json.loads(json.dumps(sp.tensor_body(named, tp_size=1, load_format="direct")))
    assert body["load_format"] == "direct" and body["flush_cache"] is True
    (name, tensor), = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
    assert name == p.victim and torch.equal(tensor, p.w2[p.victim])
    assert sp.disk_body("/x") == {"model_path": "/x", "load_format": "auto"}


# ---------------------------------------------------------------------------------------------------------------------
# checkpoint folders and the small MoE


def test_checkpoint_folders(dense, tmp_path):
    """Good folders load back exactly (one file, two shards with an index, FP8 codes); the damaged ones are refused
    by the plugin's file check naming the file."""
    from safetensors.torch import load_file

    from sglang_fp8rl.hooks.transport import check_checkpoint_files

    model, p = dense
    paths = sp.write_checkpoint(str(tmp_path / "two"), p.w1, model, shards=2)
    index = json.load(open(tmp_path / "two" / "model.safetensors.index.json"))
    assert sorted(index["weight_map"]) == sorted(p.w1) and set(index["weight_map"].values()) == set(sp.SHARD_FILES)
    loaded = {**load_file(paths[0]), **load_file(paths[1])}
    assert all(torch.equal(loaded[n], p.w1[n]) for n in p.w1)
    check_checkpoint_files(str(tmp_path / "two"))
    pre = load_file(os.path.join(p.folders["prequant"], sp.SINGLE_FILE))
    assert all(torch.equal(pre[n].view(torch.uint8), t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn
               else torch.equal(pre[n], t) for n, t in p.prequant.items())
    assert os.path.exists(os.path.join(p.folders["w1"], "config.json"))
    with pytest.raises(UpdateRejected, match=f"truncated/{sp.SINGLE_FILE}: not a complete safetensors file"):
        check_checkpoint_files(p.folders["truncated"])
    with pytest.raises(UpdateRejected, match=sp.SHARD_FILES[1]):
        check_checkpoint_files(p.folders["corrupt_shard"])


def test_small_moe_folder(tmp_path):
    """qwen3-moe-small: the config SGLang reads, the make_models tokenizer, and per-rank shapes that fit 128-blocks
    at TP 2 (so the TP-2 run serves every layer blockwise)."""
    from transformers import AutoConfig

    path = sp.write_small_moe(str(tmp_path))
    assert path == sp.write_small_moe(str(tmp_path))  # written once
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    for key, value in sp.SMALL_MOE.items():
        assert config[key] == value, key
    assert config["head_dim"] == 128 and os.path.exists(os.path.join(path, "tokenizer_config.json"))
    assert AutoConfig.from_pretrained(path).num_experts == 4
    shapes = sp.hf_shapes(config)
    assert len(shapes) == 3 + 2 * (8 + 1 + 3 * 4)
    for name in sp.fp8_linear_names(shapes):
        n, k = shapes[name]
        per_rank = k // 2 if name.endswith(("o_proj.weight", "down_proj.weight")) else n // 2
        assert per_rank % 128 == 0, name


# ---------------------------------------------------------------------------------------------------------------------
# verdicts and report


def test_check_verdicts():
    c = sr.check("x", [(True, "a"), (False, "b"), (False, "c")], "msg", k=1)
    assert c.verdict == sr.FAIL and c.why == "not b" and c.as_dict()["k"] == 1
    c = sr.check("x", [(True, "a"), (True, "b")])
    assert c.ok and c.why == "a; b"
    assert sr.not_run("y", "server died").why == "not run: server died"


def test_refusal_verdict_names_the_first_broken_condition():
    good = dict(answer={"success": False, "message": "model.x: contains NaN/Inf"}, error=None, says=("model.x", "nan"),
                alive=True, outputs_same=True, digest_same=True, consistent=True)
    assert sr.refusal("r", **good).ok
    broken = {"error": ("transport", "answered"), "answer": ({"success": True, "message": "ok"}, "refused"),
              "says": (("model.y",), "message names"), "alive": (False, "alive"), "consistent": (None, "consistent"),
              "outputs_same": (False, "outputs unchanged"), "digest_same": (False, "pointers unchanged")}
    for key, (value, words) in broken.items():
        c = sr.refusal("r", **dict(good, **{key: value}))
        assert not c.ok and words in c.why, (key, c.why)
    assert sr.refusal("r", **dict(good, error="ConnectionError: refused")).message == "ConnectionError: refused"


def test_outputs_comparison():
    assert sr.same_outputs(outputs(), outputs())
    assert not sr.same_outputs(outputs(), outputs(1e-9)) and not sr.same_outputs(outputs(), None)
    assert sr.max_logprob_diff(outputs(), outputs(0.25)) == 0.25
    other = outputs()
    other[1]["ids"] = [5]
    assert sr.max_logprob_diff(outputs(), other) is None


def test_scheme_lines_per_rank():
    line = "[fp8rl] fp8_online_blockwise: linear layers block=112, channel=0, bf16=0"
    tp1 = f"[2026-11-24 10:00:01] {line}\n[2026-11-24 10:00:02] other\n"
    assert sr.scheme_lines(tp1) == {"TP0": line}
    tp2 = f"[2026-11-24 10:00:01 TP1] {line}\n[2026-11-24 10:00:01 TP0] {line}; x\n"
    assert sr.scheme_lines(tp2) == {"TP0": line + "; x", "TP1": line}
    assert sr.scheme_lines("nothing") == {}


def test_table_and_report_files(tmp_path):
    checks = [sr.check("a", [(True, "fine")]), sr.check("b|c", [(False, "x")])]
    text = sr.table(checks)
    assert "| a | PASS | fine |" in text and "| b|c | FAIL | not x |" in text
    assert text.rstrip().endswith("1/2 checks passed; FAILED: b|c")
    full = sr.write_report(str(tmp_path), {"model_name": "m", "tp_size": 2}, checks)
    on_disk = json.load(open(tmp_path / "check_server.json"))
    assert on_disk == json.loads(json.dumps(full)) and on_disk["passed"] == 1 and on_disk["total"] == 2
    assert "## server check: m at TP 2" in (tmp_path / "summary.md").read_text()


def test_log_checks_and_kernel_calls(tmp_path):
    line = "[fp8rl] fp8_online_blockwise: linear layers block=112, channel=0, bf16=0"
    log = tmp_path / "server_a.log"
    warning = "fp8_online_blockwise quantization is not fully optimized yet."
    log.write_text(f"[t TP0] {line}\n[t TP1] {line}\n[t] {warning}\n")
    (tmp_path / "server_a.log.kapi_0.log").write_text("deep_gemm_fp8_fp8_bf16_nt\nper_token_group_quant_fp8\nx\n")
    run = server_checks.Run(argparse.Namespace(port=1, tp_size=2), {}, lambda rep, checks: None)
    check_server.log_checks(run, [str(log)], tp_size=2)
    assert [c.verdict for c in run.checks] == ["PASS", "FAIL"]
    assert check_server.kernel_api_calls(str(tmp_path)) == {"deep_gemm": 1, "per_token_group_quant": 1}


# ---------------------------------------------------------------------------------------------------------------------
# HTTP helpers against a local stand-in (SGLang's server needs CUDA)


class Fake(BaseHTTPRequestHandler):
    """Answers like SGLang's routes: generate (single, batch), health, server info, update from tensor (payload
    decoded with SGLang's deserializer; a name containing "nope" is refused, anything else applied)."""

    state: dict = {}

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health_generate":
            self.reply(200, {})
        else:
            self.reply(200, {"tp_size": 1, "internal_states": [
                {"fp8rl": {"fp8_param_ptr_digest": 7, "consistent": True}}]})

    def do_POST(self) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        if self.path.startswith("/flush_cache"):
            self.state["flushes"] = self.state.get("flushes", 0) + 1
            self.reply(200, {})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/generate" and isinstance(body["input_ids"][0], list):
            n = body["sampling_params"]["max_new_tokens"]
            kind = "abort" if self.state.get("abort") else "length"
            self.reply(200, [{"output_ids": [0] * n, "meta_info": {"finish_reason": {"type": kind}}}
                             for _ in body["input_ids"]])
        elif self.path == "/generate":
            shift = self.state.get("version", 0)
            self.reply(200, {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-0.5 - shift, 1, None]]}})
        else:
            named = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
            bad = [n for n, _ in named if "nope" in n]
            if bad:
                self.reply(400, {"success": False, "message": f"{bad[0]}: not a parameter of the model"})
            else:
                self.state["version"] = self.state.get("version", 0) + 1
                self.reply(200, {"success": True, "message": "Success"})


@pytest.fixture()
def fake_server():
    Fake.state = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def test_refuse_through_http(fake_server):
    """Run.refuse over real HTTP: a refusal passes; an accepted bad update and a dead server fail, naming why."""
    port = fake_server
    run = server_checks.Run(argparse.Namespace(port=port, tp_size=1), {}, lambda rep, checks: None)
    run.digest, run.ref = 7, server_io.generate(port)
    assert Fake.state["flushes"] == len(server_io.PROMPTS)  # each reference prompt from an empty radix cache
    bad = [("model.nope.weight", torch.ones(2))]
    c = run.refuse("nope", lambda: server_io.post(port, "/update_weights_from_tensor", sp.tensor_body(bad, 1)),
                   ("model.nope.weight",))
    assert c.ok and c.data["http_status"] == 400 and "not a parameter" in c.message
    good = [("model.x.weight", torch.ones(2))]
    c = run.refuse("applied", lambda: server_io.post(port, "/update_weights_from_tensor", sp.tensor_body(good, 1)),
                   ("x",))
    assert not c.ok and c.why == "not refused (success false)"
    assert not server_io.generate(port) == run.ref  # the stand-in did apply it
    dead = server_checks.Run(argparse.Namespace(port=1, tp_size=1), {}, lambda rep, checks: None)
    c = dead.refuse("dead", lambda: server_io.post(1, "/update_weights_from_tensor", {}), ("x",))
    assert not c.ok and c.why.startswith("not answered") and "ConnectionError" in c.message


def test_post_returns_refusals_and_rejects_other_answers():
    assert server_io.answer_of(400, "", {"success": False, "message": "m"}) == {
        "success": False, "message": "m", "http_status": 400}
    with pytest.raises(ValueError, match="HTTP 500: Internal"):
        server_io.answer_of(500, "Internal Server Error", None)


def test_traffic_counts_requests_and_errors(fake_server):
    import time

    with server_io.Traffic(fake_server) as traffic:
        time.sleep(0.3)
    assert traffic.done and not traffic.errors
    assert traffic.completed_between(traffic.done[0], traffic.done[-1]) == len(traffic.done)
    Fake.state["abort"] = True
    with server_io.Traffic(fake_server) as traffic:
        time.sleep(0.2)
    assert traffic.errors and "finish {'type': 'abort'}" in traffic.errors[0]
    assert server_io.sequence_errors({"error": "x"}, 4) == ["not a batch answer: {'error': 'x'}"]
    assert server_io.sequence_errors([{"output_ids": [1] * 3, "meta_info": {"finish_reason": {"type": "length"}}}],
                                     4) == ["sequence 0: finish {'type': 'length'}, 3 tokens"]


# ---------------------------------------------------------------------------------------------------------------------
# command line


def test_command_line(capsys):
    args = check_server.parse_args(["--model-dir", "m", "--out", "o"])
    assert (args.moe, args.tp_size, args.port, args.keep_tmp) == (False, 1, 30010, False)
    args = check_server.parse_args(["--model-dir", "m", "--out", "o", "--moe", "--tp-size", "2"])
    assert args.moe and args.tp_size == 2
    with pytest.raises(SystemExit):
        check_server.parse_args(["--model-dir", "m", "--out", "o", "--tp-size", "0"])


def test_server_flags_reach_the_launch(monkeypatch, tmp_path):
    """--server-flags (one string) is split and appended to every server's launch flags (here server A's: server B's
    launch passes the same list)."""
    seen: list = []

    def launch_server(launch, model, port, log, args, rendezvous, *extra, **kw):
        seen.append(extra)
        raise RuntimeError("stop after the first launch")

    monkeypatch.setattr(check_server.scale_out, "launch_server", launch_server)
    monkeypatch.setattr(check_server, "model_folder", lambda model_dir, moe: str(tmp_path))
    monkeypatch.setattr(check_server, "new_report", lambda args, model, argv: {})
    argv = ["--model-dir", "m", "--out", str(tmp_path / "o"), "--server-flags",
            "--enforce-disable-flashinfer-allreduce-fusion --foo 1"]
    with pytest.raises(RuntimeError, match="stop after"):
        check_server.run_checks(check_server.parse_args(argv), argv)
    assert seen == [("--load-format", "dummy", "--enforce-disable-flashinfer-allreduce-fusion", "--foo", "1")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_needs_cuda(tmp_path, capsys):
    assert check_server.main(["--model-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "needs 1 CUDA GPU(s)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# the GPU run's bad updates and transports through SGLang's real WeightUpdater


def engine_requests(p: sp.Payloads, bucket_bytes: int) -> tuple[list[dict], dict]:
    """The check's sequence as WeightUpdater requests; the index of each named step."""
    reqs, at = [{"tensors": list(p.w1.items())}], {}
    for bad in sp.bad_updates(p, step_bucket_bytes=bucket_bytes):
        if bad.kind == "step":  # the client's atomic step: the validate-only phase refuses the last bucket
            for bucket in sp.client_buckets(bad.content, bucket_bytes):
                reqs.append({"tensors": bucket, "load_format": VALIDATE_ONLY})
        elif bad.kind == "disk":
            reqs.append({"kind": "disk", "path": bad.content})
        elif bad.kind == "bucket":
            reqs.append({"kind": "bucket", "bucket": bad.content})
        else:
            reqs.append({"tensors": bad.content, "load_format": bad.load_format})
        at[bad.name] = len(reqs) - 1
    w2 = {"tensors": list(p.w2.items())}
    by_bucket = [{"kind": "bucket", "bucket": b} for b in sp.buckets_of(p.prequant, bucket_bytes)]
    for name, sends in (("by_tensor", [{"tensors": list(p.prequant.items())}]), ("by_bucket", by_bucket),
                        ("from_disk", [{"kind": "disk", "path": p.folders["prequant"]}])):
        reqs += [w2, *sends]
        at[name] = len(reqs) - 1
    reqs += [w2, {"kind": "disk", "path": p.folders["w1"]}]
    at["disk_w1"] = len(reqs) - 1
    return reqs, at


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_gpu_sequence_through_sglangs_weight_updater(which, request, tmp_path):
    """Every bad update of the GPU check is refused by the real engine with the words the check expects, nothing
    written; the pre-quantized payload gives bit-identical parameters by tensor, by flattened bucket and from disk;
    W1 from disk equals W1 by tensor; no pointer moves."""
    from sgl_model import assert_same_params

    model, p = request.getfixturevalue(which)
    reqs, at = engine_requests(p, bucket_bytes=1 << 17)
    out = run_update_requests(model, tmp_path, which, reqs, *QUANT)
    answers, params = out["answers"], out["params_after"]
    assert answers[0][0], answers[0]
    for bad in sp.bad_updates(p, step_bucket_bytes=1 << 17):
        ok, message = answers[at[bad.name]]
        assert not ok and sr.says_all(message, bad.says), (bad.name, message)
        assert_same_params(params[at[bad.name]], params[0])
    first_step = at["refuse_load_format_direct"] + 1
    assert all(ok for ok, _ in answers[first_step:at["refuse_atomic_step_unknown_last"]])  # earlier buckets pass
    assert_same_params(params[at["by_bucket"]], params[at["by_tensor"]])
    assert_same_params(params[at["from_disk"]], params[at["by_tensor"]])
    w2_state = params[at["by_tensor"] - 1]
    assert any(not torch.equal(w2_state[n], params[at["by_tensor"]][n]) for n in w2_state)
    assert_same_params(params[at["disk_w1"]], params[0])
    assert all(ok for ok, _ in answers[at["refuse_atomic_step_unknown_last"] + 1:]), answers
    assert out["ptrs_before"] == out["ptrs_after"] and out["state"]["consistent"]


# ---------------------------------------------------------------------------------------------------------------------
# the whole GPU sequence against a stand-in engine (SGLang's server needs CUDA): the plugin's own request checks,
# weights as a dict, greedy outputs as a digest of it


class FakeEngine(BaseHTTPRequestHandler):
    """Stand-in for a served model: updates pass the plugin's bucket, file, pairing and tensor checks plus a
    name/shape check, then merge into ``weights``; outputs are a digest of ``weights``. ``skip`` = {"direct"}: an
    engine that writes load_format "direct" requests (like stock SGLang) instead of refusing them."""

    shapes: dict = {}
    weights: dict = {}
    skip: set = set()

    def log_message(self, *args) -> None:
        pass

    def reply(self, code: int, body) -> None:
        Fake.reply(self, code, body)

    def digest(self) -> int:
        import hashlib

        h = hashlib.sha256()
        for name in sorted(self.weights):
            h.update(name.encode() + self.weights[name])
        return int.from_bytes(h.digest()[:4], "big")

    def do_GET(self) -> None:
        Fake.do_GET(self)

    def checked(self, named: list) -> list:
        from sglang_fp8rl.weight_sync.fp8_payload import attach_scales, split_control
        from sglang_fp8rl.weight_sync.validate import check_tensors

        weights, _ = split_control(named)
        weights = attach_scales(weights)
        check_tensors(weights)
        for name, tensor in weights:
            if name not in self.shapes:
                raise UpdateRejected(f"{name}: not a parameter of the model")
            if tuple(tensor.shape) != self.shapes[name]:
                raise UpdateRejected(f"{name}: expected the full shape {self.shapes[name]}, got {tuple(tensor.shape)}")
        return weights

    @staticmethod
    def as_bytes(tensor: torch.Tensor) -> bytes:
        from sglang_fp8rl.layers.fp8_storage import SCALE_ATTR

        scale = getattr(tensor, SCALE_ATTR, None)
        raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        return raw + (b"" if scale is None else scale.numpy().tobytes())

    def update(self, body: dict) -> tuple[bool, str]:
        from safetensors.torch import load_file
        from sglang.srt.utils import MultiprocessingSerializer

        from sglang_fp8rl.hooks.transport import check_checkpoint_files, tensors_of_bucket

        if self.path == "/update_weights_from_disk":
            check_checkpoint_files(body["model_path"])
            named = [item for f in sorted(os.listdir(body["model_path"])) if f.endswith(".safetensors")
                     for item in load_file(os.path.join(body["model_path"], f)).items()]
        else:
            fmt = body["load_format"]
            if fmt not in (None, "flattened_bucket", VALIDATE_ONLY) and "direct" not in self.skip:
                raise UpdateRejected(f"load_format={fmt!r} is not accepted")
            data = MultiprocessingSerializer.deserialize(body["serialized_named_tensors"][0])
            named = tensors_of_bucket(data) if fmt == "flattened_bucket" else data
            if fmt == VALIDATE_ONLY:
                self.checked(named)
                return True, "validated"
        weights = self.checked(named)
        self.weights.update({n: self.as_bytes(t) for n, t in weights})
        return True, "Success"

    def do_POST(self) -> None:
        if self.path.startswith("/flush_cache"):
            self.reply(200, {})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path in ("/begin_weight_update", "/end_weight_update"):  # an SGLang without sessions (0.5.17)
            self.reply(404, {"detail": "Not Found"})
            return
        if self.path == "/generate" and isinstance(body["input_ids"][0], list):
            n = body["sampling_params"]["max_new_tokens"]
            self.reply(200, [{"output_ids": [0] * n, "meta_info": {"finish_reason": {"type": "length"}}}
                             for _ in body["input_ids"]])
        elif self.path == "/generate":
            d = self.digest()
            self.reply(200, {"output_ids": [d % 1000], "meta_info": {"output_token_logprobs": [[-d / 2**32, 0, None]]}})
        else:
            try:
                ok, message = self.update(body)
                self.reply(200, {"success": ok, "message": message})
            except UpdateRejected as e:
                self.reply(400, {"success": False, "message": str(e)})


def serve(handler: type) -> tuple[ThreadingHTTPServer, int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def run_sequence(p: sp.Payloads, tmp_path, skip: set) -> list:
    """server_checks.run_all against two stand-in engines: A starts empty (W0), B holds W1 (the cold start)."""
    import subprocess

    a_engine = type("A", (FakeEngine,), {"shapes": p.shapes, "weights": {}, "skip": skip})
    b_engine = type("B", (FakeEngine,), {"shapes": p.shapes, "weights": {}, "skip": set()})
    b_engine.weights.update({n: FakeEngine.as_bytes(t) for n, t in p.w1.items()})
    servers = []
    for _ in range(20):  # server B must listen on A's port + 1
        a, port = serve(a_engine)
        try:
            b = ThreadingHTTPServer(("127.0.0.1", port + 1), b_engine)
        except OSError:
            a.shutdown()
            continue
        threading.Thread(target=b.serve_forever, daemon=True).start()
        servers = [a, b]
        break
    assert servers, "no two consecutive free ports"
    run = server_checks.Run(argparse.Namespace(port=port, tp_size=1), {},
                            lambda rep, checks: sr.write_report(str(tmp_path), rep, checks))

    def sleeper() -> subprocess.Popen:
        return subprocess.Popen(["sleep", "120"], start_new_session=True)

    a_proc = sleeper()
    try:
        server_checks.run_all(run, a_proc, p, sleeper, timeout=30)
    finally:
        server_io.stop(a_proc)
        for s in servers:
            s.shutdown()
    return run.checks


EXPECTED_CHECKS = ["tensor_push_w1", "refuse_nan_by_tensor", "refuse_disk_truncated",
                   "refuse_disk_corrupt_second_shard", "refuse_embed_v1_by_tensor", "refuse_embed_v1_from_disk",
                   "refuse_e5m2_by_tensor", "refuse_fp8_without_scale", "refuse_fp8_scale_wrong_shape",
                   "refuse_bucket_misaligned", "refuse_bucket_unknown_dtype", "refuse_load_format_direct",
                   "refuse_atomic_step_unknown_last", "tensor_push_equals_cold_start", "disk_update_w1",
                   "prequant_by_tensor", "prequant_by_bucket", "prequant_from_disk",
                   "prequant_transport_equivalence", "updates_during_generation"]


def test_whole_sequence_against_a_stand_in_engine(dense, tmp_path):
    """The GPU sequence end to end over HTTP: every check runs in order and passes against an engine that refuses
    what the plugin refuses; the report on disk has them all."""
    _, p = dense
    checks = run_sequence(p, tmp_path, skip=set())
    assert [c.name for c in checks] == EXPECTED_CHECKS
    assert all(c.ok for c in checks), sr.table(checks)
    live = checks[-1].data
    assert len(live["pushes"]) == 9 and live["requests_during_pushes"] > 0 and live["request_errors"] == 0
    assert json.load(open(tmp_path / "check_server.json"))["passed"] == len(EXPECTED_CHECKS)


def test_sequence_reports_a_lenient_engine(dense, tmp_path):
    """An engine that writes a load_format "direct" request fails that check, and the next refusal check sees the
    changed outputs; the sequence still runs to the end and the later sections pass."""
    _, p = dense
    checks = run_sequence(p, tmp_path, skip={"direct"})
    failed = {c.name: c.why for c in checks if not c.ok}
    assert [c.name for c in checks] == EXPECTED_CHECKS
    assert failed == {"refuse_load_format_direct": "not refused (success false)",
                      "refuse_atomic_step_unknown_last": "not outputs unchanged"}


def test_the_server_checks_step_marker_is_the_packages():
    """The server check's step-complete marker is the name the engine knows."""
    from sglang_fp8rl.weight_sync.protocol import STEP_COMPLETE

    assert sp.STEP_COMPLETE == STEP_COMPLETE
