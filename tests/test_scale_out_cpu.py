"""Scale-out setups on a tiny Qwen3-MoE through SGLang's real CPU ModelRunner, two gloo ranks (one worker pair each):

* expert parallelism (`--tp-size 2 --ep-size 2`): each rank holds exactly its experts, quantized per expert as
  `quant.quantize_blockwise` of the HF tensor; updates by tensor and from disk equal a cold start on both ranks; a
  pre-quantized expert update; a refused update leaves both ranks unchanged and in step;
* DP attention (`--tp-size 2 --enable-dp-attention --dp-size 2`): attention whole on every rank, experts split over
  both; the same update checks, without logits (its forward does not run on CPU);
* setups refused at start (DeepEP and other all-to-all dispatchers, MoE runners other than Triton) and accepted;
* the scheme each Qwen3-30B-A3B expert gets under TP and EP (arithmetic, the rule of layers/moe.py).
What SGLang does with these on CPU: tests/scale_out_scenario.py's docstring."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from sgl_model import TINY_MOE, as_bytes, run_tp_workers, write_moe_checkpoint

from sglang_fp8rl import quant
from sglang_fp8rl.layers.moe import choose_moe_scheme
from sglang_fp8rl.layers.scheme import Scheme

QUANT = ("--quantization", "fp8_online_blockwise")
# two KV heads: with one, Qwen3-MoE attention at TP 2 is refused by the qkv loader on CPU (tests/test_moe_cpu.py)
DIMS = dict(TINY_MOE, num_key_value_heads=2)
EXPERTS = "model.layers.{layer}.mlp.experts"
LOCAL = DIMS["num_experts"] // 2  # experts per rank
NAN_EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"  # held by rank 1 only


def expert_names(layer: int, e: int) -> tuple[str, str, str]:
    """HF names of one expert's gate, up and down projections."""
    return tuple(f"{EXPERTS.format(layer=layer)}.{e}.{x}_proj.weight" for x in ("gate", "up", "down"))


def prequantized_experts(sd: dict, layer: int) -> list[tuple[str, torch.Tensor]]:
    """Every expert of one layer as FP8 codes + power-of-two block scales (our quantizer would not make those)."""
    out = []
    for e in range(DIMS["num_experts"]):
        for name in expert_names(layer, e):
            codes, scale = quant.quantize_blockwise(sd[name], scale_format="pow2")
            out += [(name, codes), (name + "_scale_inv", scale)]
    return out


@contextlib.contextmanager
def rendezvous_of_its_own(needed: bool):
    """SGLang's own override of the ranks' rendezvous (SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE), for DP attention.

    Each CPU worker builds SGLang's PortArgs itself (a server builds them once, in the launcher); under DP attention
    PortArgs waits up to 30 s for the rendezvous port to be free (`server_args.py:9528`), which rank 0 already holds
    once it is up, so rank 1 fails whenever it gets there second. With the override SGLang skips that wait."""
    from conftest import free_port

    name = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"
    before = os.environ.get(name)
    if needed:
        os.environ[name] = f"tcp://127.0.0.1:{free_port()}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def run_scale_out(d, args: tuple[str, ...], forward: bool = True) -> dict:
    """One worker pair on a cold start of W1: W0 by tensor, a refused request, W1 by tensor, W0 from disk, layer 0's
    experts pre-quantized (W1). Every rank's steps by name."""
    w1 = write_moe_checkpoint(str(d / "w1"), DIMS, seed=60)
    w0 = write_moe_checkpoint(str(d / "w0"), DIMS, seed=61)
    nan = w1[NAN_EXPERT].clone()
    nan[5, 7] = float("nan")
    good = expert_names(1, 0)[0]  # rank 0's expert under EP 2, a good tensor beside the bad one
    requests = [{"name": "w0", "tensors": list(w0.items())},
                {"name": "refused", "tensors": [(good, w1[good]), (NAN_EXPERT, nan)]},
                {"name": "w1", "tensors": list(w1.items()), "logits": True},
                {"name": "w0_disk", "kind": "disk", "path": str(d / "w0")},
                {"name": "prequant", "tensors": prequantized_experts(w1, 0)}]
    path = str(d / "req.pt")
    torch.save(requests, path)
    # 300 s: a pair takes 25-35 s on two busy cores; a rank that dies leaves the other waiting in gloo until then
    with rendezvous_of_its_own("--enable-dp-attention" in args):
        ranks = run_tp_workers("scale_out", str(d / "w1"), str(d / "run"), 2, *QUANT, *args,
                               extra={"requests": path, "forward": forward}, timeout=300)
    return {"w0": w0, "w1": w1, "ranks": ranks, "steps": [{s["name"]: s for s in r["steps"]} for r in ranks]}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> dict:
    return run_scale_out(tmp_path_factory.mktemp("ep2"), ("--ep-size", "2"))


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> dict:
    return run_scale_out(tmp_path_factory.mktemp("dp2"), ("--enable-dp-attention", "--dp-size", "2"), forward=False)


# the two layouts: EP 2 (rank r holds whole experts 2r, 2r+1) and DP attention at TP 2 (every expert, half of its
# intermediate rows on each rank)
EP2, DP2 = "ep2", "dp2"


def held(layout: str, rank: int) -> list[tuple[int, int, slice]]:
    """(local slot, global expert, rows of the expert's intermediate dimension) this rank holds."""
    inter = DIMS["moe_intermediate_size"]
    if layout == EP2:
        return [(local, rank * LOCAL + local, slice(0, inter)) for local in range(LOCAL)]
    half = inter // 2
    return [(e, e, slice(rank * half, (rank + 1) * half)) for e in range(DIMS["num_experts"])]


def expected_expert(sd: dict, layer: int, e: int, part: slice) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """w13 / w2 of this rank's part of one expert as quant.quantize_blockwise makes them."""
    gate, up, down = expert_names(layer, e)
    return {"w13": quant.quantize_blockwise(torch.cat([sd[gate][part], sd[up][part]])),
            "w2": quant.quantize_blockwise(sd[down][:, part])}


def assert_rank_holds(params: dict, sd: dict, layout: str, rank: int) -> None:
    """Each local expert slot of this rank is the reference quantization of its part of its global expert."""
    slots = held(layout, rank)
    for layer in range(DIMS["num_hidden_layers"]):
        prefix = EXPERTS.format(layer=layer)
        rows = slots[0][2].stop - slots[0][2].start
        assert params[f"{prefix}.w13_weight"].shape == (len(slots), 2 * rows, DIMS["hidden_size"])
        for local, e, part in slots:
            for fused, (q, s) in expected_expert(sd, layer, e, part).items():
                assert torch.equal(as_bytes(params[f"{prefix}.{fused}_weight"][local]), as_bytes(q)), (rank, local)
                assert torch.equal(params[f"{prefix}.{fused}_weight_scale_inv"][local], s), (rank, layer, local)


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(as_bytes(a[name]), as_bytes(b[name])), (what, name)


def check_updates_equal_cold_start(run: dict, layout: str) -> None:
    """W0 by tensor is the reference quantization of W0; W1 by tensor afterwards gives every parameter of both
    ranks bit-identical to their cold W1 start (and equal logits where the forward runs); W0 from disk gives the same
    bytes as W0 by tensor; no pointer moved."""
    for rank, (result, steps) in enumerate(zip(run["ranks"], run["steps"])):
        for name in ("w0", "w1", "w0_disk"):
            assert steps[name]["answer"][0], (rank, name, steps[name]["answer"])
        assert_rank_holds(steps["w0"]["params"], run["w0"], layout, rank)
        assert_same(steps["w1"]["params"], result["cold"], f"rank {rank}: W1 by tensor vs cold W1")
        for got, want in zip(steps["w1"].get("logits", []), result["cold_logits"]):
            assert torch.equal(got, want)
        assert_same(steps["w0_disk"]["params"], steps["w0"]["params"], f"rank {rank}: W0 from disk vs by tensor")
        assert result["ptrs_before"] == result["ptrs_after"]
        assert steps["w0_disk"]["consistent"]


def check_refused_leaves_ranks_unchanged(run: dict) -> None:
    """A NaN in one expert beside a good tensor of another: both ranks refuse naming the tensor, neither writes
    (under EP 2 rank 0 does not even hold the bad expert), both stay consistent."""
    for rank, steps in enumerate(run["steps"]):
        ok, message = steps["refused"]["answer"]
        assert not ok and NAN_EXPERT in message and "nothing was written" in message, (rank, message)
        assert_same(steps["refused"]["params"], steps["w0"]["params"], f"rank {rank}: refused request")
        assert steps["refused"]["consistent"] and not steps["refused"]["dirty"]


def check_prequantized_experts(run: dict, layout: str) -> None:
    """Layer 0's experts as FP8 codes + power-of-two block scales (128-row parts: whole blocks): each rank stores
    exactly its part of the codes and of the scales of the experts it holds; nothing else changes."""
    sent = dict(prequantized_experts(run["w1"], 0))
    prefix = EXPERTS.format(layer=0)
    for rank, steps in enumerate(run["steps"]):
        assert steps["prequant"]["answer"][0], steps["prequant"]["answer"]
        params, before = steps["prequant"]["params"], steps["w0_disk"]["params"]
        for local, e, part in held(layout, rank):
            gate, up, down = expert_names(0, e)
            blocks = slice(part.start // 128, part.stop // 128)
            codes13 = torch.cat([sent[gate][part], sent[up][part]])
            scale13 = torch.cat([sent[gate + "_scale_inv"][blocks], sent[up + "_scale_inv"][blocks]])
            assert torch.equal(as_bytes(params[prefix + ".w13_weight"][local]), as_bytes(codes13)), (rank, e)
            assert torch.equal(params[prefix + ".w13_weight_scale_inv"][local], scale13), (rank, e)
            assert torch.equal(as_bytes(params[prefix + ".w2_weight"][local]), as_bytes(sent[down][:, part]))
            assert torch.equal(params[prefix + ".w2_weight_scale_inv"][local], sent[down + "_scale_inv"][:, blocks])
        changed = {n for n in params if not torch.equal(as_bytes(params[n]), as_bytes(before[n]))}
        assert changed <= {f"{prefix}.{p}" for p in ("w13_weight", "w13_weight_scale_inv", "w2_weight",
                                                      "w2_weight_scale_inv")}, changed


@pytest.mark.slow
def test_ep2_each_rank_holds_its_experts(ep2):
    """SGLang's loader map and its router's map agree: rank r holds experts 2r, 2r+1 as local 0, 1 (MoE TP 1), the
    others map to -1; each is blockwise, the reference quantization of the whole HF expert; logits equal on both."""
    for rank, result in enumerate(ep2["ranks"]):
        want = [g - rank * LOCAL if rank * LOCAL <= g < (rank + 1) * LOCAL else -1 for g in range(DIMS["num_experts"])]
        for prefix, place in result["placement"].items():
            assert (place["ep_rank"], place["ep_size"], place["moe_tp_size"], place["num_local"]) == (rank, 2, 1, LOCAL)
            assert place["dispatcher"] == "StandardDispatcher"
            assert place["loader_map"] == want and place["router_map"] == want, (rank, prefix, place)
        decisions = result["report"]["decisions"]
        assert all(decisions[EXPERTS.format(layer=i)][0] == "block" for i in range(DIMS["num_hidden_layers"]))
        assert_rank_holds(result["cold"], ep2["w1"], EP2, rank)
        assert all(torch.isfinite(x).all() for x in result["cold_logits"])
    for a, b in zip(ep2["ranks"][0]["cold_logits"], ep2["ranks"][1]["cold_logits"]):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_ep2_updates_by_tensor_and_disk_equal_a_cold_start(ep2):
    check_updates_equal_cold_start(ep2, EP2)


@pytest.mark.slow
def test_ep2_refused_update_leaves_both_ranks_unchanged(ep2):
    check_refused_leaves_ranks_unchanged(ep2)


@pytest.mark.slow
def test_ep2_prequantized_experts_stored_as_sent_on_their_rank(ep2):
    check_prequantized_experts(ep2, EP2)


@pytest.mark.slow
def test_dp_attention_replicates_attention_and_splits_experts(dp2):
    """--enable-dp-attention --dp-size 2 at TP 2: every attention projection is whole on each rank (attention TP 1,
    the layer's own split), blockwise, the reference quantization of the HF tensors; experts are split over both
    ranks (MoE TP 2, 128 rows each: blockwise)."""
    sd = dp2["w1"]
    for rank, result in enumerate(dp2["ranks"]):
        assert set(result["attention_tp"].values()) == {(0, 1)}, result["attention_tp"]
        for place in result["placement"].values():
            assert (place["ep_size"], place["moe_tp_size"], place["num_local"]) == (1, 2, DIMS["num_experts"])
        params = result["cold"]
        for layer in range(DIMS["num_hidden_layers"]):
            p = f"model.layers.{layer}.self_attn."
            qkv = torch.cat([sd[p + f"{x}_proj.weight"] for x in "qkv"])
            for module, w in (("qkv_proj", qkv), ("o_proj", sd[p + "o_proj.weight"])):
                q, s = quant.quantize_blockwise(w)
                assert torch.equal(as_bytes(params[p + module + ".weight"]), as_bytes(q)), (rank, module)
                assert torch.equal(params[p + module + ".weight_scale_inv"], s), (rank, module)
        assert_rank_holds(params, sd, DP2, rank)


@pytest.mark.slow
def test_dp_attention_updates_equal_a_cold_start(dp2):
    check_updates_equal_cold_start(dp2, DP2)
    check_refused_leaves_ranks_unchanged(dp2)
    check_prequantized_experts(dp2, DP2)


# Qwen3-30B-A3B: hidden 2048, moe_intermediate 768, 128 experts (scripts/gpu/make_models.py)
@pytest.mark.parametrize("tp,ep,scheme", [(1, 1, Scheme.BLOCK), (2, 1, Scheme.BLOCK), (4, 1, Scheme.CHANNEL),
                                          (2, 2, Scheme.BLOCK), (4, 4, Scheme.BLOCK), (4, 2, Scheme.BLOCK)])
def test_qwen3_30b_a3b_expert_scheme_under_tp_and_ep(tp, ep, scheme):
    """Each rank's expert slice is 768 / (tp / ep) rows: 192 at TP 4 without EP is not a multiple of 128, so those
    experts fall back to per-channel; with EP the experts stay whole enough to be blockwise."""
    decision = choose_moe_scheme(2048, 768 // (tp // ep), (128, 128))
    assert decision.scheme is scheme, (tp, ep, decision)


# ---------------------------------------------------------------------------------------------------------------------
# setups refused at start (layers/config.refuse_moe_backends), through SGLang's own ServerArgs


def server_args_of(model_dir: str, *extra: str):
    """SGLang's ServerArgs from a command line, with the plugin's hooks (as launch_server builds it)."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_fp8rl.plugin import register

    register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", model_dir, "--device", "cpu", "--quantization", "fp8_online_blockwise",
                              *extra])
    return ServerArgs.from_cli_args(args)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("moe_args") / "m")
    write_moe_checkpoint(d, DIMS, seed=62)
    return d


@pytest.mark.parametrize("extra,says", [
    (("--moe-a2a-backend", "deepep", "--tp-size", "2"), "--moe-a2a-backend deepep"),
    (("--moe-runner-backend", "triton_kernel"), "--moe-runner-backend triton_kernel"),
    (("--moe-runner-backend", "flashinfer_mxfp4", "--tp-size", "2", "--ep-size", "2"),
     "--moe-runner-backend flashinfer_mxfp4"),
    (("--moe-runner-backend", "deep_gemm", "--tp-size", "2", "--ep-size", "2"), "--moe-runner-backend deep_gemm"),
])
def test_moe_dispatch_and_runner_our_method_cannot_take_are_refused_at_start(moe_dir, extra, says):
    """DeepEP (SGLang sets ep_size = tp_size and accepts it) hands the Triton runner a dispatch format it has no
    permute step for; another MoE runner would be silently replaced, some changing the expert ids under EP."""
    with pytest.raises(ValueError, match=says + ".*serve"):
        server_args_of(moe_dir, *extra)


@pytest.mark.parametrize("extra", [("--tp-size", "2", "--ep-size", "2"),
                                   ("--tp-size", "2", "--ep-size", "2", "--moe-runner-backend", "triton"),
                                   ("--enable-dp-attention", "--dp-size", "2", "--tp-size", "2")])
def test_ep_and_dp_attention_with_the_standard_dispatcher_are_accepted(moe_dir, extra):
    args = server_args_of(moe_dir, *extra)
    assert args.moe_a2a_backend == "none" and args.tp_size == 2
