"""Decode attention that reads the paged KV cache in place (Triton): no gathered copy of each sequence's blocks.

One program takes one sequence, one KV head (with all the query heads that share it: GQA) and one partition of the
context; it walks the block table TOKENS keys at a time with an online softmax (flash-decoding: partitions, so a short
batch with long contexts still spreads over the GPU). With one partition it writes the output itself; with more, it
writes its unnormalised output with its running max and sum, and the last of a sequence's and KV head's programs to
finish (an atomic counter) combines them in partition order, so the result does not depend on timing. (A second
kernel did that before: a launch more a layer, 0.05 ms of the 4.18 ms of kernels of a batch-1 step on the H200.) An
FP8 cache (uint8 bytes) is converted as it is read; the callers fold its scales into the queries and the output
(attention.py). Shapes depend only on the batch and the block-table width, so the kernels sit inside the engine's
CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.llm.gemv import Workspace

TOKENS = 32  # keys per inner step
TARGET_PROGRAMS = 512  # enough programs to fill an H100/H200 (132 SMs) several times over
COUNTERS = Workspace()  # zeroed int32 counters of finished partitions, per (sequence, KV head); each call resets them


@triton.jit(do_not_specialize=["partition", "partitions"])
def _partition_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, acc_ptr, stats_ptr, counters_ptr, out_ptr, scale,
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
    outs = out_ptr + (seq * heads + head)[:, None] * HEAD_DIM + d[None, :]  # [B, heads, head_dim]
    written = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    if partitions == 1:
        tl.store(outs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=written)
    else:
        head_rows = (seq * heads + head) * partitions  # [B, heads, partitions] rows: each head's first
        tl.store(acc_ptr + (head_rows + part)[:, None] * HEAD_PAD + d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(stats_ptr + (head_rows + part) * 2, m, mask=g < GROUP)
        tl.store(stats_ptr + (head_rows + part) * 2 + 1, total, mask=g < GROUP)
        tl.debug_barrier()  # every thread's stores are made before the counter says so
        counter = counters_ptr + seq * tl.num_programs(1) + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel") == partitions - 1:  # the last: combine, in partition order
            m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            total = tl.zeros([GROUP_PAD], tl.float32)
            acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
            for i in range(0, partitions):
                stats = stats_ptr + (head_rows + i) * 2
                m_i = tl.load(stats, mask=g < GROUP, other=float("-inf"), cache_modifier=".cg")
                total_i = tl.load(stats + 1, mask=g < GROUP, other=0.0, cache_modifier=".cg")
                acc_i = tl.load(acc_ptr + (head_rows + i)[:, None] * HEAD_PAD + d[None, :], mask=g[:, None] < GROUP,
                                other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, m_i)
                alpha = tl.where(m > float("-inf"), tl.exp(m - m_new), 0.0)  # empty partitions weigh nothing
                beta = tl.where(m_i > float("-inf"), tl.exp(m_i - m_new), 0.0)
                acc = acc * alpha[:, None] + acc_i * beta[:, None]
                total = total * alpha + total_i * beta
                m = m_new
            tl.atomic_xchg(counter, 0)  # ready for the next call
            tl.store(outs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=written)


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
    counters, _ = COUNTERS.get(q.device, 0, batch * kv_heads)
    out = torch.empty_like(q)
    _partition_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, block_tables, lengths, acc, stats, counters, out, scale or head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_len, parts, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TOKENS=TOKENS, FP8=k_cache.dtype == torch.uint8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out
