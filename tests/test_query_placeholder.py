"""``--fp8rl-decode-query bf16`` without SGLang's copy of the query (kernels/query_placeholder.py): the split-KV
kernel gets the model's query where it lies in qkv, FA3 gets it as SGLang would have handed it, and a decode that
reads the query some other way is run again on the query itself.

The backends are test_decode_query.py's, with SGLang's ``q.contiguous().view(-1, heads, head_dim)`` before the FA3
call (the form every supported release has: test_decode_query.py reads their sources), run through the real
dispatcher and the real hook.
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from decode_attention_case import fa3_decode_kwargs
from test_decode_query import E4M3, InlineBackend, Layer, MethodBackend, Recorder, _bf16_query, record_kernel_calls

from sglang_fp8rl.compat import fa3_query
from sglang_fp8rl.hooks.attention import install_decode_attention
from sglang_fp8rl.kernels import attention_select as sel
from sglang_fp8rl.kernels import query_placeholder as qp
from sglang_fp8rl.server_args import set_options


class _Copying:
    """SGLang's FA3 call: the query made contiguous and split into heads first."""

    def call_fa3(self, q, case, k_descale, v_descale):
        heads, dim = case["q"].shape[1:]
        return self.fa3(**fa3_decode_kwargs(case, q=q.contiguous().view(-1, heads, dim), k_descale=k_descale,
                                            v_descale=v_descale))


class InlineCopying(_Copying, InlineBackend):
    pass


class MethodCopying(_Copying, MethodBackend):
    pass


class HandsFA3APart(InlineCopying):
    """A decode that hands FA3 its first sequence's query alone (a release this package does not know)."""

    def call_fa3(self, q, case, k_descale, v_descale):
        return super().call_fa3(q[:1], case, k_descale, v_descale), q[:1].float().sum().item()


class ReadsTheQueryAlone(InlineCopying):
    """A decode that computes from the query without FA3 (a release this package does not know)."""

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        return q.float().sum().item()


def _in_qkv(batch: int) -> tuple[torch.Tensor, dict]:
    """The query as the model hands it: [tokens, heads * dim], a column slice of qkv (K and V after it)."""
    q, case = _bf16_query(batch)
    heads, dim = q.shape[1:]
    kv = case["k_cache"].shape[2] * dim
    qkv = torch.randn(batch, heads * dim + 2 * kv, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    qkv[:, :heads * dim] = q.reshape(batch, -1)
    return qkv[:, :heads * dim], case


def _kept(backend):
    """``backend`` as the hook leaves it under ``--fp8rl-decode-query bf16``."""
    fa3_query.keep_decode_query(backend)
    backend.forward_decode = qp.reading_the_model_query(backend.forward_decode)
    return backend


def _dispatched(backend_cls, fa3):
    return _kept(backend_cls(sel.dispatching(fa3, "auto", query="bf16")))


@pytest.mark.parametrize("backend_cls", [InlineCopying, MethodCopying])
def test_the_kernel_reads_the_query_in_qkv_and_fa3_gets_sglangs_copy(backend_cls, monkeypatch):
    kernel_calls = record_kernel_calls(monkeypatch)
    fa3, sglang_fa3 = Recorder(), Recorder()
    kept, sglangs = _dispatched(backend_cls, fa3), backend_cls(sglang_fa3)
    for batch in (2, sel.AUTO_MAX_BATCH + 1):  # the kernel's batch, then one that goes to FA3
        q, case = _in_qkv(batch)
        assert not q.is_contiguous()
        result = kept.forward_decode(q, None, None, Layer(), case)
        sglangs.forward_decode(q, None, None, Layer(), case)
        expected = sglang_fa3.calls[-1]
        if batch <= sel.AUTO_MAX_BATCH:
            got = kernel_calls[-1]["q"]
            assert result == "kernel" and got.data_ptr() == q.data_ptr()  # no copy: the bytes the model wrote
            assert got.stride() == (q.stride(0), q.shape[1] // got.shape[1], 1)
            assert got.dtype == torch.bfloat16 and torch.equal(got, q.reshape(got.shape))
        else:
            got = fa3.calls[-1]["q"]
            assert result == "fa3" and got.is_contiguous()  # FA3 as SGLang hands it: cast, contiguous, bit for bit
            assert torch.equal(got.view(torch.uint8), expected["q"].view(torch.uint8))
        assert not qp._STANDING  # nothing stays registered after a call
    assert len(kernel_calls) == 1 and len(fa3.calls) == 1


@pytest.mark.parametrize("backend_cls, fa3_calls", [(HandsFA3APart, 3), (ReadsTheQueryAlone, 0)])
def test_a_decode_that_does_not_take_the_query_back_whole_is_run_again_and_copies_from_then_on(
        backend_cls, fa3_calls, caplog):
    fa3 = Recorder()
    backend = _dispatched(backend_cls, fa3)
    q, case = _in_qkv(2)
    copying = backend_cls(sel.dispatching(Recorder(), "auto", query="bf16"))  # the BF16 query, no placeholder
    fa3_query.keep_decode_query(copying)
    expected = copying.forward_decode(q, None, None, Layer(), case)
    with caplog.at_level(logging.WARNING, logger="sglang_fp8rl.kernels.query_placeholder"):
        first = backend.forward_decode(q, None, None, Layer(), case)
        second = backend.forward_decode(q=q, k=None, v=None, layer=Layer(), forward_batch=case)
    assert first == second == expected  # from the query itself, not from a placeholder's bytes
    # with FA3 in it: the placeholder's call, its rerun, then the next call without a placeholder
    assert len(fa3.calls) == fa3_calls and not qp._STANDING
    warned = [r.getMessage() for r in caplog.records if r.name == qp.logger.name]
    assert len(warned) == 1 and "copied as SGLang copies it from now on" in warned[0]


def test_a_part_of_the_placeholder_is_not_taken_for_the_query():
    q, _ = _in_qkv(3)
    stand = qp.placeholder(q)
    assert stand is not q and stand.is_contiguous() and stand.shape == q.shape
    assert qp.real_query(stand[:1]) is not q  # a part: left as it is, and flagged
    whole = qp.real_query(stand.view(3, -1, 64))
    assert whole.data_ptr() == q.data_ptr() and whole.shape == (3, q.shape[1] // 64, 64)
    assert qp.release(stand) is False and not qp._STANDING  # flagged: the decode would run again
    stand = qp.placeholder(q)
    assert qp.real_query(stand).data_ptr() == q.data_ptr() and qp.release(stand) is True
    other = torch.randn(3, 4)
    assert qp.real_query(other) is other and qp.real_query(None) is None


def test_no_placeholder_where_the_copy_costs_nothing_nor_under_torch_compile(monkeypatch):
    contiguous, empty = torch.randn(2, 128).to(torch.bfloat16), torch.empty(0, 128, dtype=torch.bfloat16)
    assert qp.placeholder(contiguous) is contiguous and qp.placeholder(empty) is empty
    assert qp.release(contiguous) is True and qp.release(empty) is True and not qp._STANDING
    q, _ = _in_qkv(2)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a traced tensor has no data pointer
    assert qp.placeholder(q) is q and qp.real_query(q) is q and qp.release(q) is True and not qp._STANDING


def test_a_failing_decode_leaves_nothing_registered():
    backend = _kept(InlineCopying(None))  # its FA3 "function" is not callable: the call raises inside the decode
    q, case = _in_qkv(2)
    with pytest.raises(TypeError):
        backend.forward_decode(q, None, None, Layer(), case)
    assert not qp._STANDING and backend.kv_cache_dtype == E4M3


def test_the_hook_installs_it_once_with_the_bf16_query(monkeypatch):
    module = types.ModuleType("fp8rl_test_query_placeholder_backend")
    module.flash_attn_with_kvcache = Recorder()
    module.FlashAttentionBackend = type("FlashAttentionBackend", (MethodCopying,), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    args = types.SimpleNamespace(quantization="fp8_online_blockwise", kv_cache_dtype="fp8_e4m3")
    runner = types.SimpleNamespace(server_args=args, attn_backend=None)
    for query, wrapped in (("fp8", False), ("bf16", True)):
        backend = module.FlashAttentionBackend(lambda **kw: module.flash_attn_with_kvcache(**kw))
        plain = backend.forward_decode
        set_options(decode_attention="auto", decode_query=query)
        runner.attn_backend = backend
        assert install_decode_attention(runner) == "installed"
        assert (backend.forward_decode != plain) == wrapped
    once = backend.forward_decode
    assert install_decode_attention(runner) == "installed" and backend.forward_decode is once  # a second install
    assert qp.reading_the_model_query(once) is once  # a wrapper is never wrapped again
    q, case = _in_qkv(sel.AUTO_MAX_BATCH + 1)
    backend.forward_decode(q, None, None, Layer(), case)
    fa3 = sel.original_of(module.flash_attn_with_kvcache)
    sent = fa3.calls[-1]["q"]
    assert sent.dtype == E4M3 and sent.is_contiguous()
    assert torch.equal(sent.view(torch.uint8), q.to(E4M3).view(-1, *case["q"].shape[1:]).view(torch.uint8))
    set_options()
