"""The one-launch FP8 K/V write (kernels/kv_store.py) against SGLang's own write with the saturating division, bit for
bit: the kernel alone, through SGLang's real MHATokenToKVPool, and inside a CUDA graph whose scales change in place."""

from __future__ import annotations

import pytest
import torch

from sglang_fp8rl.kernels import kv_store
from sglang_fp8rl.kv_scales.numerics import saturating_scale_

pytestmark = pytest.mark.gpu

POISON = 0x7F  # E4M3 NaN: a slot the kernel should have written but did not cannot pass


def reference_write(k, v, k_scale, v_scale, k_cache, v_cache, loc):
    """SGLang's path with calibrated scales: divide in place, saturate, cast, scatter (skipping the padding slot)."""
    keep = loc != kv_store.RESERVED_SLOT
    k_cache[loc[keep].long()] = saturating_scale_(k[keep], k_scale).to(torch.float8_e4m3fn).view(k_cache.dtype)
    v_cache[loc[keep].long()] = saturating_scale_(v[keep], v_scale).to(torch.float8_e4m3fn).view(v_cache.dtype)


def qkv_views(tokens, kv_heads, dim, q_heads, gen):
    """K and V as views of one fused QKV output (token stride > row), values across E4M3's range and past it."""
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, device="cuda", generator=gen)
    qkv *= torch.exp2(torch.randint(-12, 12, qkv.shape, device="cuda", generator=gen).float())
    qkv = qkv.to(torch.bfloat16)
    k = qkv[:, q_heads * dim:(q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    return k, v


@pytest.mark.parametrize("kv_heads,dim,q_heads,tokens", [(8, 128, 32, 64), (1, 64, 2, 1), (4, 128, 4, 517)])
@pytest.mark.parametrize("loc_dtype", [torch.int64, torch.int32])
def test_fused_write_equals_sglang_write_bit_for_bit(kv_heads, dim, q_heads, tokens, loc_dtype):
    gen = torch.Generator(device="cuda").manual_seed(tokens * 31 + kv_heads)
    k, v = qkv_views(tokens, kv_heads, dim, q_heads, gen)
    k[0, 0, 0] = float("nan")  # a broken model's NaN stays NaN, as on SGLang's path
    slots = 2 * tokens + 3
    loc = torch.randperm(slots, device="cuda", generator=gen)[:tokens].to(loc_dtype)
    if tokens > 1:
        loc[tokens // 2] = kv_store.RESERVED_SLOT  # a padded token of a captured batch: neither path writes it
    for k_scale, v_scale in ((2.0**-3, 2.0**4), (1.0, 2.0**-10), (2.0**9, 0.5)):
        ks, vs = (torch.tensor(s, dtype=torch.float32, device="cuda") for s in (k_scale, v_scale))
        caches = [torch.full((slots, kv_heads, dim), POISON, dtype=torch.uint8, device="cuda") for _ in range(4)]
        k_before, v_before = k.clone(), v.clone()
        assert kv_store.cannot_store(k, v, ks, vs, caches[0], caches[1], loc) is None
        kv_store.store_scaled_fp8(k, v, ks, vs, caches[0], caches[1], loc)
        reference_write(k, v, ks, vs, caches[2], caches[3], loc)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), (k_scale, v_scale)
        assert torch.equal(k.view(torch.int16), k_before.view(torch.int16))  # K and V are left unchanged
        assert torch.equal(v.view(torch.int16), v_before.view(torch.int16))
        saturated = caches[0].view(torch.float8_e4m3fn).float()
        assert saturated[~saturated.isnan()].abs().max() <= 448


def test_cannot_store_names_the_reason():
    k = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(16, 8, 128, dtype=torch.uint8, device="cuda")
    loc, scale = torch.arange(4, device="cuda"), torch.ones((), device="cuda")
    assert kv_store.cannot_store(k, k, scale, scale, cache, cache, loc) is None
    assert "BF16" in kv_store.cannot_store(k.half(), k, scale, scale, cache, cache, loc)
    assert "slot per token" in kv_store.cannot_store(k, k, scale, scale, cache, cache, loc[:3])
    assert "float32" in kv_store.cannot_store(k, k, 1.0, scale, cache, cache, loc)
    assert "CUDA" in kv_store.cannot_store(k, k, scale, scale, cache.cpu(), cache, loc)
    assert "contiguously" in kv_store.cannot_store(k, k, scale, scale, cache[:, :4], cache, loc)


def sglang_pool_and_layer(kv_heads, dim, slots):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=slots, page_size=1, dtype=torch.float8_e4m3fn, head_num=kv_heads, head_dim=dim,
                            layer_num=1, device="cuda", enable_memory_saver=False)
    layer = RadixAttention(num_heads=kv_heads, head_dim=dim, scaling=1.0, num_kv_heads=kv_heads, layer_id=0)
    return MHATokenToKVPool, pool, layer


def test_sglang_pool_write_takes_the_kernel_in_a_cuda_graph_and_follows_new_scales(monkeypatch):
    """Through SGLang's real pool on CUDA: the wrapped set_kv_buffer takes the kernel (pow2 policy), writes what
    SGLang's own path writes (fp32 policy: the reference division), and a captured graph reads scales written in
    place afterwards."""
    from sglang_fp8rl.engine import OWNERS
    from sglang_fp8rl.hooks import kv_cache
    from sglang_fp8rl.kv_scales import engine
    from sglang_fp8rl.kv_scales.numerics import ScalePolicy

    kv_heads, dim, tokens, slots = 8, 128, 64, 256
    pool_cls, pool, layer = sglang_pool_and_layer(kv_heads, dim, slots)
    write = kv_cache.wrap_set_kv_buffer(pool_cls.set_kv_buffer)
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, v = qkv_views(tokens, kv_heads, dim, 32, gen)
    loc = torch.randperm(slots, device="cuda", generator=gen)[:tokens] + 1  # the pool has slots + 1 rows
    loc[3] = kv_store.RESERVED_SLOT  # the padding slot, skipped by SGLang's store and by the kernel
    ks, vs = torch.tensor(2.0**-2, device="cuda"), torch.tensor(2.0**3, device="cuda")

    fp32 = ScalePolicy(scale_format="fp32")
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", policy=fp32, fused_write=True))
    assert "pow2" in kv_cache.fused_write_reason(pool, 0, k, v, ks, vs, loc, {})
    pool.k_buffer[0].fill_(POISON)
    pool.v_buffer[0].fill_(POISON)
    write(pool, layer, loc, k.clone(), v.clone(), ks, vs)
    expected_k, expected_v = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()

    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate"))
    assert "sglang" in kv_cache.fused_write_reason(pool, 0, k, v, ks, vs, loc, {})  # the default write
    monkeypatch.setattr(OWNERS, "kv_scales", engine.KVScaleState(mode="calibrate", fused_write=True))
    assert kv_cache.fused_write_reason(pool, 0, k, v, ks, vs, loc, {}) is None
    pool.k_buffer[0].fill_(POISON)
    pool.v_buffer[0].fill_(POISON)
    write(pool, layer, loc, k, v, ks, vs)
    assert torch.equal(pool.k_buffer[0], expected_k) and torch.equal(pool.v_buffer[0], expected_v)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write(pool, layer, loc, k, v, ks, vs)
    ks.fill_(2.0**-5)  # a recalibration writes the scale tensors in place
    vs.fill_(2.0**5)
    graph.replay()
    torch.cuda.synchronize()
    reference = [expected_k.clone(), expected_v.clone()]
    reference_write(k, v, ks, vs, reference[0], reference[1], loc)
    assert torch.equal(pool.k_buffer[0], reference[0]) and torch.equal(pool.v_buffer[0], reference[1])
    assert not torch.equal(reference[0], expected_k)  # the new scale changed what is stored
