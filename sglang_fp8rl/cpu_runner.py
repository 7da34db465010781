"""SGLang's own ModelRunner on CPU, without a server: build it for a checkpoint and generate greedily.

`python -m sglang_fp8rl.demo --cpu` and the CPU tests use this to load, quantize, update and run a small model through
SGLang's real code paths (plugin entry point, ServerArgs, ModelRunner, WeightUpdater, the model's ``load_weights``)
on a machine without CUDA. The runner owns process-global state (torch.distributed, parallel groups): build one per
process.

Call :func:`install_cpu_stubs` before the first ``import sglang``.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

from sglang_fp8rl.compat.runtime import load_bench_model, no_graph_flags, one_batch, prefill_request
from sglang_fp8rl.compat.versions import imports_kvcacheio_unguarded

# ModelRunner on CPU: torch-native attention, a small KV pool, no CUDA graphs
CPU_SERVER_ARGS = ("--device", "cpu", "--dtype", "bfloat16", "--mem-fraction-static", "0.05", "--max-total-tokens",
                   "512")


# ---------------------------------------------------------------------------------------------------------------------
# torchvision stand-in


class _FnModule(types.ModuleType):
    """A module whose unknown public attributes are functions raising NotImplementedError."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def _unavailable(*args, **kwargs):
            raise NotImplementedError(f"{self.__name__}.{name} is not available: torchvision does not import here")

        _unavailable.__name__ = name
        return _unavailable


def _stub_module(name: str, cls: type = types.ModuleType, is_pkg: bool = True) -> types.ModuleType:
    module = cls(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_pkg)
    if is_pkg:
        module.__path__ = []
    module.__file__ = __file__
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _torchvision_imports() -> bool:
    """Whether a working torchvision is importable (a CUDA build next to a CPU torch is not)."""
    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError, OSError):
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def _stub_kvcacheio() -> None:
    """SGLang 0.5.12-0.5.14 import ``sgl_kernel.kvcacheio`` (host KV offload copies, a CUDA-only package) at module
    level on every non-NPU/XPU/MPS device, so on CPU the scheduler module does not import. The stand-in's functions
    raise if called; a CPU engine never offloads KV to host memory."""
    if importlib.util.find_spec("sgl_kernel") is not None or "sgl_kernel" in sys.modules:
        return
    if not imports_kvcacheio_unguarded():  # later releases guard the import themselves
        return
    _stub_module("sgl_kernel")
    _stub_module("sgl_kernel.kvcacheio", _FnModule, is_pkg=False)


def install_cpu_stubs() -> None:
    """Let SGLang import without a working torchvision (idempotent; a working torchvision wins).

    SGLang 0.5.17 imports torchvision at module level (``sglang.srt.utils.common``: ``decode_jpeg``;
    ``sglang.srt.configs.deepseek_ocr``: ``InterpolationMode``), only for image inputs. A CPU-only torch has no
    matching torchvision on PyPI (its wheels are CUDA builds that need libtorch_cuda.so), so without this a text model
    cannot even be imported there. transformers then sees torchvision as available, which it must: its
    AutoImageProcessor refuses to work otherwise, and SGLang registers image processors at import time."""
    _stub_kvcacheio()
    if "torchvision" in sys.modules or _torchvision_imports():
        return

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    class ImageReadMode(enum.Enum):
        UNCHANGED = 0
        GRAY = 1
        GRAY_ALPHA = 2
        RGB = 3
        RGB_ALPHA = 4

    _stub_module("torchvision").__version__ = "0.0.0+stub"
    _stub_module("torchvision.io", _FnModule, is_pkg=False).ImageReadMode = ImageReadMode
    _stub_module("torchvision.transforms", _FnModule).InterpolationMode = InterpolationMode
    _stub_module("torchvision.transforms.functional", _FnModule, is_pkg=False).InterpolationMode = InterpolationMode
    _stub_module("torchvision.transforms.v2", _FnModule)
    _stub_module("torchvision.transforms.v2.functional", _FnModule, is_pkg=False).InterpolationMode = InterpolationMode


# ---------------------------------------------------------------------------------------------------------------------
# ModelRunner


def build_runner(model_dir: str, server_args: Sequence[str] = (), tp_rank: int = 0) -> Any:
    """SGLang's CPU ModelRunner for ``model_dir``, wrapped as in ``sglang.benchmark.one_batch`` (``.torch_runner`` is
    the ModelRunner). The plugin is found the way SGLang finds it in production: its entry point, through
    ``load_plugins()``."""
    install_cpu_stubs()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_cpu = True  # else RotaryEmbedding imports vllm's op on a platform SGLang does not know
    from sglang.srt.entrypoints.engine import _set_envs_and_config
    from sglang.srt.server_args import PortArgs, prepare_server_args

    args = prepare_server_args(["--model-path", model_dir, *CPU_SERVER_ARGS, *no_graph_flags(), *server_args])
    _set_envs_and_config(args)
    bench_runner, _ = load_bench_model(args, PortArgs.init_new(args), tp_rank)
    return bench_runner


def greedy_generate(bench_runner: Any, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens after ``ids``: one prefill, then one decode step per token (fresh KV pool)."""
    extend, decode = one_batch().extend, one_batch().decode
    bench_runner.clear()
    next_ids, _, batch = extend([prefill_request(0, ids, max_new_tokens)], bench_runner.torch_runner)
    out = [int(next_ids[0])]
    for _ in range(max_new_tokens - 1):
        next_ids, _ = decode(next_ids, batch, bench_runner.torch_runner)
        out.append(int(next_ids[0]))
    return out
