"""The grouped blockwise quantizer (one launch for a bucket of tensors): the kernel under the Triton interpreter
against the float64-checked reference, the host-side eligibility rules, and the dispatcher's CPU behaviour."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import QUANTIZER_PREAMBLE, run_under_interpreter

from sglang_fp8rl import quant
from sglang_fp8rl.kernels import dispatch

pytest.importorskip("triton")

GROUPED_INTERPRETER_CHECK = QUANTIZER_PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels import triton_grouped as tg

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for fmt in ("fp32", "pow2"):
            # a plain tensor, a column slice of a wider one (a row-parallel rank's part), and two shards written
            # into rows of one fused parameter (q and k of a qkv_proj), with the parameter's scale rows
            wide = weight(256, 512, dtype)
            sources = [weight(384, 256, dtype), wide[:, 256:], weight(256, 256, dtype), weight(128, 256, dtype)]
            y_plain, s_plain = torch.full((384, 256), 7.0), torch.full((3, 2), float("nan"))
            y_cols, s_cols = torch.full((256, 256), 7.0), torch.full((2, 2), float("nan"))
            y_fused, s_fused = torch.full((384, 256), 7.0), torch.full((3, 2), float("nan"))
            outputs = [(y_plain, s_plain), (y_cols, s_cols), (y_fused[:256], s_fused[:2]),
                       (y_fused[256:], s_fused[2:])]
            items = [(w, y, s) for w, (y, s) in zip(sources, outputs)]
            assert all(tg.cannot_group(*item, (128, 128)) == "tensors not on one CUDA device" for item in items)
            tg.quantize_blockwise_grouped_launch(items, (128, 128), fmt == "pow2", torch.zeros(1, dtype=torch.int32))
            for w, y, s in items:
                _, s_ref = quant.quantize_blockwise(w, (128, 128), fmt)
                assert torch.equal(s, s_ref), (dtype, fmt, tuple(w.shape))
                assert torch.equal(y, quotient(w, quant.expand_block_scale(s_ref, tuple(w.shape), (128, 128))))

    # NaN/Inf: the flag is set, the bad blocks are untouched, every other block of every tensor is written
    bad, good = weight(256, 256, torch.bfloat16), weight(128, 384, torch.bfloat16)
    bad[200, 10] = float("nan")
    items = [(bad, torch.full((256, 256), 7.0), torch.full((2, 2), -1.0)),
             (good, torch.full((128, 384), 7.0), torch.full((1, 3), -1.0))]
    flag = torch.zeros(1, dtype=torch.int32)
    tg.quantize_blockwise_grouped_launch(items, (128, 128), False, flag)
    assert flag.item() == 1
    y, s = items[0][1], items[0][2]
    assert bool((y[128:, :128] == 7).all()) and s[1, 0] == -1
    assert bool((s.flatten()[[0, 1, 3]] != -1).all()) and bool((y[:128] != 7).any())
    assert bool((items[1][2] != -1).all())
    print("grouped interpreter ok")
    """
)


def test_grouped_kernel_under_the_triton_interpreter() -> None:
    result = run_under_interpreter(GROUPED_INTERPRETER_CHECK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grouped interpreter ok" in result.stdout


def _item(n: int, k: int, dtype=torch.bfloat16):
    return (torch.zeros(n, k, dtype=dtype), torch.zeros(n, k, dtype=quant.FP8_DTYPE),
            torch.zeros(-(-n // 128), -(-k // 128)))


@pytest.mark.parametrize("case, reason", [
    (lambda: _item(256, 384), "tensors not on one CUDA device"),
    (lambda: _item(200, 384), "shape (200, 384) is not whole 128x128 blocks"),
    (lambda: _item(256, 300), "shape (256, 300) is not whole 128x128 blocks"),
    (lambda: (_item(256, 256)[0].t(), *_item(256, 256)[1:]), "column stride is not 1"),
    (lambda: (torch.zeros(128, 264).bfloat16()[:, 8:], *_item(128, 256)[1:]), "rows not aligned"),
    (lambda: (torch.zeros(128, 264)[:, :256], *_item(128, 256)[1:]), "rows not aligned"),
    (lambda: _item(256, 256, torch.int8), "dtypes torch.int8 -> torch.float8_e4m3fn / torch.float32"),
    (lambda: (*_item(256, 256)[:2], torch.zeros(2, 3)), "scale shape (2, 3)"),
])
def test_grouped_reason_names_what_the_kernel_cannot_take(case, reason) -> None:
    assert dispatch.grouped_reason(*case()) == reason


def test_grouped_reason_for_a_block_size_the_kernels_do_not_take() -> None:
    assert dispatch.grouped_reason(*_item(256, 256), (96, 128)) == "block size (96, 128)"


def test_many_on_cpu_equals_one_by_one() -> None:
    torch.manual_seed(0)
    shapes = [(256, 384), (200, 300), (128, 128)]
    ws = [torch.randn(*shape) for shape in shapes]
    outs = [_item(*shape)[1:] for shape in shapes]
    assert dispatch.quantize_blockwise_many([(w, *o) for w, o in zip(ws, outs)], None) == 3
    for w, (q, s) in zip(ws, outs):
        q_ref, s_ref = quant.quantize_blockwise(w)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_many_refuses_a_nan_like_one_by_one() -> None:
    w = torch.randn(128, 128)
    w[3, 4] = float("nan")
    q, s = _item(128, 128)[1:]
    with pytest.raises(ValueError, match="NaN"):
        dispatch.quantize_blockwise_many([(w, q, s)], None)
    assert not bool(q.view(torch.uint8).any()) and not bool(s.any())


class _RecordingKernel:
    """Stands in for the grouped kernel: records each launch's grid and the input addresses of its table."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, int], list[int]]] = []

    def __getitem__(self, grid):
        def launch(table, flag, **constexprs):
            self.launches.append((grid, table[:, 0].tolist()))
        return launch


def test_grouped_launch_splits_past_the_grid_y_limit(monkeypatch) -> None:
    """Grid y is the tensor index, at most 65,535 on CUDA: a bigger group goes in chunks, in order, none empty."""
    from sglang_fp8rl.kernels import triton_grouped as tg

    assert tg.MAX_TENSORS_PER_LAUNCH == 2**16 - 1
    kernel = _RecordingKernel()
    monkeypatch.setattr(tg, "_grouped_blockwise_kernel", kernel)
    distinct = [_item(128, 128) for _ in range(3)]
    items = [distinct[i % 3] for i in range(tg.MAX_TENSORS_PER_LAUNCH + 2)]
    assert tg.quantize_blockwise_grouped_launch(items, (128, 128), False) == 2
    assert [grid for grid, _ in kernel.launches] == [(1, tg.MAX_TENSORS_PER_LAUNCH), (1, 2)]
    assert [ptr for _, ptrs in kernel.launches for ptr in ptrs] == [w.data_ptr() for w, _, _ in items]
    kernel.launches.clear()
    assert tg.quantize_blockwise_grouped_launch(items[:7], (128, 128), False, max_tensors=3) == 3
    assert [grid[1] for grid, _ in kernel.launches] == [3, 3, 1]
    with pytest.raises(ValueError, match="max_tensors"):
        tg.quantize_blockwise_grouped_launch(items[:2], (128, 128), False, max_tensors=0)


GROUPED_CHUNKS_INTERPRETER_CHECK = QUANTIZER_PREAMBLE + textwrap.dedent(
    """
    from sglang_fp8rl.kernels import triton_grouped as tg

    # five tensors in chunks of two (three launches): each tensor's codes and scales as its own launch gives them
    sources = [weight(128, 128 * (1 + i % 2), torch.bfloat16) for i in range(5)]
    items = [(w, torch.full(w.shape, 7.0), torch.full((1, w.shape[1] // 128), float("nan"))) for w in sources]
    assert tg.quantize_blockwise_grouped_launch(items, (128, 128), True, torch.zeros(1, dtype=torch.int32),
                                                max_tensors=2) == 3
    for w, y, s in items:
        _, s_ref = quant.quantize_blockwise(w, (128, 128), "pow2")
        assert torch.equal(s, s_ref), tuple(w.shape)
        assert torch.equal(y, quotient(w, quant.expand_block_scale(s_ref, tuple(w.shape), (128, 128))))
    print("grouped chunks ok")
    """
)


def test_grouped_kernel_in_chunks_under_the_triton_interpreter() -> None:
    result = run_under_interpreter(GROUPED_CHUNKS_INTERPRETER_CHECK)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grouped chunks ok" in result.stdout
