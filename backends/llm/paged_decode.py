"""Decode attention that reads the paged KV cache in place (Triton): no gathered copy of each sequence's blocks.

One program takes one sequence, one KV head (with all the query heads that share it: GQA) and one partition of the
context; it walks the block table TOKENS keys at a time with an online softmax and writes its unnormalised output
with its running max and sum. A second kernel combines a sequence's partitions (flash-decoding), so a short batch
with long contexts still spreads over the GPU. An FP8 cache (uint8 bytes) is converted as it is read; the callers
fold its scales into the queries and the output (attention.py). Shapes depend only on the batch and the block-table
width, so the kernels sit inside the engine's CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TOKENS = 32  # keys per inner step
TARGET_PROGRAMS = 512  # enough programs to fill an H100/H200 (132 SMs) several times over


@triton.jit(do_not_specialize=["partition", "partitions"])
def _partition_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, acc_ptr, stats_ptr, scale,
                      stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, partition, partitions,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr):
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = tl.num_programs(1) * GROUP
    g, d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_PAD)
    head = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
                mask=(g[:, None] < GROUP) & (d[None, :] < HEAD_DIM), other=0.0)
    length = tl.load(lengths_ptr + seq)
    start = part * partition
    end = tl.minimum(start + partition, length)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for first in range(start, end, TOKENS):
        tokens = first + tl.arange(0, TOKENS)
        valid = tokens < end
        block = tl.load(tables_ptr + seq * stride_tb + tokens // BLOCK_SIZE, mask=valid, other=0)
        rows = block.to(tl.int64) * stride_kb + (tokens % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=mask, other=0)
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=mask, other=0)
        if FP8:
            k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
            v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, TOKENS], fp32
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = (seq * heads + head) * partitions + part  # [B, heads, partitions] rows
    tl.store(acc_ptr + out[:, None] * HEAD_PAD + d[None, :], acc, mask=g[:, None] < GROUP)
    tl.store(stats_ptr + out * 2, m, mask=g < GROUP)
    tl.store(stats_ptr + out * 2 + 1, total, mask=g < GROUP)


@triton.jit(do_not_specialize=["partitions"])
def _combine_kernel(acc_ptr, stats_ptr, out_ptr, partitions, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                    PARTITIONS_PAD: tl.constexpr):
    row = tl.program_id(0)  # seq * heads + head
    p, d = tl.arange(0, PARTITIONS_PAD), tl.arange(0, HEAD_PAD)
    used = p < partitions
    m = tl.load(stats_ptr + (row * partitions + p) * 2, mask=used, other=float("-inf"))
    total = tl.load(stats_ptr + (row * partitions + p) * 2 + 1, mask=used, other=0.0)
    weight = tl.where(m > float("-inf"), tl.exp(m - tl.max(m, axis=0)), 0.0)  # empty partitions weigh nothing
    acc = tl.load(acc_ptr + (row * partitions + p)[:, None] * HEAD_PAD + d[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(total * weight, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def partitions(batch: int, kv_heads: int, max_context: int) -> tuple[int, int]:
    """(partition length, count): as few partitions as keep about TARGET_PROGRAMS programs busy, each a multiple of
    TOKENS keys. Depends only on static shapes (the block-table width), as a CUDA graph needs."""
    wanted = max(1, TARGET_PROGRAMS // (batch * kv_heads))
    length = TOKENS * max(1, triton.cdiv(triton.cdiv(max_context, wanted), TOKENS))
    return length, triton.cdiv(max_context, length)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, heads, head_dim] (one query per sequence, the newest token); caches [blocks, block_size, kv_heads,
    head_dim] (uint8 for FP8); block_tables [B, W] int32; lengths [B] keys each query sees. -> [B, heads, head_dim]."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    part_len, parts = partitions(batch, kv_heads, block_tables.shape[1] * block_size)
    head_pad = triton.next_power_of_2(head_dim)
    q = q.contiguous()
    acc = torch.empty(batch * heads * parts, head_pad, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch * heads * parts, 2, dtype=torch.float32, device=q.device)
    _partition_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, block_tables, lengths, acc, stats, scale or head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_len, parts, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TOKENS=TOKENS, FP8=k_cache.dtype == torch.uint8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    out = torch.empty_like(q)
    _combine_kernel[(batch * heads,)](acc, stats, out, parts, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                                      PARTITIONS_PAD=triton.next_power_of_2(parts))
    return out
