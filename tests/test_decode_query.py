"""``--fp8rl-decode-query bf16``: the split-KV kernel reads the decode query as the model made it, FA3 still gets it
in E4M3 (compat/fa3_query.py, kernels/attention_select.cast_query, hooks/attention.keep_query).

The real FA3 backend needs CUDA to import: the installed release's ``flashattention_backend.py`` is read with ``ast``
to show which of the two forms it has (the query cast inline in ``forward_decode``, or in ``prepare_paged_mha_query``)
and that the stand-ins below have that form's shape; the stand-ins then run on CPU through the real dispatcher.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import pathlib
import types

import pytest
import torch
from decode_attention_case import fa3_decode_kwargs, paged_case

from sglang_fp8rl.compat import fa3_query
from sglang_fp8rl.hooks.attention import install_decode_attention, query_form
from sglang_fp8rl.kernels import attention_select as sel
from sglang_fp8rl.server_args import Fp8rlOptions, parse_args, set_options

E4M3 = torch.float8_e4m3fn


def _backend_class_source() -> ast.ClassDef:
    (root,) = importlib.util.find_spec("sglang").submodule_search_locations
    path = pathlib.Path(root) / "srt" / "layers" / "attention" / "flashattention_backend.py"
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashAttentionBackend"]
    return cls


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found[0] if found else None


def _reads_of_cache_dtype(fn: ast.FunctionDef) -> list[ast.Attribute]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "kv_cache_dtype"
            and isinstance(n.value, ast.Name) and n.value.id == "self"]


def _is_cast_of(node: ast.AST, names: set[str]) -> bool:
    """``<name>.to(self.kv_cache_dtype)`` for a name in ``names``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in names and len(node.args) == 1
            and not node.keywords and _reads_of_cache_dtype(node.args[0]) == [node.args[0]])


def _casts_only(fn: ast.FunctionDef) -> None:
    """Every read of ``self.kv_cache_dtype`` in ``fn`` is the argument of a cast of q, q_rope or k_rope, and q's is
    ``q = q.to(self.kv_cache_dtype)``."""
    casts = [n for n in ast.walk(fn) if _is_cast_of(n, {"q", "q_rope", "k_rope"})]
    assert {id(c.args[0]) for c in casts} == {id(r) for r in _reads_of_cache_dtype(fn)}, ast.unparse(fn)[:400]
    assert any(isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["q"]
               and _is_cast_of(n.value, {"q"}) for n in ast.walk(fn))


def _functions_given_q(fn: ast.FunctionDef) -> set[str]:
    """Names of the functions called with ``q`` in an argument, outside the ``else`` of ``if not self.use_mla``."""
    mla = [n.orelse for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test) == "not self.use_mla"]
    skip = {id(node) for branch in mla for stmt in branch for node in ast.walk(stmt)}
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and id(node) not in skip and not _is_cast_of(node, {"q"}) and any(
                isinstance(n, ast.Name) and n.id == "q" for a in [*node.args, *(k.value for k in node.keywords)]
                for n in ast.walk(a)):
            names.add(ast.unparse(node.func).removeprefix("self."))
    return names


def _parents(fn: ast.FunctionDef) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}


def _is_fa3_query(node: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """``node`` is the ``q=`` keyword value of a ``flash_attn_with_kvcache`` call."""
    keyword = parents.get(id(node))
    call = parents.get(id(keyword))
    return isinstance(keyword, ast.keyword) and keyword.arg == "q" and isinstance(call, ast.Call) \
        and ast.unparse(call.func) == "flash_attn_with_kvcache"


def _unread_query_uses(fn: ast.FunctionDef) -> list[str]:
    """The reads of ``q`` in ``fn`` outside the MLA branch that are none of: its cast to the cache's dtype, an argument
    of prepare_paged_mha_query, metadata (shape, dtype, device), or ``q.contiguous().view(...)`` handed to FA3's
    function as ``q=`` (directly, or through a name that goes nowhere else). A query placeholder
    (kernels/query_placeholder.py) is only read by FA3's function, i.e. by the dispatcher, which reads the model's
    query instead."""
    parents = _parents(fn)
    mla = [n.orelse for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test) == "not self.use_mla"]
    skip = {id(node) for branch in mla for stmt in branch for node in ast.walk(stmt)}
    loads = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in skip:
            loads.setdefault(n.id, []).append(n)
    bad = []
    for n in loads.get("q", []):
        p = parents[id(n)]
        if isinstance(p, ast.Attribute) and p.attr in ("shape", "dtype", "device"):
            continue
        call = parents.get(id(p))
        if _is_cast_of(call, {"q"}) or (isinstance(p, ast.Call) and ast.unparse(p.func) ==
                                         f"self.{fa3_query.QUERY_METHOD}"):
            continue
        view = parents.get(id(call))
        viewed = parents.get(id(view))
        if isinstance(p, ast.Attribute) and p.attr == "contiguous" and isinstance(view, ast.Attribute) \
                and view.attr == "view" and isinstance(viewed, ast.Call):
            if _is_fa3_query(viewed, parents):
                continue
            target = parents.get(id(viewed))
            if isinstance(target, ast.Assign) and len(target.targets) == 1 and isinstance(target.targets[0], ast.Name):
                name = target.targets[0].id
                if loads.get(name) and all(_is_fa3_query(use, parents) for use in loads[name]):
                    continue
        bad.append(f"line {n.lineno}: {ast.unparse(parents.get(id(p), p))[:120]}")
    return bad


def test_the_installed_release_reads_the_decode_query_only_through_fa3s_function():
    decode = _method(_backend_class_source(), "forward_decode")
    assert _unread_query_uses(decode) == []
    # the check can fail: a release whose decode also read the query elsewhere
    changed = ast.parse("def forward_decode(self, q):\n    o = flash_attn_with_kvcache(q=q.contiguous().view(-1, 2))\n"
                        "    s = q.sum()\n    return o + s\n").body[0]
    assert len(_unread_query_uses(changed)) == 1


def test_the_installed_release_casts_the_decode_query_in_the_form_the_adapter_knows():
    cls = _backend_class_source()
    decode = _method(cls, "forward_decode")
    method = _method(cls, fa3_query.QUERY_METHOD)
    stand_in = type("FlashAttentionBackend", (), {fa3_query.QUERY_METHOD: lambda self: None} if method else {})()
    form = fa3_query.query_cast_form(stand_in)
    if form == fa3_query.METHOD:  # 0.5.21 on
        params = [a.arg for a in method.args.args] + ["*"] + [a.arg for a in method.args.kwonlyargs]
        assert params == ["self", "q", "q_rope", "k_rope", "layer", "*", "logical_batch_size", "kv_head_num",
                          "is_prefill"], params
        _casts_only(method)
        # q is read only by its cast and handed back first, so a stand-in of the cache's dtype changes nothing else
        q_loads = [n for n in ast.walk(method)
                   if isinstance(n, ast.Name) and n.id == "q" and isinstance(n.ctx, ast.Load)]
        assert len(q_loads) == 2, ast.unparse(method)
        returns = [n for n in ast.walk(method) if isinstance(n, ast.Return)]
        assert [ast.unparse(r.value) for r in returns] == ["(q, q_rope, k_rope, k_descale, v_descale)"]
        calls = [n for n in ast.walk(decode) if isinstance(n, ast.Call) and ast.unparse(n.func) ==
                 f"self.{fa3_query.QUERY_METHOD}"]
        keywords = [{k.arg: ast.unparse(k.value) for k in c.keywords} for c in calls]
        assert calls and all(k.get("is_prefill") == "False" for k in keywords), keywords
        assert not _reads_of_cache_dtype(decode)  # forward_decode itself does not read it
    else:  # 0.5.12-0.5.17: inline, the only reads of the attribute in forward_decode
        _casts_only(decode)
    # outside the MLA branch (which this option leaves alone) the query reaches nothing but FA3's function, the cast
    # and prepare_paged_mha_query: nothing else sees it uncast
    assert _functions_given_q(decode) <= {"flash_attn_with_kvcache", fa3_query.QUERY_METHOD}, _functions_given_q(decode)
    # the dispatcher casts for FA3 from the keywords: every FA3 call of forward_decode passes the query by keyword
    fa3_calls = [n for n in ast.walk(decode) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                 and n.func.id == "flash_attn_with_kvcache"]
    assert fa3_calls and all(not c.args and "q" in [k.arg for k in c.keywords] for c in fa3_calls)


# ----------------------------------------------------------------------------------------------------------------
# stand-ins with each form's shape, run through the real dispatcher
# ----------------------------------------------------------------------------------------------------------------

class Layer:
    head_dim = 64
    tp_k_head_num = 2
    k_scale = torch.tensor([0.5])
    v_scale = torch.tensor([0.25])


class _Backend:
    """What both forms share: an FP8 cache, descales from the layer's scales, the FA3 call with keywords."""

    kv_cache_dtype_str = "fp8_e4m3"
    use_mla = False

    def __init__(self, fa3):
        self.kv_cache_dtype = E4M3
        self.fa3 = fa3

    def call_fa3(self, q, case, k_descale, v_descale):
        return self.fa3(**fa3_decode_kwargs(case, q=q, k_descale=k_descale, v_descale=v_descale))


class InlineBackend(_Backend):
    """0.5.12-0.5.17: forward_decode casts the query itself."""

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        k_descale = v_descale = None
        if self.kv_cache_dtype_str != "auto" and layer.head_dim <= 256:
            k_descale = layer.k_scale.expand(q.shape[0], layer.tp_k_head_num)
            v_descale = layer.v_scale.expand(q.shape[0], layer.tp_k_head_num)
            q = q.to(self.kv_cache_dtype)
        return self.call_fa3(q, forward_batch, k_descale, v_descale)


class MethodBackend(_Backend):
    """0.5.21 on: prepare_paged_mha_query casts it (and expands the descales)."""

    def prepare_paged_mha_query(self, q, q_rope, k_rope, layer, *, logical_batch_size, kv_head_num, is_prefill):
        k_descale = v_descale = None
        if self.kv_cache_dtype_str != "auto" and layer.head_dim <= 256:
            k_descale = layer.k_scale.expand(logical_batch_size, kv_head_num)
            v_descale = layer.v_scale.expand(logical_batch_size, kv_head_num)
            q = q.to(self.kv_cache_dtype)
            q_rope = q_rope.to(self.kv_cache_dtype) if q_rope is not None else None
            k_rope = k_rope.to(self.kv_cache_dtype) if k_rope is not None else None
        return q, q_rope, k_rope, k_descale, v_descale

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
        q, q_rope, k_rope, k_descale, v_descale = self.prepare_paged_mha_query(
            q, q_rope, k_rope, layer, logical_batch_size=q.shape[0], kv_head_num=layer.tp_k_head_num,
            is_prefill=False)
        return self.call_fa3(q, forward_batch, k_descale, v_descale)


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return "fa3"


def record_kernel_calls(monkeypatch) -> list[dict]:
    """The split-KV kernel's calls, recorded in its place: each returns "kernel"."""
    calls = []
    monkeypatch.setattr(sel, "run_split_kv",
                        lambda kwargs, hand_over=False, plans=None, forms=(): calls.append(kwargs) or "kernel")
    return calls


def _bf16_query(batch: int) -> tuple[torch.Tensor, dict]:
    case = paged_case(3, batch, 2, 4, 64, 1, [5 + b for b in range(batch)])
    q = torch.randn(case["q"].shape, generator=torch.Generator().manual_seed(batch)).to(torch.bfloat16)
    return q, case


@pytest.mark.parametrize("backend_cls", [InlineBackend, MethodBackend])
def test_the_kernel_reads_the_bf16_query_and_fa3_gets_sglangs_cast(backend_cls, monkeypatch):
    kernel_calls = record_kernel_calls(monkeypatch)
    fa3, sglang_fa3 = Recorder(), Recorder()
    kept, sglangs = backend_cls(sel.dispatching(fa3, "auto", query="bf16")), backend_cls(sglang_fa3)
    fa3_query.keep_decode_query(kept)
    assert fa3_query.keeps_decode_query(kept) and not fa3_query.keeps_decode_query(sglangs)
    for batch in (2, sel.AUTO_MAX_BATCH + 1):  # the kernel's batch, then one that goes to FA3
        q, case = _bf16_query(batch)
        result = kept.forward_decode(q, None, None, Layer(), case)
        sglangs.forward_decode(q, None, None, Layer(), case)
        expected = sglang_fa3.calls[-1]
        assert expected["q"].dtype == E4M3
        if batch <= sel.AUTO_MAX_BATCH:
            assert result == "kernel" and kernel_calls[-1]["q"] is q  # uncast: no copy
            got = kernel_calls[-1]
        else:
            assert result == "fa3"
            got = fa3.calls[-1]
            # SGLang's cast, bit for bit
            assert torch.equal(got["q"].view(torch.uint8), expected["q"].view(torch.uint8))
        assert torch.equal(got["k_descale"], expected["k_descale"]) and torch.equal(got["v_descale"],
                                                                                  expected["v_descale"])
        assert kept.kv_cache_dtype == E4M3  # the inline form's stand-in dtype lasts one call
    assert len(kernel_calls) == 1 and len(fa3.calls) == 1


def test_a_second_keep_changes_nothing_and_prefill_is_left_alone():
    backend = MethodBackend(Recorder())
    fa3_query.keep_decode_query(backend)
    wrapped = backend.prepare_paged_mha_query
    fa3_query.keep_decode_query(backend)
    assert backend.prepare_paged_mha_query is wrapped
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    for kwargs in (dict(is_prefill=True), dict(is_prefill=False)):
        for rope in (None, torch.randn(2, 8, 64).to(torch.bfloat16)):
            out_q, out_rope, *_ = backend.prepare_paged_mha_query(q, rope, None, Layer(), logical_batch_size=2,
                                                                  kv_head_num=2, **kwargs)
            uncast = not kwargs["is_prefill"] and rope is None
            assert (out_q is q) == uncast and out_q.dtype == (torch.bfloat16 if uncast else E4M3)
    inline = InlineBackend(Recorder())
    fa3_query.keep_decode_query(inline)
    once = inline.forward_decode
    fa3_query.keep_decode_query(inline)
    assert inline.forward_decode is once


def test_the_cache_dtype_is_restored_when_the_call_fails():
    backend = InlineBackend(None)  # its FA3 "function" is not callable: the call raises inside forward_decode
    fa3_query.keep_decode_query(backend)
    q, case = _bf16_query(2)
    with pytest.raises(TypeError):
        backend.forward_decode(q, None, None, Layer(), case)
    assert backend.kv_cache_dtype == E4M3
    with pytest.raises(TypeError):
        backend.forward_decode(q=q, k=None, v=None, layer=Layer(), forward_batch=case)
    assert backend.kv_cache_dtype == E4M3


def test_cast_query_casts_only_what_sglang_casts():
    case = paged_case(0, 2, 2, 4, 64, 1, [5, 3])
    q = torch.randn(case["q"].shape).to(torch.bfloat16)
    cast = sel.cast_query(fa3_decode_kwargs(case, q=q))["q"]
    assert torch.equal(cast.view(torch.uint8), q.to(E4M3).view(torch.uint8))
    untouched = [fa3_decode_kwargs(case),  # already E4M3
                 fa3_decode_kwargs(case, q=q, k_cache=case["k_cache"].to(torch.bfloat16)),  # a BF16 cache
                 dict(fa3_decode_kwargs(case), q=torch.randn(2, 8, 512).to(torch.bfloat16))]  # head dim > 256
    for kwargs in untouched:
        assert sel.cast_query(kwargs)["q"] is kwargs["q"]
    with pytest.raises(ValueError, match="--fp8rl-decode-query must be one of"):
        sel.dispatching(Recorder(), "auto", query="e5m2")


def test_mla_keeps_sglangs_cast_and_a_kept_query_stays_kept(caplog):
    backend = InlineBackend(Recorder())
    backend.use_mla = True
    with caplog.at_level(logging.INFO, logger="sglang_fp8rl.hooks.attention"):
        assert query_form(backend, "bf16") == "fp8"
    assert "multi-head latent attention" in caplog.text and not fa3_query.keeps_decode_query(backend)
    plain = InlineBackend(Recorder())
    assert query_form(plain, "fp8") == "fp8" and query_form(plain, "bf16") == "bf16"
    assert not fa3_query.keeps_decode_query(plain)  # a query: nothing changed
    fa3_query.keep_decode_query(plain)
    assert query_form(plain, "fp8") == "bf16"  # its decode no longer casts: a new dispatcher must


def test_install_keeps_the_query_where_asked(monkeypatch, caplog):
    module = types.ModuleType("fp8rl_test_fa3_query_backend")
    module.flash_attn_with_kvcache = Recorder()
    module.FlashAttentionBackend = type("FlashAttentionBackend", (MethodBackend,), {"__module__": module.__name__})
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    args = types.SimpleNamespace(quantization="fp8_online_blockwise", kv_cache_dtype="fp8_e4m3")
    for query, kept in (("fp8", False), ("bf16", True)):
        # it calls the module's function as SGLang's backend does, whichever function is installed there now
        backend = module.FlashAttentionBackend(lambda **kw: module.flash_attn_with_kvcache(**kw))
        set_options(decode_attention="auto", decode_query=query)
        with caplog.at_level(logging.INFO, logger="sglang_fp8rl.hooks.attention"):
            assert install_decode_attention(types.SimpleNamespace(server_args=args, attn_backend=backend)) == \
                "installed"
        assert fa3_query.keeps_decode_query(backend) == kept
        assert ("it reads the BF16 query" in caplog.text) == kept
    # installed again with the default: the backend no longer casts, so the new dispatcher still casts for FA3
    set_options(decode_attention="auto")
    assert install_decode_attention(types.SimpleNamespace(server_args=args, attn_backend=backend)) == "installed"
    q, case = _bf16_query(sel.AUTO_MAX_BATCH + 1)
    backend.forward_decode(q, None, None, Layer(), case)
    fa3 = sel.original_of(module.flash_attn_with_kvcache)
    assert fa3.calls[-1]["q"].dtype == E4M3
    set_options()


def test_a_query_option_that_cannot_apply_says_so(caplog):
    set_options(decode_attention="auto", decode_query="bf16")
    untouched = types.SimpleNamespace(quantization="fp8_online_blockwise", kv_cache_dtype="auto")
    triton = type("TritonAttnBackend", (), {})()
    with caplog.at_level(logging.INFO, logger="sglang_fp8rl.hooks.attention"):
        assert install_decode_attention(types.SimpleNamespace(server_args=untouched, attn_backend=triton)) == \
            "untouched"
        served = types.SimpleNamespace(quantization="fp8_online_blockwise", kv_cache_dtype="fp8_e4m3")
        assert install_decode_attention(types.SimpleNamespace(server_args=served, attn_backend=triton)) == "not fa3"
    lines = [r.getMessage() for r in caplog.records]
    assert any("--fp8rl-decode-query bf16 changes nothing here (the KV cache is not fp8_e4m3)" in m for m in lines)
    assert any("TritonAttnBackend's own" in m and "--fp8rl-decode-query bf16 changes nothing" in m for m in lines)
    set_options()


def test_the_option():
    assert parse_args([]).decode_query == "fp8" == Fp8rlOptions().decode_query
    assert parse_args(["--fp8rl-decode-query", "bf16"]).decode_query == "bf16"
    with pytest.raises(ValueError, match="--fp8rl-decode-query must be one of"):
        Fp8rlOptions(decode_query="e4m3")
    with pytest.raises(ValueError, match="--fp8rl-decode-query bf16 is for the split-KV kernel"):
        Fp8rlOptions(decode_query="bf16", decode_attention="fa3")
