"""One Triton kernel for what comes between a layer's q/k/v projection and its paged attention: the rotary embedding
of q and k (half-split, as Hugging Face's rotate_half), and the rotated k and the v written to their cache slots.
Unfused that is four kernels a layer (two compiled rotations, two index copies into the cache), each a launch and a
round trip through memory for a few kilobytes: on the H200 0.23 ms of a 4.4 ms batch-1 Llama-3-8B step
(perf/results/h200/2026-12-05-llm-engine-overlap.md). Each program rotates one head of one token in fp32 and rounds
once, as the compiled rotation does. Under gemv.PDL_ATTENTION it is launched with PDL (it waits for the q/k/v
projection before reading) and lets the attention kernel after it launch at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from backends.llm import gemv


@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr, stride_t,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t, h = tl.program_id(0), tl.program_id(1)  # token, head: q heads first, then k heads (each with its v head)
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + t * stride_t + h * HEAD_DIM
    x = tl.load(row + d).to(tl.float32)
    partner = tl.load(row + (d + HEAD_DIM // 2) % HEAD_DIM).to(tl.float32)
    rotated = tl.where(d < HEAD_DIM // 2, -partner, partner)
    cos = tl.load(cos_ptr + t * HEAD_DIM + d).to(tl.float32)
    sin = tl.load(sin_ptr + t * HEAD_DIM + d).to(tl.float32)
    out = x * cos + rotated * sin
    if h < HEADS:
        tl.store(q_ptr + (t * HEADS + h) * HEAD_DIM + d, out.to(q_ptr.dtype.element_ty))
    else:
        at = (tl.load(slots_ptr + t).to(tl.int64) * KV_HEADS + h - HEADS) * HEAD_DIM + d
        tl.store(k_cache_ptr + at, out.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + at, tl.load(row + KV_HEADS * HEAD_DIM + d))  # its v: KV_HEADS heads further on


def fits(head_dim: int, kv: tuple[torch.Tensor, torch.Tensor], qkv: torch.Tensor) -> bool:
    """Whether the kernel takes these: a power-of-two head size, contiguous caches of the activations' dtype (FP8
    caches, with their scales, keep the unfused path)."""
    return head_dim & (head_dim - 1) == 0 and all(c.dtype == qkv.dtype and c.is_contiguous() for c in kv) \
        and qkv.stride(1) == 1


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
               slots: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """q rotated, [T, heads, head_dim], from qkv [T, (heads + 2 kv_heads) * head_dim] and the tokens' cos / sin
    [T, head_dim]; k rotated and v written to `kv` (caches [blocks, block_size, kv_heads, head_dim]) at `slots`."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    pdl = gemv.PDL_ATTENTION and gemv.pdl_runs_on(qkv.device)
    _rope_write_kernel[(tokens, heads + kv_heads)](qkv, cos.contiguous(), sin.contiguous(), slots, q, kv[0], kv[1],
                                                   qkv.stride(0), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                                                   PDL=pdl, **gemv.launch(pdl))
    return q
