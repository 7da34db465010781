"""Scale-out layouts of the GPU checks (scripts/gpu/check_server.py): expert parallelism, DP attention and two
"nodes" on one host, as launch flags and as the processes of one server. No GPU needed: tested on CPU in
tests/test_scale_out_scripts.py.

* ``--ep-size N``: each of the TP ranks holds num_experts / N whole experts (SGLang requires ep_size to divide
  tp_size; MoE TP is tp_size / ep_size); passed through as is.
* ``--enable-dp-attention --dp-size N``: attention split into N data-parallel groups of tp_size / N ranks, the MoE
  over all tp_size ranks. Every DP group holds its own copy of the attention weights, so the output checks generate
  each prompt on every DP rank (SGLang's ``routed_dp_rank``) and the telemetry is read from every DP rank.
* ``--nnodes 2``: one server as two launcher processes on this host, node r on GPUs r*tp/2 .. (``--node-rank r
  --base-gpu-id``), meeting at ``--dist-init-addr 127.0.0.1:PORT``; node 0 serves HTTP, node r >= 1 only a health
  stub on its own port. Both servers of a check get the same layout, so that the cold-start reference makes the
  same reductions as the server it is compared with.
Each server of a run gets its own rendezvous port (``dist_port``), away from the others' derived ZMQ ports (SGLang's
DP-attention ports are derived from the rendezvous port: dist_port+1 .. dist_port+6).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
from typing import Callable, Optional

NODE_PORT_STEP = 50  # node r's health stub listens on PORT + 50*r
DIST_PORT_OFFSET = 100  # server k of a run (0: A, 1: B) meets at PORT_A + 100 + 20*k
DIST_PORT_STEP = 20
# SGLang turns FlashInfer's all-reduce fusion on for MoE at TP > 1 and JIT-compiles it at start (over 200 s, then the
# scheduler aborted in that build on 0.5.17: docs/RESULTS.md sec. 22); no check here depends on it
NO_ALLREDUCE_FUSION = "--enforce-disable-flashinfer-allreduce-fusion"


def start_flags(moe: bool, tp_size: int) -> list[str]:
    """Flags a server of this layout needs to start in time: FlashInfer's all-reduce fusion off for MoE at TP > 1."""
    return [NO_ALLREDUCE_FUSION] if moe and tp_size > 1 else []


def add_args(p: argparse.ArgumentParser) -> None:
    """The scale-out options of a check (after its --tp-size)."""
    p.add_argument("--ep-size", type=int, default=1, help="expert parallelism of both servers (divides --tp-size)")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="DP attention (with --dp-size N > 1 dividing --tp-size)")
    p.add_argument("--dp-size", type=int, default=1, help="attention DP groups with --enable-dp-attention")
    p.add_argument("--nnodes", type=int, default=1,
                   help="launch each server as this many 'nodes' on this host (tp-size / nnodes GPUs each)")


def check_args(args: argparse.Namespace, error: Callable[[str], None]) -> None:
    """Refuse layouts SGLang would refuse later, naming the option and what to pass instead."""
    tp = args.tp_size
    if args.ep_size < 1 or tp % args.ep_size:
        error(f"--ep-size {args.ep_size} must divide --tp-size {tp} (SGLang: MoE TP = tp_size / ep_size)")
    if args.enable_dp_attention != (args.dp_size > 1):
        error("--enable-dp-attention and --dp-size N > 1 go together (--dp-size alone would start N independent "
              "replicas, which this check does not drive)")
    if args.dp_size < 1 or tp % args.dp_size:
        error(f"--dp-size {args.dp_size} must divide --tp-size {tp} (each DP group holds tp_size / dp_size ranks)")
    if args.nnodes < 1 or tp % args.nnodes:
        error(f"--nnodes {args.nnodes} must divide --tp-size {tp} (each node holds tp_size / nnodes GPUs)")
    if args.nnodes > 1 and args.enable_dp_attention:
        # each node's launcher waits for the rendezvous port to be free under DP attention (SGLang 0.5.17
        # server_args.py:9528), which node 0 holds once it is up: on one host that node 1 can lose the race
        error("--nnodes > 1 with --enable-dp-attention: on one host node 1's launcher waits for the rendezvous port "
              "node 0 holds; run DP attention on one node (drop --nnodes)")


def parallel_flags(args: argparse.Namespace) -> list[str]:
    """The launch flags both servers share: TP, EP, DP attention (and the start flags of an MoE at TP > 1)."""
    flags = ["--tp-size", str(args.tp_size)] if args.tp_size > 1 else []
    flags += start_flags(getattr(args, "moe", False), args.tp_size)
    if args.ep_size > 1:
        flags += ["--ep-size", str(args.ep_size)]
    if args.enable_dp_attention:
        flags += ["--enable-dp-attention", "--dp-size", str(args.dp_size)]
    return flags


def layout(args: argparse.Namespace) -> dict:
    """The run's layout for its report."""
    return {"tp_size": args.tp_size, "ep_size": args.ep_size, "dp_attention": args.enable_dp_attention,
            "dp_size": args.dp_size, "nnodes": args.nnodes, "flags": parallel_flags(args)}


def dist_port(base_port: int, server: int) -> int:
    """The rendezvous port of server ``server`` (0: A, 1: B) of a run whose server A listens on ``base_port``."""
    return base_port + DIST_PORT_OFFSET + DIST_PORT_STEP * server


@dataclasses.dataclass(frozen=True)
class NodeLaunch:
    """One launcher process of a server: its log and its own flags."""

    node_rank: int
    log: str
    flags: tuple[str, ...]


def node_launches(args: argparse.Namespace, port: int, log: str, rendezvous: int) -> list[NodeLaunch]:
    """The launcher processes of one server listening on ``port`` (one unless --nnodes > 1 or DP attention needs
    its own rendezvous port)."""
    flags = tuple(parallel_flags(args))
    needs_rendezvous = args.nnodes > 1 or args.enable_dp_attention
    meet = ("--dist-init-addr", f"127.0.0.1:{rendezvous}") if needs_rendezvous else ()
    if args.nnodes == 1:
        return [NodeLaunch(0, log, flags + meet)]
    per_node = args.tp_size // args.nnodes
    out = []
    for r in range(args.nnodes):
        node = ("--nnodes", str(args.nnodes), "--node-rank", str(r), "--base-gpu-id", str(r * per_node))
        if r:  # node r >= 1 serves only SGLang's health stub, which needs a port of its own on this host
            node += ("--port", str(port + NODE_PORT_STEP * r))
        stem, ext = os.path.splitext(log)
        out.append(NodeLaunch(r, log if r == 0 else f"{stem}_node{r}{ext}", flags + meet + node))
    return out


class Server:
    """The launcher processes of one server, as one process to the checks: ``poll`` says the first exit code of any
    (a node that died takes the server with it), ``procs`` are stopped together."""

    def __init__(self, procs: list[subprocess.Popen], logs: list[str]):
        self.procs, self.logs = procs, logs
        self.pid = procs[0].pid

    def poll(self) -> Optional[int]:
        """None while every node runs, else the exit code of one that stopped."""
        codes = [p.poll() for p in self.procs]
        return next((c for c in codes if c is not None), None)

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()


def launch_server(launch: Callable[..., subprocess.Popen], model: str, port: int, log: str,
                  args: argparse.Namespace, rendezvous: int, *extra: str, **launch_kwargs) -> Server:
    """Start every node of one server with ``launch(model, port, log, *flags, **launch_kwargs)`` (server_io.launch:
    mem, env_extra)."""
    nodes = node_launches(args, port, log, rendezvous)
    # node r's --port (a later flag) wins over the launcher's own --port for the health stub
    procs = [launch(model, port, n.log, *extra, *n.flags, **launch_kwargs) for n in nodes]
    return Server(procs, [n.log for n in nodes])
