"""Paged FP8 decode-attention operands as SGLang's FA3 backend passes them, and their float64 reference.

Used by tests/test_fp8_decode_attention.py and tests/test_decode_attention.py, in-process and inside the Triton
interpreter subprocesses (which put tests/ on sys.path). Imports torch only: the kernel is imported by the caller.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
# FP16 rounding of P is the kernel's largest error: at most 2**-11 of each weight, so at most 2**-11 of the largest
# |V * v_descale| a row reads; 1e-3 leaves room for the float32 scores (measured: at most 1.3e-4).
ROW_TOLERANCE = 1e-3
DROP = object()  # fa3_decode_kwargs: leave this keyword out


def paged_case(seed: int, batch: int, kv_heads: int, group: int, dim: int, page: int, lens: list[int],
               amp: float = 2.0, scalar_descale: bool = False) -> dict:
    """FA3 keyword operands of one decode step: E4M3 query and paged cache, pages in a shuffled order.

    Every cache slot no sequence owns (the tail of each last page, a spare page that the page table's padding points
    to) and the query heads of the buffer ``q`` is a slice of hold NaN: a read past a sequence's length or a wrong
    query stride shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q_buf = torch.full((batch, heads + 3, dim), float("nan")).to(E4M3)  # token stride != heads * dim
    q_buf[:, :heads] = (torch.randn(batch, heads, dim, generator=gen) * amp).to(E4M3)
    pages_of = [-(-n // page) for n in lens]
    spare = sum(pages_of)
    k_cache = torch.full((spare + 1, page, kv_heads, dim), float("nan")).to(E4M3)
    v_cache = k_cache.clone()
    page_table = torch.full((batch, max(pages_of) + 1), spare, dtype=torch.int32)
    order = torch.randperm(spare, generator=gen)
    used = 0
    for b, (n, count) in enumerate(zip(lens, pages_of)):
        rows = order[used:used + count]
        used += count
        page_table[b, :count] = rows.to(torch.int32)
        pos = torch.arange(n)
        for cache in (k_cache, v_cache):
            cache[rows[pos // page], pos % page] = (torch.randn(n, kv_heads, dim, generator=gen) * amp).to(E4M3)
    if scalar_descale:  # SGLang's form: layer.k_scale.expand(batch, kv_heads)
        k_descale = (torch.rand(1, generator=gen) * 2 + 0.05).expand(batch, kv_heads)
        v_descale = (torch.rand(1, generator=gen) * 2 + 0.05).expand(batch, kv_heads)
    else:
        k_descale = torch.rand(batch, kv_heads, generator=gen) * 2 + 0.05
        v_descale = torch.rand(batch, kv_heads, generator=gen) * 2 + 0.05
    return dict(q=q_buf[:, :heads], k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32), softmax_scale=dim ** -0.5,
                k_descale=k_descale, v_descale=v_descale)


def fa3_decode_kwargs(case: dict, **change) -> dict:
    """The keywords of SGLang 0.5.17's FA3 ``forward_decode`` plain decode call (flashattention_backend.py) on
    ``case``; ``change`` overrides (a value of ``DROP`` removes the keyword)."""
    batch = case["q"].shape[0]
    kwargs = dict(q=case["q"], k_cache=case["k_cache"], v_cache=case["v_cache"], page_table=case["page_table"],
                  cache_seqlens=case["cache_seqlens"], cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32),
                  max_seqlen_q=1, softmax_scale=case["softmax_scale"], causal=True, window_size=(-1, -1),
                  softcap=0.0, return_softmax_lse=False, num_splits=0, out=None, ver=3,
                  scheduler_metadata=torch.zeros(batch + 1, dtype=torch.int32),
                  k_descale=case["k_descale"], v_descale=case["v_descale"])
    kwargs.update(change)
    return {k: v for k, v in kwargs.items() if v is not DROP}



def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q K^T scale) V in float64 [B, H, D], the largest |V * v_descale| each row reads [B, H, 1])."""
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    batch, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    k_descale = case["k_descale"].expand(batch, kv_heads).double()
    v_descale = case["v_descale"].expand(batch, kv_heads).double()
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    vmax = torch.empty(batch, heads, 1, dtype=torch.float64)
    for b in range(batch):
        pos = torch.arange(int(case["cache_seqlens"][b]))
        rows = case["page_table"][b, pos // page].long()
        k = k_cache[rows, pos % page].double() * k_descale[b, None, :, None]  # [n, kv_heads, D]
        v = v_cache[rows, pos % page].double() * v_descale[b, None, :, None]
        kh = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        vh = v.repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), kh) * case["softmax_scale"], dim=1)
        out[b] = torch.einsum("hn,nhd->hd", p, vh)
        vmax[b] = vh.abs().amax(dim=(0, 2))[:, None]
    return out, vmax
