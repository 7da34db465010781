"""Which kernel runs FP8-KV decode attention (``--fp8rl-decode-attention``): the call classifier and dispatcher
(sglang_fp8rl.kernels.attention_select), the hook that installs it on SGLang's FA3 backend (hooks/attention.py), the
patch point in the installed SGLang's source, and the option.

In-process on CPU; the one check that runs the split-KV kernel does so under the Triton interpreter (a subprocess).
The real FA3 backend needs CUDA to import: the hook is checked on a stand-in module, and the installed release's
``flashattention_backend.py`` is read with ``ast`` to show that the stand-in has the shape the hook relies on.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import logging
import pathlib
import sys
import textwrap
import types

import pytest
import torch
from decode_attention_case import DROP, fa3_decode_kwargs, paged_case
from triton_interpreter import BF16_RNE_PREAMBLE, E4M3_RNE_PREAMBLE, QUANTIZER_PREAMBLE, run_under_interpreter

from sglang_fp8rl.hooks.attention import install_decode_attention
from sglang_fp8rl.kernels import attention_select as sel
from sglang_fp8rl.server_args import Fp8rlOptions, get_options, options_from_namespace, parse_args, set_options

CASE = paged_case(0, 2, 2, 4, 64, 1, [5, 3])


def plain(**change) -> dict:
    return fa3_decode_kwargs(CASE, **change)


NOT_PLAIN = [
    (dict(max_seqlen_q=2), "not a decode"),
    (dict(window_size=(128, 0)), "sliding-window attention"),
    (dict(softcap=30.0), "logit soft-capping"),
    (dict(return_softmax_lse=True), "the log-sum-exp is asked for"),
    (dict(sinks=torch.zeros(8)), "sinks is set"),
    (dict(qv=torch.zeros(2, 8, 64)), "qv is set"),
    (dict(cu_seqlens_k_new=torch.zeros(3, dtype=torch.int32)), "cu_seqlens_k_new is set"),
    (dict(ver=4), "FlashAttention version 4"),
    (dict(num_splits=1), "one split asked for"),
    (dict(k_descale=DROP), "no K/V descales"),
    (dict(foo=1), "keywords this kernel does not implement: ['foo']"),
    (dict(page_table=None), "no page table"),
]


@pytest.mark.parametrize("scheduler_metadata", [torch.zeros(3, dtype=torch.int32), None])
def test_sglangs_plain_decode_call_is_plain(scheduler_metadata):
    assert sel.not_plain_decode(plain(scheduler_metadata=scheduler_metadata)) is None
    # neutral values SGLang passes on other paths (the local-attention call passes cu_seqlens_k_new=None)
    assert sel.not_plain_decode(plain(cu_seqlens_k_new=None, attention_chunk=0, window_size=[-1, -1])) is None


@pytest.mark.parametrize("change, reason", NOT_PLAIN, ids=[next(iter(c)) for c, _ in NOT_PLAIN])
def test_each_other_call_is_not_plain_with_its_reason(change, reason):
    assert reason in (sel.not_plain_decode(plain(**change)) or "")
    assert sel.choose("auto", plain(**change)) == (sel.FA3, sel.not_plain_decode(plain(**change)))


def test_choose():
    assert sel.choose("fa3", plain()) == ("fa3", "--fp8rl-decode-attention fa3")
    assert sel.choose("auto", plain())[0] == "split_kv"
    assert sel.choose("split_kv", plain())[0] == "split_kv"
    bf16 = plain(k_cache=CASE["k_cache"].to(torch.bfloat16), v_cache=CASE["v_cache"].to(torch.bfloat16))
    for mode in ("auto", "split_kv"):  # split_kv too: a call the kernel cannot take still runs, on FA3
        kernel, why = sel.choose(mode, bf16)
        assert kernel == "fa3" and "not float8_e4m3fn" in why
    with pytest.raises(ValueError, match="--fp8rl-decode-attention must be one of"):
        sel.choose("triton", plain())


def test_auto_takes_the_kernel_up_to_its_batch_limit_and_split_kv_above_it():
    limit = sel.AUTO_MAX_BATCH
    for batch, auto_kernel in ((1, "split_kv"), (limit, "split_kv"), (limit + 1, "fa3"), (4 * limit, "fa3")):
        case = paged_case(1, batch, 2, 4, 64, 1, [3] * batch)
        kernel, why = sel.choose("auto", fa3_decode_kwargs(case))
        assert kernel == auto_kernel, (batch, why)
        if kernel == "fa3":
            assert f"above {limit}" in why
        assert sel.choose("split_kv", fa3_decode_kwargs(case))[0] == "split_kv"  # the explicit mode: every batch


@pytest.mark.parametrize("max_batch", [1, 16, 32])
def test_auto_takes_the_kernel_up_to_the_batch_limit_it_is_given(max_batch):
    for batch, auto_kernel in ((1, "split_kv"), (max_batch, "split_kv"), (max_batch + 1, "fa3")):
        case = paged_case(1, batch, 2, 4, 64, 1, [3] * batch)
        kernel, why = sel.choose("auto", fa3_decode_kwargs(case), max_batch)
        assert kernel == auto_kernel, (batch, why)
        assert (f"above {max_batch} sequences" if kernel == "fa3" else f"batches up to {max_batch} sequences") in why
        # the explicit modes ignore the limit
        assert sel.choose("split_kv", fa3_decode_kwargs(case), max_batch)[0] == "split_kv"
        assert sel.choose("fa3", fa3_decode_kwargs(case), max_batch)[0] == "fa3"


class Recorder:
    """A stand-in for FA3's flash_attn_with_kvcache: records its calls, returns a new object each time."""

    def __init__(self):
        self.calls, self.results = [], []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        self.results.append(object())
        return self.results[-1]


def test_calls_the_kernel_does_not_take_reach_fa3_unchanged():
    fa3 = Recorder()
    dispatch = sel.dispatching(fa3, "auto")
    for change, _ in NOT_PLAIN:
        kwargs = plain(**change)
        assert dispatch(**kwargs) is fa3.results[-1]
        args_seen, kwargs_seen = fa3.calls[-1]
        assert args_seen == () and kwargs_seen.keys() == kwargs.keys()
        assert all(kwargs_seen[k] is kwargs[k] for k in kwargs)  # the same objects, not copies
    positional = (CASE["q"], CASE["k_cache"], CASE["v_cache"])
    assert dispatch(*positional, page_table=CASE["page_table"]) is fa3.results[-1]
    assert all(a is b for a, b in zip(fa3.calls[-1][0], positional))
    assert fa3.calls[-1][1]["page_table"] is CASE["page_table"]


def test_mode_fa3_sends_every_call_to_fa3():
    fa3 = Recorder()
    dispatch = sel.dispatching(fa3, "fa3")
    for kwargs in (plain(), plain(softcap=30.0), plain(out=torch.empty(2, 8, 64, dtype=torch.bfloat16))):
        assert dispatch(**kwargs) is fa3.results[-1]
        assert all(fa3.calls[-1][1][k] is kwargs[k] for k in kwargs)
    assert dispatch(CASE["q"]) is fa3.results[-1] and len(fa3.calls) == 4


def test_a_kernel_that_does_not_build_sends_this_call_and_every_later_one_to_fa3(monkeypatch, caplog):
    from triton.runtime.errors import OutOfResources

    tried = []

    def unbuildable(kwargs, hand_over=False, plans=None, forms=()):
        tried.append(kwargs)
        raise OutOfResources(232448, 101376, "shared memory")

    monkeypatch.setattr(sel, "run_split_kv", unbuildable)
    fa3 = Recorder()
    dispatch = sel.dispatching(fa3, "split_kv")
    kwargs = plain()
    with caplog.at_level(logging.INFO, logger="sglang_fp8rl.kernels.attention_select"):
        first, second = dispatch(**kwargs), dispatch(**kwargs)
    assert (first, second) == tuple(fa3.results)  # both answered by FA3, from the same operands
    assert all(call == ((), kwargs) for call in fa3.calls)
    assert len(tried) == 1  # not tried again
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "does not build on this GPU: OutOfResources" in warnings[0].getMessage()


def test_rewrapping_wraps_the_original_once():
    fa3 = Recorder()
    inner = sel.dispatching(fa3, "auto")
    outer = sel.dispatching(inner, "fa3")
    assert sel.original_of(inner) is fa3 and sel.original_of(outer) is fa3 and sel.original_of(fa3) is None
    # through the inner (auto) dispatcher this plain call would go to the kernel: it reaches FA3
    assert outer(**plain()) is fa3.results[-1] and len(fa3.calls) == 1


def test_each_decision_is_logged_once(caplog):
    dispatch = sel.dispatching(Recorder(), "auto")
    with caplog.at_level(logging.INFO, logger=sel.logger.name):
        for _ in range(2):
            dispatch(**plain(softcap=30.0))
            dispatch(**plain(max_seqlen_q=4))
            dispatch(CASE["q"])
    said = [r.getMessage() for r in caplog.records if r.name == sel.logger.name]
    assert len(said) == 3, said
    assert "fa3" in said[0] and "logit soft-capping" in said[0] and "positional arguments" in said[2]


KERNEL_THROUGH_DISPATCHER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import torch
    from decode_attention_case import ROW_TOLERANCE, fa3_decode_kwargs, paged_case, reference
    from sglang_fp8rl.kernels.attention_select import dispatching

    def fa3(*args, **kwargs):
        raise AssertionError("a plain FP8 decode call reached FA3")

    for mode in ("auto", "split_kv"):
        case = paged_case(5, 3, 2, 4, 128, 1, [70, 1, 300], scalar_descale=True)
        ref, vmax = reference(case)
        out = torch.full(case["q"].shape, float("nan"), dtype=torch.bfloat16)  # SGLang's _attn_output view
        assert dispatching(fa3, mode)(**fa3_decode_kwargs(case, out=out)) is out
        fresh = dispatching(fa3, mode)(**fa3_decode_kwargs(case))
        assert torch.equal(fresh, out) and fresh.dtype == torch.bfloat16
        tol = ROW_TOLERANCE * vmax + 2**-7 * (ref.abs() + ROW_TOLERANCE * vmax)  # one BF16 ulp (truncated)
        assert ((out.double() - ref).abs() <= tol).all(), mode
    print("dispatcher kernel ok")
    """
)


# --fp8rl-producer-quant on: the kernel's own output carries its 1x128 codes to o_proj, through the view o_proj reads
HANDOVER_THROUGH_DISPATCHER = QUANTIZER_PREAMBLE + E4M3_RNE_PREAMBLE + BF16_RNE_PREAMBLE + textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    from decode_attention_case import fa3_decode_kwargs, paged_case
    from sglang_fp8rl.kernels import producers
    from sglang_fp8rl.kernels.attention_select import dispatching

    def fa3(*args, **kwargs):
        raise AssertionError("a plain FP8 decode call reached FA3")

    case = paged_case(6, 3, 2, 4, 128, 1, [70, 1, 300], scalar_descale=True)
    handing = dispatching(fa3, "auto", hand_over=True)
    out = handing(**fa3_decode_kwargs(case))
    assert torch.equal(out, dispatching(fa3, "auto")(**fa3_decode_kwargs(case)))  # the same output
    o_proj_input = out.view(-1, 8 * 128)  # as SGLang's FA3 backend returns it
    codes, scales = producers.quantized_input(o_proj_input)
    ref_q, ref_s = quant.quantize_activation_groups(o_proj_input, 128)
    assert torch.equal(codes.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scales.contiguous(), ref_s)
    assert scales.stride() == (1, 4)  # the layout SGLang hands DeepGEMM: column-major, rows padded to 4
    # an output buffer the caller passes (it may be written by another kernel next), or a head dim that is not one
    # group: no codes, o_proj quantizes as before
    given = torch.empty(case["q"].shape, dtype=torch.bfloat16)
    assert handing(**fa3_decode_kwargs(case, out=given)) is given
    assert producers.quantized_input(given.view(-1, 8 * 128)) is None
    small = paged_case(7, 2, 2, 4, 64, 1, [5, 3], scalar_descale=True)
    assert producers.quantized_input(handing(**fa3_decode_kwargs(small)).view(2, -1)) is None
    print("dispatcher hand-over ok")
    """
)


# one plan a step (step_plan): the step's first call writes it, its other layers read it; lengths refilled in place
# (a graph's static tensor), a new lengths tensor, another grid or a capture starting each get a plan of their own,
# and every output is the per-layer plan's, bit for bit
STEP_PLAN_THROUGH_DISPATCHER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests")
    import torch
    from decode_attention_case import fa3_decode_kwargs, paged_case
    from sglang_fp8rl.kernels import fp8_decode_attention as fda
    from sglang_fp8rl.kernels import step_plan
    from sglang_fp8rl.kernels.attention_select import dispatching

    writes = []
    write_plan = fda.write_plan
    def counted(*args, **kwargs):
        writes.append(args[0].tolist())
        return write_plan(*args, **kwargs)
    fda.write_plan = counted
    capture = [False]
    step_plan.capturing = lambda device: capture[0]

    def fa3(*args, **kwargs):
        raise AssertionError("a plain FP8 decode call reached FA3")

    long, short = [70, 1, 300], [50, 1, 200]
    lens = torch.tensor(short, dtype=torch.int32)  # the step's one lengths tensor, every layer's
    layers = [dict(paged_case(10 + i, 3, 2, 4, 128, 1, long), cache_seqlens=lens) for i in range(3)]
    per_layer, shared = dispatching(fa3, "split_kv", forms=()), dispatching(fa3, "split_kv", forms=("step_plan",))

    def step(cases, expected_writes):
        want = [per_layer(**fa3_decode_kwargs(c)) for c in cases]
        writes.clear()
        got = [shared(**fa3_decode_kwargs(c)) for c in cases]
        assert all(torch.equal(a, b) for a, b in zip(got, want)), expected_writes
        assert writes == expected_writes, (writes, expected_writes)
        return got

    step(layers, [short])
    stale = fda.decode_plan(layers[0]["q"], layers[0]["k_cache"], lens)
    lens.copy_(torch.tensor(long, dtype=torch.int32))  # refilled in place, as SGLang refills a graph's lengths
    got = step(layers, [long])
    c = layers[0]
    wrong = fda.fp8_decode_attention(c["q"], c["k_cache"], c["v_cache"], c["page_table"], lens, c["softmax_scale"],
                                     c["k_descale"], c["v_descale"], plan=stale)
    assert not torch.equal(wrong, got[0])  # a stale plan would show: the check can fail
    step(layers, [])  # the next forward over the same, unchanged lengths (a warm-up run): the plan is kept
    capture[0] = True
    step(layers, [long])  # the captured forward writes its own plan (each replay writes it again)
    capture[0] = False
    fresh = torch.tensor(long, dtype=torch.int32)  # the next eager step: a new tensor, the same values
    step([dict(c, cache_seqlens=fresh) for c in layers], [long])
    # one KV head: another grid, its own plan; the layer after it writes the first grid's plan again
    other = dict(paged_case(20, 3, 1, 8, 128, 1, long), cache_seqlens=fresh)
    step([dict(layers[0], cache_seqlens=fresh), other, dict(layers[1], cache_seqlens=fresh)], [long] * 2)
    # an empty batch (a DP-attention rank without requests): no plan, an empty output, and the kernel still taken
    empty = {k: (v[:0] if k in ("q", "page_table", "k_descale", "v_descale") else v) for k, v in c.items()}
    step([dict(empty, cache_seqlens=lens[:0])], [])
    # lengths made under torch.inference_mode() (SGLANG_ENABLE_TORCH_INFERENCE_MODE) have no version counter: an
    # in-place refill could not be told, so every call writes its plan
    with torch.inference_mode():
        frozen = torch.tensor(long, dtype=torch.int32)
        step([dict(c, cache_seqlens=frozen) for c in layers], [long] * 3)
    try:
        fda.fp8_decode_attention(c["q"], c["k_cache"], c["v_cache"], c["page_table"], lens, c["softmax_scale"],
                                 c["k_descale"], c["v_descale"], plan=stale[:-1])
    except ValueError as e:
        assert "plan must be int32" in str(e), e
    else:
        raise AssertionError("a plan of the wrong size accepted")
    print("dispatcher step plan ok")
    """
)


def test_one_plan_serves_a_steps_layers_and_each_new_step_writes_its_own():
    result = run_under_interpreter(STEP_PLAN_THROUGH_DISPATCHER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dispatcher step plan ok" in result.stdout


def test_the_kernels_own_output_carries_its_codes_to_o_proj():
    result = run_under_interpreter(HANDOVER_THROUGH_DISPATCHER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dispatcher hand-over ok" in result.stdout


def test_a_plain_fp8_decode_call_runs_the_kernel_not_fa3():
    result = run_under_interpreter(KERNEL_THROUGH_DISPATCHER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dispatcher kernel ok" in result.stdout


def _fa3_backend_source() -> ast.Module:
    (root,) = importlib.util.find_spec("sglang").submodule_search_locations
    path = pathlib.Path(root) / "srt" / "layers" / "attention" / "flashattention_backend.py"
    return ast.parse(path.read_text())


def test_fa3_forward_decode_calls_the_module_global_the_hook_replaces():
    """On the installed release: forward_decode calls the bare module-level ``flash_attn_with_kvcache`` (not
    ``self.flash_attn_with_kvcache``, nor a local rebinding), with keywords the dispatcher knows, and the descales."""
    tree = _fa3_backend_source()
    name = "flash_attn_with_kvcache"
    assert any(isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname is None for a in node.names)
               for node in tree.body), "no module-level import of flash_attn_with_kvcache"
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlashAttentionBackend"]
    (decode,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward_decode"]
    nodes = list(ast.walk(decode))
    calls = [n for n in nodes if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name]
    assert calls
    assert not [n for n in nodes if isinstance(n, ast.Name) and n.id == name and not isinstance(n.ctx, ast.Load)]
    assert not [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom)) and name in [a.asname or a.name
                                                                                              for a in n.names]]
    assert not [n for n in nodes if isinstance(n, ast.Attribute) and n.attr == name]
    (main,) = [c for c in calls if "out" in [k.arg for k in c.keywords]]  # the MHA decode call (out=_fa_out)
    explicit = {k.arg for k in main.keywords if k.arg is not None}
    assert explicit <= sel._OPERANDS | set(sel._NEUTRAL), explicit - sel._OPERANDS - set(sel._NEUTRAL)
    assert {"q", "k_cache", "v_cache", "page_table", "cache_seqlens", "max_seqlen_q", "softmax_scale"} <= explicit
    if not {"k_descale", "v_descale"} <= explicit:  # 0.5.17 on: kwargs["k_descale"] = ..., passed as **kwargs
        assert any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == "kwargs" for k in main.keywords)
        stored = {n.slice.value for n in nodes if isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store)
                  and isinstance(n.value, ast.Name) and n.value.id == "kwargs" and isinstance(n.slice, ast.Constant)}
        assert {"k_descale", "v_descale"} <= stored, stored


@pytest.fixture
def fa3_module(monkeypatch):
    """A stand-in for sglang.srt.layers.attention.flashattention_backend (the real one needs CUDA to import): a
    module-global flash_attn_with_kvcache and a class named FlashAttentionBackend defined there."""
    module = types.ModuleType("fp8rl_test_fa3_backend")
    module.flash_attn_with_kvcache = Recorder()
    module.FlashAttentionBackend = type("FlashAttentionBackend", (), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def runner(backend, quantization="fp8_online_blockwise", kv_cache_dtype="fp8_e4m3"):
    args = types.SimpleNamespace(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    return types.SimpleNamespace(server_args=args, attn_backend=backend)


@pytest.mark.parametrize("mode", ["auto", "split_kv"])
def test_install_wraps_the_fa3_function_once(fa3_module, mode):
    set_options(decode_attention=mode)
    original = fa3_module.flash_attn_with_kvcache
    hybrid = type("HybridAttnBackend", (), {})()
    hybrid.decode_backend = fa3_module.FlashAttentionBackend()
    derived = type("FlashAttentionMultiStepBackend", (fa3_module.FlashAttentionBackend,), {})()
    for backend in (fa3_module.FlashAttentionBackend(), hybrid, derived):
        assert install_decode_attention(runner(backend)) == "installed"
        installed = fa3_module.flash_attn_with_kvcache
        assert installed is not original and sel.original_of(installed) is original
    assert installed(**plain(softcap=30.0)) is original.results[-1] and len(original.calls) == 1


@pytest.mark.parametrize("mode, args", [("fa3", {}), ("auto", dict(quantization=None)),
                                        ("split_kv", dict(kv_cache_dtype="auto")),
                                        ("split_kv", dict(kv_cache_dtype="fp8_e5m2"))])
def test_install_leaves_other_servers_untouched(fa3_module, mode, args):
    set_options(decode_attention=mode)
    original = fa3_module.flash_attn_with_kvcache
    assert install_decode_attention(runner(fa3_module.FlashAttentionBackend(), **args)) == "untouched"
    assert fa3_module.flash_attn_with_kvcache is original


@pytest.mark.parametrize("producer_quant, deterministic, hands_over", [("on", False, True), ("off", False, False),
                                                                      ("on", True, False)])
def test_install_hands_the_output_codes_over_with_the_producers(fa3_module, caplog, producer_quant, deterministic,
                                                                 hands_over):
    set_options(decode_attention="auto", producer_quant=producer_quant)
    server = runner(fa3_module.FlashAttentionBackend())
    server.server_args.enable_deterministic_inference = deterministic
    with caplog.at_level(logging.INFO, logger="sglang_fp8rl.hooks.attention"):
        assert install_decode_attention(server) == "installed"
    assert ("its output's 1x128 codes go to o_proj" in caplog.text) == hands_over


def test_install_hands_the_split_kv_forms_to_every_kernel_call(fa3_module, caplog, monkeypatch):
    calls = []
    monkeypatch.setattr(sel, "run_split_kv", lambda kwargs, hand_over=False, plans=None, forms=():
                        calls.append((plans, forms)) or "kernel")
    for forms in (("step_plan", "fused_merge"), ()):
        set_options(decode_attention="auto", split_kv_forms=forms)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sglang_fp8rl.hooks.attention"):
            assert install_decode_attention(runner(fa3_module.FlashAttentionBackend())) == "installed"
        assert f"forms: {', '.join(forms) or 'none'})" in caplog.text
        assert fa3_module.flash_attn_with_kvcache(**plain()) == "kernel"
        plans, passed = calls[-1]
        assert passed == forms and (plans is not None) == ("step_plan" in forms)
    with pytest.raises(ValueError, match=r"--fp8rl-split-kv-forms: unknown form\(s\) \['merge'\]"):
        sel.dispatching(Recorder(), "auto", forms=("merge",))


def test_install_hands_the_batch_limit_to_auto(fa3_module, caplog, monkeypatch):
    """--fp8rl-split-kv-max-batch reaches the dispatcher: a batch four above the default limit goes to the kernel
    under a limit twice the default and to FA3 under the default; the install's log line names the limit."""
    monkeypatch.setattr(sel, "run_split_kv", lambda kwargs, hand_over=False, plans=None, forms=(): "kernel")
    batch = sel.AUTO_MAX_BATCH + 4
    case = paged_case(1, batch, 2, 4, 64, 1, [3] * batch)
    for max_batch, kernel in ((2 * sel.AUTO_MAX_BATCH, "kernel"), (sel.AUTO_MAX_BATCH, None)):
        set_options(decode_attention="auto", split_kv_max_batch=max_batch)
        original = fa3_module.flash_attn_with_kvcache = Recorder()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="sglang_fp8rl.hooks.attention"):
            assert install_decode_attention(runner(fa3_module.FlashAttentionBackend())) == "installed"
        assert f"(auto: batches up to {max_batch} sequences; forms:" in caplog.text
        got = fa3_module.flash_attn_with_kvcache(**fa3_decode_kwargs(case))
        assert got == (kernel or original.results[-1]) and len(original.calls) == (0 if kernel else 1)


def test_the_batch_limit_option():
    assert parse_args([]).split_kv_max_batch == sel.AUTO_MAX_BATCH == Fp8rlOptions().split_kv_max_batch == 32
    assert parse_args(["--fp8rl-split-kv-max-batch", "8"]).split_kv_max_batch == 8
    for bad in (0, -1, 2.5, True, "16"):
        with pytest.raises(ValueError, match="--fp8rl-split-kv-max-batch must be an integer >= 1"):
            Fp8rlOptions(split_kv_max_batch=bad)
    with pytest.raises(ValueError, match="--fp8rl-split-kv-max-batch"):
        parse_args(["--fp8rl-split-kv-max-batch", "0"])
    with pytest.raises(ValueError, match="--fp8rl-split-kv-max-batch"):
        sel.dispatching(Recorder(), "auto", max_batch=0)
    published = set_options(split_kv_max_batch=24)
    assert published.split_kv_max_batch == 24 and get_options() == published


def test_install_on_another_backend(fa3_module):
    triton_backend = type("TritonAttnBackend", (), {})()
    hybrid = type("HybridAttnBackend", (), {})()
    hybrid.decode_backend = triton_backend
    set_options(decode_attention="auto")
    for backend in (triton_backend, hybrid):
        assert install_decode_attention(runner(backend)) == "not fa3"
    set_options(decode_attention="split_kv")
    for backend in (triton_backend, hybrid):
        with pytest.raises(ValueError, match="--fp8rl-decode-attention split_kv: .*TritonAttnBackend"):
            install_decode_attention(runner(backend))


def test_the_split_kv_forms_option():
    from sglang_fp8rl.kernels.split_kv_plan import DEFAULT_FORMS, FORMS

    assert parse_args([]).split_kv_forms == DEFAULT_FORMS == Fp8rlOptions().split_kv_forms
    assert parse_args(["--fp8rl-split-kv-forms", "fused_merge, step_plan,fused_merge"]).split_kv_forms == \
        ("fused_merge", "step_plan")
    assert parse_args(["--fp8rl-split-kv-forms", "none"]).split_kv_forms == ()
    assert set(FORMS) == {"single_plan", "step_plan", "fused_merge"}
    for bad in (("merge",), "step_plan", (1,)):
        with pytest.raises(ValueError, match="--fp8rl-split-kv-forms must name forms of"):
            Fp8rlOptions(split_kv_forms=bad)
    with pytest.raises(ValueError, match="--fp8rl-split-kv-forms"):
        parse_args(["--fp8rl-split-kv-forms", "single_plan,merge"])
    published = set_options(split_kv_forms=["single_plan"])  # JSON carries a list: read back as the tuple
    assert published.split_kv_forms == ("single_plan",) and get_options() == published


def test_the_option():
    assert parse_args(["--fp8rl-decode-attention", "fa3"]).decode_attention == "fa3"
    assert parse_args([]).decode_attention == "auto" == Fp8rlOptions().decode_attention
    with pytest.raises(ValueError, match="--fp8rl-decode-attention must be one of"):
        Fp8rlOptions(decode_attention="x")
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # adds our group to SGLang's own parser
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--fp8rl-decode-attention", "split_kv"])
    assert options_from_namespace(args).decode_attention == "split_kv"
    assert options_from_namespace(parser.parse_args(["--model-path", "m"])).decode_attention == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--fp8rl-decode-attention", "flashinfer"])
