"""The CPU side of issue 36's GPU runs: the layouts scripts/gpu/check_server.py launches (expert parallelism, DP
attention, two 'nodes' on one host), each launch command read by SGLang's own ServerArgs parser, the output and
telemetry reads under DP attention against a local stand-in server, a server of two launcher processes stopped as
one; scripts/bench_update.py's plan (GPUs, payload placement, the broadcast path's trainer GPU), its dry run and
issue 36's target lines. No GPU: what the GPU run does with these is in each script's docstring."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import bench_update
import check_server
import pytest
import scale_out
import server_io
import update_scaleout

PORT = 30010


def check_args(*argv: str) -> argparse.Namespace:
    return check_server.parse_args(["--model-dir", "m", "--out", "o", "--moe", *argv])


def sglang_server_args(cmd: list[str]):
    """SGLang's own parser (with the plugin's options) over a launch command's flags, after --model-path."""
    from sglang.srt.server_args import ServerArgs

    from sglang_fp8rl.plugin import register

    register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(cmd[cmd.index("--model-path"):])


def recorded_launches(args: argparse.Namespace, port: int, rendezvous: int) -> list[list[str]]:
    """The command lines scale_out.launch_server starts through server_io.launch (processes replaced by records)."""
    cmds = []

    class Proc:
        pid = 0

        def poll(self):
            return None

    def launch(model, port_, log, *extra, **_):
        cmds.append(["python", "-m", "sglang.launch_server", "--model-path", model, "--port", str(port_),
                     "--quantization", "fp8_online_blockwise", *extra])
        return Proc()

    scale_out.launch_server(launch, "/m", port, f"/out/server_{port}.log", args, rendezvous, "--load-format", "dummy")
    return cmds


@pytest.mark.parametrize("argv,want", [
    (("--tp-size", "2"), [dict(tp_size=2, ep_size=1, enable_dp_attention=False, nnodes=1)]),
    (("--tp-size", "4", "--ep-size", "4"), [dict(tp_size=4, ep_size=4, nnodes=1, dist_init_addr=None)]),
    (("--tp-size", "2", "--enable-dp-attention", "--dp-size", "2"),
     [dict(tp_size=2, dp_size=2, enable_dp_attention=True, dist_init_addr="127.0.0.1:30110")]),
    (("--tp-size", "4", "--nnodes", "2"),
     [dict(tp_size=4, nnodes=2, node_rank=0, base_gpu_id=0, port=PORT, dist_init_addr="127.0.0.1:30110"),
      dict(tp_size=4, nnodes=2, node_rank=1, base_gpu_id=2, port=PORT + 50, dist_init_addr="127.0.0.1:30110")]),
    # the eight-GPU layouts (not run on GPUs: no eight-GPU machine was available)
    (("--tp-size", "8", "--ep-size", "8"), [dict(tp_size=8, ep_size=8, nnodes=1)]),
    (("--tp-size", "8", "--enable-dp-attention", "--dp-size", "8"),
     [dict(tp_size=8, dp_size=8, enable_dp_attention=True, dist_init_addr="127.0.0.1:30110")]),
    (("--tp-size", "8", "--nnodes", "2"),
     [dict(tp_size=8, nnodes=2, node_rank=0, base_gpu_id=0), dict(tp_size=8, nnodes=2, node_rank=1, base_gpu_id=4)]),
])
def test_check_server_layouts_are_launch_flags_sglang_reads(argv, want):
    """Each layout's launcher processes, their flags as SGLang's parser reads them: EP passed through; DP attention
    with a rendezvous port of its own; two nodes on GPUs 0-1 and 2-3, node 1's health stub on its own port."""
    args = check_args(*argv)
    cmds = recorded_launches(args, PORT, scale_out.dist_port(PORT, 0))
    assert len(cmds) == len(want)
    for cmd, fields in zip(cmds, want):
        parsed = sglang_server_args(cmd)
        assert parsed.load_format == "dummy"
        for name, value in fields.items():
            assert getattr(parsed, name) == value, (cmd, name)


@pytest.mark.parametrize("moe,argv,off", [
    (True, ("--tp-size", "2", "--ep-size", "2"), True), (True, ("--tp-size", "4", "--nnodes", "2"), True),
    (True, (), False), (False, ("--tp-size", "2"), False)])
def test_an_moe_server_at_tp_above_1_starts_without_flashinfers_allreduce_fusion(moe, argv, off):
    """SGLang JIT-compiles FlashInfer's all-reduce fusion at the start of an MoE at TP > 1 (over 200 s, then the
    scheduler aborted): every check's MoE server at TP > 1 turns it off, as bench_update's plan does; others keep
    SGLang's default."""
    args = check_server.parse_args(["--model-dir", "m", "--out", "o", *(["--moe"] if moe else []), *argv])
    for cmd in recorded_launches(args, PORT, scale_out.dist_port(PORT, 0)):
        assert sglang_server_args(cmd).enforce_disable_flashinfer_allreduce_fusion is off


def test_server_b_meets_elsewhere_and_node_logs_are_separate():
    """The cold-start server's rendezvous and derived ports (rendezvous + 1..6) stay clear of server A's; node 1
    logs to its own file, which the scheme-line check reads too."""
    a, b = scale_out.dist_port(PORT, 0), scale_out.dist_port(PORT, 1)
    assert b - a > 7 and PORT + 1 < a
    args = check_args("--tp-size", "4", "--nnodes", "2")
    nodes = scale_out.node_launches(args, PORT, "/o/server_a.log", a)
    assert [n.log for n in nodes] == ["/o/server_a.log", "/o/server_a_node1.log"]


@pytest.mark.parametrize("argv,says", [
    (("--tp-size", "2", "--ep-size", "4"), "--ep-size 4 must divide --tp-size 2"),
    (("--tp-size", "2", "--dp-size", "2"), "--enable-dp-attention and --dp-size"),
    (("--tp-size", "2", "--enable-dp-attention"), "--enable-dp-attention and --dp-size"),
    (("--tp-size", "4", "--enable-dp-attention", "--dp-size", "3"), "--dp-size 3 must divide"),
    (("--tp-size", "2", "--nnodes", "4"), "--nnodes 4 must divide"),
    (("--tp-size", "4", "--nnodes", "2", "--enable-dp-attention", "--dp-size", "2"), "run DP attention on one node"),
])
def test_check_server_refuses_layouts_sglang_would_refuse(argv, says, capsys):
    with pytest.raises(SystemExit):
        check_args(*argv)
    assert says in capsys.readouterr().err


def test_a_server_of_two_nodes_runs_and_stops_as_one():
    """poll() reports the first node that exits; server_io.stop ends every node's process group."""
    procs = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    server = scale_out.Server(procs, ["a.log", "a_node1.log"])
    assert server.poll() is None and server.pid == procs[0].pid
    server_io.stop(server)
    assert all(p.poll() is not None for p in procs) and server.poll() is not None


class DPFake(BaseHTTPRequestHandler):
    """Two DP ranks: each answers /generate with its rank in the output; /get_server_info gives both states."""

    seen: list = []
    states: list = []

    def log_message(self, *args) -> None:
        pass

    def reply(self, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.reply({"internal_states": self.states})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        if self.path.startswith("/generate"):
            self.seen.append(body.get("routed_dp_rank"))
            rank = body.get("routed_dp_rank") or 0
            self.reply({"output_ids": [rank], "meta_info": {"output_token_logprobs": [[-1.0 - rank, rank, None]]}})
        else:
            self.reply({})


@pytest.fixture()
def dp_fake():
    DPFake.seen, DPFake.states = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), DPFake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server_io.DP_RANKS.pop(server.server_address[1], None)


def test_dp_attention_outputs_come_from_every_dp_rank(dp_fake):
    """With route_every_dp_rank, each prompt is generated on DP rank 0 and 1 (SGLang's routed_dp_rank) and both
    answers are compared; without it, one request per prompt and no routing."""
    assert len(server_io.generate(dp_fake)) == len(server_io.PROMPTS) and DPFake.seen == [None] * 3
    DPFake.seen.clear()
    server_io.route_every_dp_rank(dp_fake, 2)
    out = server_io.generate(dp_fake)
    assert DPFake.seen == [0, 1] * len(server_io.PROMPTS)
    assert [o["ids"] for o in out] == [[0], [1]] * len(server_io.PROMPTS)


def test_telemetry_of_every_dp_rank(dp_fake):
    """One state per DP rank: consistent only if all are, the pointer digest of every rank; one state unchanged."""
    DPFake.states = [{"fp8rl": {"consistent": True, "fp8_param_ptr_digest": 1, "updates": 3}},
                     {"fp8rl": {"consistent": False, "fp8_param_ptr_digest": 2, "updates": 3}}]
    info = server_io.fp8rl_info(dp_fake)
    assert info["consistent"] is False and info["fp8_param_ptr_digest"] == ("1", "2") and info["dp_ranks"] == 2
    DPFake.states = DPFake.states[:1]
    assert server_io.fp8rl_info(dp_fake) == {"consistent": True, "fp8_param_ptr_digest": 1, "updates": 3}
    assert server_io.merged_dp_states([{}, {}])["consistent"] is None  # a BF16 server has no telemetry


def test_dp_digests_do_not_depend_on_the_order_the_ranks_answer():
    """SGLang gathers the DP ranks' states as they answer: the same pointers in another order are unchanged; one
    rank's moved pointers are not."""
    a, b, moved = ({"fp8rl": {"fp8_param_ptr_digest": d}} for d in ("aa", "bb", "cc"))
    assert server_io.merged_dp_states([a, b])["fp8_param_ptr_digest"] == \
        server_io.merged_dp_states([b, a])["fp8_param_ptr_digest"]
    assert server_io.merged_dp_states([a, moved])["fp8_param_ptr_digest"] != \
        server_io.merged_dp_states([b, a])["fp8_param_ptr_digest"]


def test_a_start_that_never_ends_dumps_the_stacks_of_its_processes(tmp_path):
    """wait_healthy's timeout makes every Python process below the server print its stacks (SIGABRT under
    PYTHONFAULTHANDLER) before it raises, so the log says where the start waits."""
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "time.sleep(60)"
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONFAULTHANDLER="1"), start_new_session=True)
    try:
        time.sleep(1.5)  # the child exists
        with pytest.raises(TimeoutError, match="stacks of 1 processes"):
            server_io.wait_healthy(1, proc, timeout=0.1)
        assert "Fatal Python error: Aborted" in log.read_text()
    finally:
        server_io.stop(proc)


# ---------------------------------------------------------------------------------------------------------------------
# scripts/bench_update.py: the plan, the dry run, the targets


def bench_args(*argv: str) -> argparse.Namespace:
    return bench_update.parse_args(["--model-dir", "m", "--out", "o", *argv])


def test_plan_puts_the_trainer_outside_the_engine():
    """TP 2 on four GPUs: the trainer (and the BF16 payload it broadcasts) on GPU 2, the pre-quantized payload on 3.
    TP 4 on four: no broadcast path (NCCL: one GPU per rank), the payload spread over all four. A trainer GPU inside
    the engine, or a TP larger than the machine, is refused naming the option."""
    plan = update_scaleout.make_plan(bench_args("--tp-size", "2"), 4)
    assert (plan.trainer_gpu, plan.payload_gpus, plan.prequant_gpus) == (2, [2], [3])
    assert "broadcast" in plan.paths and plan.server_flags == ["--tp-size", "2"]  # dense: the fusion stays SGLang's
    plan = update_scaleout.make_plan(bench_args("--tp-size", "2", "--model", "qwen3-30b-a3b"), 4)
    assert plan.server_flags == ["--tp-size", "2", scale_out.NO_ALLREDUCE_FUSION]
    assert update_scaleout.make_plan(bench_args("--model", "qwen3-30b-a3b"), 4).server_flags == []
    plan = update_scaleout.make_plan(bench_args("--tp-size", "4", "--kv-cache-dtype", "fp8_e4m3"), 4)
    assert plan.trainer_gpu is None and "broadcast" not in plan.paths and "needs 5 GPUs" in plan.skipped["broadcast"]
    assert plan.payload_gpus == [0, 1, 2, 3] and plan.server_flags[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]
    plan = update_scaleout.make_plan(bench_args("--tp-size", "2", "--paths", "tensor", "disk", "--skip-disk"), 4)
    assert plan.paths == ["tensor"] and plan.skipped["disk"] == "--skip-disk" and plan.payload_gpus == [2, 3]
    with pytest.raises(ValueError, match="--trainer-gpu 1 is one of the engine's GPUs"):
        update_scaleout.make_plan(bench_args("--tp-size", "2", "--trainer-gpu", "1"), 4)
    with pytest.raises(ValueError, match="--tp-size 4: this machine has 2 GPU"):
        update_scaleout.make_plan(bench_args("--tp-size", "4"), 2)


def test_spread_balances_bytes():
    shapes = {"a": (4, 4), "b": (2, 2), "c": (2, 2), "d": (2, 2), "e": (2, 2)}
    assert update_scaleout.bytes_per_gpu(shapes, [0, 1]) == {0: 32, 1: 32}


def test_bench_update_dry_run_plans_30b_at_tp4(tmp_path, capsys):
    """--dry-run without a GPU: the plan, 15.3 GB of BF16 payload per GPU at TP 4 on four GPUs, both engines'
    launch commands (read by SGLang's parser: TP 4, the FP8 one with our method, FlashInfer's all-reduce fusion off:
    on a fresh H200 machine its start-up build ran past 200 s and the scheduler aborted in it), the target lines."""
    rc = bench_update.main(["--model-dir", str(tmp_path / "models"), "--out", str(tmp_path / "o"), "--model",
                            "qwen3-30b-a3b", "--tp-size", "4", "--gpus", "4", "--dry-run"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["plan"]["tp"] == 4 and "broadcast" in out["plan"]["skipped"]
    assert set(out["payload_gb_per_gpu"].values()) == {15.27}
    for eng, quant in (("bf16", None), ("fp8", "fp8_online_blockwise")):
        parsed = sglang_server_args(out["launch"][eng].split())
        assert (parsed.tp_size, parsed.quantization, parsed.load_format) == (4, quant, "dummy")
        assert parsed.enforce_disable_flashinfer_allreduce_fusion
    assert any("no GPU outside the engine's 4" in t for t in out["targets"] if t.startswith("FP8 broadcast <="))
    assert bench_update.main(["--model-dir", "m", "--out", "o", "--tp-size", "2", "--trainer-gpu", "0",
                              "--gpus", "4", "--dry-run"]) == 2


def test_bench_update_dry_run_of_the_24_layer_30b_fits_one_80gb_gpu(tmp_path, capsys):
    """qwen3-30b-a3b-24l: 30B-A3B's first 24 layers (the same tensors a layer), half the payload on one GPU."""
    rc = bench_update.main(["--model-dir", str(tmp_path / "models"), "--out", str(tmp_path / "o"), "--model",
                            "qwen3-30b-a3b-24l", "--tp-size", "1", "--dry-run"])
    out = json.loads(capsys.readouterr().out)
    config = json.loads((tmp_path / "models" / "qwen3-30b-a3b-24l" / "config.json").read_text())
    assert rc == 0 and config["num_hidden_layers"] == 24 and config["num_experts"] == 128
    assert 30 < out["payload_gb_per_gpu"]["0"] < 32  # half of 30B-A3B's 61.06 GB (embeddings and lm_head whole)


def test_issue_36_target_lines():
    """<= 1.0 s per full update of 30B-A3B at TP 4 by tensor and by broadcast, no slower than BF16 in the same run;
    the engine's breakdown of a path and its KV recalibrations; other models and TPs are reported, not judged."""
    tele = {"buckets": 4, "validate_s": 0.2, "apply_s": 0.3}
    res = {"model": "qwen3-30b-a3b", "plan": {"tp": 4, "skipped": {}}, "engines": {
        "bf16": {"tensor": {"mean_s": 0.8}, "broadcast": {"mean_s": 1.5}},
        "fp8": {"tensor": {"mean_s": 0.9, "server_telemetry": tele, "kv_recalibration": {"writes": 3, "last_s": 0.05}},
                "broadcast": {"mean_s": 1.2}}}}
    lines = update_scaleout.scale_targets(res)
    assert "FP8 tensor <= 1.0 s per full update (qwen3-30b-a3b, TP 4): 0.90 s -> PASS" in lines
    assert "FP8 tensor no slower than BF16 tensor (same run): 0.90 s / 0.80 s = 1.12x -> FAIL" in lines
    assert "FP8 broadcast <= 1.0 s per full update (qwen3-30b-a3b, TP 4): 1.20 s -> FAIL" in lines
    assert "FP8 broadcast no slower than BF16 broadcast (same run): 1.20 s / 1.50 s = 0.80x -> PASS" in lines
    assert any(t.startswith("fp8 tensor breakdown: 0.90 s per update = validate 0.200 s + quantize and write 0.300 s "
                            "+ transfer and the rest 0.400 s") for t in lines)
    assert any("3 KV-scale recalibrations after its pushes, the last 0.050 s" in t for t in lines)
    res["plan"]["tp"] = 2
    assert "here (qwen3-30b-a3b, TP 2; the target is set at qwen3-30b-a3b TP 4)" in update_scaleout.scale_targets(
        res)[0]


def test_telemetry_push_reads_every_bucket_of_both_transports(monkeypatch, tmp_path):
    """bench_update's engine split (validate / quantize and write) for by-tensor and flattened pushes: one request per
    bucket, its last_update read after it; a flattened bucket carries no step-complete marker (it would travel in a
    request of its own and be what last_update reports)."""
    import torch
    import update_bench_run

    import sglang_fp8rl.trainer as trainer

    sent: list = []

    def push_state_dict(url, weights, **kw):
        sent.append((list(weights), kw))

    def fp8rl_info(url):
        names, kw = sent[-1]
        return {"last_update": {"ok": True, "tensors": len(names), "validate_s": 0.01, "apply_s": 0.02,
                                "marker": kw["complete"]}}

    monkeypatch.setattr(trainer, "push_state_dict", push_state_dict)
    monkeypatch.setattr(update_bench_run, "fp8rl_info", fp8rl_info)
    bench = update_bench_run.Bench(argparse.Namespace(bucket_mb=1, deadline_s=60, out=str(tmp_path)), None, None)
    weights = {f"w{i}": torch.zeros(1 << 17) for i in range(5)}  # 512 KiB each: buckets of 2, 2, 1
    for flatten in (False, True):
        sent.clear()
        tele = bench.telemetry_push("http://engine", weights, flatten=flatten)
        assert [len(names) for names, _ in sent] == [2, 2, 1]
        assert all(kw["flatten"] is flatten and kw["atomic"] is False and kw["complete"] is not flatten
                   for _, kw in sent)
        assert (tele["buckets"], tele["tensors"], tele["ok"]) == (3, 5, True)
        assert abs(tele["validate_s"] - 0.03) < 1e-9 and abs(tele["apply_s"] - 0.06) < 1e-9


def test_scheme_lines_are_counted_over_every_node_log(tmp_path):
    """Two nodes: TP ranks 0-1 log to server A's log, 2-3 to its node-1 log; one summary line per rank in all."""
    import server_checks

    line = "[fp8rl] fp8_online_blockwise: linear layers block=8, channel=0, bf16=0"
    logs = [tmp_path / "server_a.log", tmp_path / "server_a_node1.log"]
    logs[0].write_text(f"[t TP0] {line}\n[t TP1] {line}\n")
    logs[1].write_text(f"[t TP2] {line}\n[t TP3] {line}\n")
    run = server_checks.Run(argparse.Namespace(port=1, tp_size=4), {}, lambda rep, checks: None)
    check_server.log_checks(run, [str(p) for p in logs], tp_size=4)
    assert [c.verdict for c in run.checks] == ["PASS", "PASS"], run.checks


def test_check_broadcast_takes_a_layout(monkeypatch, tmp_path, capsys):
    """check_broadcast.py: the server's GPUs must be --tp-size of them, without the trainer's; without CUDA it stops
    with exit 2 naming the GPUs it needs (tp_size + 1)."""
    import os
    import sys

    import check_broadcast

    base = ["check_broadcast.py", "--model-dir", str(tmp_path), "--out", str(tmp_path / "o")]
    monkeypatch.setattr(sys, "argv", base + ["--tp-size", "2", "--server-gpu", "0,1", "--trainer-gpu", "1"])
    with pytest.raises(SystemExit):
        check_broadcast.main()
    assert "without --trainer-gpu 1" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", base + ["--tp-size", "2", "--server-gpu", "0,1", "--trainer-gpu", "2",
                                             "--nnodes", "2", "--moe"])
    from sglang_fp8rl.weight_sync.client import ENGINE_NCCL_ENV

    for name, value in ENGINE_NCCL_ENV.items():  # match_engine_nccl_env sets them in this process: undone after
        monkeypatch.setenv(name, os.environ.get(name, value))
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA path")
    assert check_broadcast.main() == 2
    assert "needs 3 GPUs" in capsys.readouterr().out


def test_probe_start_needs_cuda_and_sends_the_flags(monkeypatch, tmp_path, capsys):
    """scripts/gpu/probe_start.py: exit 2 without CUDA; on a GPU its launch is the checks' flags plus the layout's,
    with or without our --quantization."""
    import probe_start
    import torch

    if not torch.cuda.is_available():
        assert probe_start.main(["--model-dir", "m", "--out", str(tmp_path), "--", "--tp-size", "2"]) == 2
    seen: list = []
    monkeypatch.setattr(server_io.subprocess, "Popen", lambda cmd, **kw: seen.append(cmd))
    monkeypatch.setattr(server_io, "common_flags", lambda: ("--common",))
    for engine in ("bf16", "fp8"):
        probe_start.launch("M", 1, str(tmp_path / f"{engine}.log"), engine, ["--tp-size", "2", "--ep-size", "2"])
    assert seen[0][-4:] == ["--tp-size", "2", "--ep-size", "2"] and "--quantization" not in seen[0]
    assert seen[1][seen[1].index("--quantization") + 1] == "fp8_online_blockwise" and "--common" in seen[1]
