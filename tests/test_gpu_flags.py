"""The CUDA-graph launch flags of the GPU demo and scripts (compat.runtime.decode_graph_flags) against the installed
SGLang's own parser and ServerArgs resolution: the flags parse, none is a deprecated alias, and the resolved server
args capture the decode batch sizes asked for with the prefill graph off."""

from __future__ import annotations

import argparse

import pytest

from sglang_fp8rl import demo_common
from sglang_fp8rl.compat.runtime import decode_graph_flags


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # the demo's command line carries the plugin's --fp8rl-* flags and quantization name
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("flags") / "model")
    demo_common.write_config(d, demo_common.DEMO_DIMS)
    return d


def resolve(parser: argparse.ArgumentParser, model_dir: str, flags: list[str]):
    """SGLang's ServerArgs for ``flags`` as launch_server resolves them on a CUDA device. ``--device cuda`` because
    on ``--device cpu`` releases before 0.5.15 replace the decode sizes with torch.compile's (cpu graphs)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", model_dir, "--device", "cuda", *flags]))


def graph_config(args):
    """The resolved per-phase CUDA-graph config: a ServerArgs field in 0.5.15-0.5.20, behind
    ``arg_groups.overrides.resolved_view`` from 0.5.21, None before 0.5.15."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view
    except ImportError:
        return getattr(args, "cuda_graph_config", None)
    return getattr(resolved_view(args), "cuda_graph_config", None)


def decode_graphs(args) -> dict:
    """What the args say of the graphs: decode ``sizes`` and ``max``, ``decode_on``, ``prefill_off``. From the
    resolved per-phase config from 0.5.15 and the flat fields before; from 0.5.21 ServerArgs.from_cli_args leaves the
    config unresolved on a machine without a GPU (the launch pipeline resolves it), so there the raw per-phase fields
    are read: the sizes or the max as given, None for the other."""
    config = graph_config(args)
    if config is not None:
        return {"sizes": list(config.decode.bs), "max": config.decode.max_bs,
                "decode_on": config.decode.backend != "disabled", "prefill_off": config.prefill.backend == "disabled"}
    if hasattr(args, "cuda_graph_bs"):  # before 0.5.15
        return {"sizes": list(args.cuda_graph_bs), "max": args.cuda_graph_max_bs,
                "decode_on": not args.disable_cuda_graph, "prefill_off": bool(args.disable_piecewise_cuda_graph)}
    return {"sizes": args.cuda_graph_bs_decode, "max": args.cuda_graph_max_bs_decode,
            "decode_on": args.cuda_graph_backend_decode != "disabled",
            "prefill_off": args.cuda_graph_backend_prefill == "disabled"}


@pytest.mark.parametrize("request_", [{"batch_sizes": [1]}, {"batch_sizes": [1, 2, 4]}, {"max_bs": 8}, {}])
def test_flags_parse_and_resolve(parser, model_dir, request_):
    flags = decode_graph_flags(**request_)
    for flag in (f for f in flags if f.startswith("--")):
        action = parser._option_string_actions.get(flag)
        assert action is not None, f"{flag} unknown to this SGLang"
        assert not type(action).__name__.startswith("Deprecated"), f"{flag} is a deprecated alias here"
    graphs = decode_graphs(resolve(parser, model_dir, flags))
    assert graphs["prefill_off"] and graphs["decode_on"]
    if "batch_sizes" in request_:
        assert graphs["sizes"] == request_["batch_sizes"]
    if "max_bs" in request_:
        assert graphs["max"] == request_["max_bs"]
        assert graphs["sizes"] is None or (max(graphs["sizes"]) == request_["max_bs"] and 1 in graphs["sizes"])


def test_bad_requests():
    with pytest.raises(ValueError, match="not both"):
        decode_graph_flags(batch_sizes=[1], max_bs=8)
    with pytest.raises(ValueError, match="positive"):
        decode_graph_flags(batch_sizes=[0])
    with pytest.raises(ValueError, match="positive"):
        decode_graph_flags(batch_sizes=[])
    with pytest.raises(ValueError, match="positive"):
        decode_graph_flags(max_bs=0)


def test_demo_and_script_commands_resolve(parser, model_dir):
    """The GPU demo's and the GPU scripts' (scripts/gpu/server_io.py) full launch lines parse with this SGLang and
    capture bs 1 only / up to 8, without prefill graphs."""
    from sglang_fp8rl import demo_gpu

    cmd = demo_gpu.server_command(model_dir, 30030, 0.2, [])
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    graphs = decode_graphs(resolve(parser, model_dir, cmd[5:]))  # after "--model-path DIR"
    assert graphs["sizes"] == [1] and graphs["prefill_off"]

    import server_io  # scripts/gpu/server_io.py

    assert server_io.COMMON == list(server_io.common_flags())
    graphs = decode_graphs(resolve(parser, model_dir, ["--quantization", "fp8_online_blockwise", *server_io.COMMON]))
    assert graphs["max"] == server_io.DECODE_GRAPH_MAX_BS and graphs["prefill_off"]
