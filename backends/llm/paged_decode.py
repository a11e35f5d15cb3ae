"""Decode attention that reads the paged KV cache in place (Triton): no gathered copy of each sequence's blocks.

One program takes one sequence, one KV head (with all the query heads that share it: GQA) and one partition of the
context; it walks the block table TOKENS keys at a time with an online softmax (flash-decoding: partitions, so a short
batch with long contexts still spreads over the GPU). A partition is every P-th chunk of TOKENS keys (P partitions),
not a contiguous span: the count P is fixed by the CUDA graph's widest context, and strided chunks spread a short
context over all of them as evenly as a long one (contiguous spans of a 4096-key graph gave 16 rows of 200-key
contexts one busy program of 4 per sequence and head). Partitions holding no key exit at once. A context longer than
P chunks sums its keys in an order that follows P, so a sequence's tokens can follow the batch its step ran in: with
2048 programs the tiny test models' contexts stay one chunk a partition at every graph batch, so the tests comparing
execution paths token for token hold (512 broke four on an H100, 12-06); 64 rows of 8 KV heads take 4 partitions
(0.66 ms of attention a step on an H100, against 0.62 with the one of 12-05's contiguous spans). With one
partition holding keys the program writes the output itself; with more, each writes its unnormalised output with its
running max and sum, and the last of a sequence's and KV head's programs to finish (an atomic counter) combines them
in partition order, so the result does not depend on timing. (A second kernel did that before: a launch more a layer,
0.05 ms of the 4.18 ms of kernels of a batch-1 step on the H200.) An FP8 cache (uint8 bytes) is converted as it is
read; the callers fold its scales into the queries and the output (attention.py). Shapes depend only on the batch and
the block-table width, so the kernels sit inside the engine's CUDA graphs. Under gemv.PDL_ATTENTION the kernel is
launched with PDL (it waits for the kernels before it first) and lets o_proj's GEMV launch at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from backends.llm import gemv

TOKENS = 32  # keys per inner step
TARGET_PROGRAMS = 2048  # programs at the widest context: an H100/H200 (132 SMs) filled several times over
COUNTERS = gemv.Workspace()  # zeroed int32 counters of finished partitions, per (sequence, KV head); calls reset them


@triton.jit(do_not_specialize=["partitions"])
def _partition_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, acc_ptr, stats_ptr, counters_ptr, out_ptr, scale,
                      stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, partitions,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
                      PARTITIONS_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    seq, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lengths_ptr + seq)
    active = tl.maximum(1, tl.minimum(partitions, tl.cdiv(length, TOKENS)))  # partitions holding keys (1 at least)
    if part < active:
        heads = tl.num_programs(1) * GROUP
        g, d = tl.arange(0, GROUP_PAD), tl.arange(0, HEAD_PAD)
        head = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :],
                    mask=(g[:, None] < GROUP) & (d[None, :] < HEAD_DIM), other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
        for first in range(part * TOKENS, length, partitions * TOKENS):  # every P-th chunk
            tokens = first + tl.arange(0, TOKENS)
            valid = tokens < length
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
        if active == 1:
            tl.store(outs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=written)
        else:
            head_rows = (seq * heads + head) * partitions  # [B, heads, partitions] rows: each head's first
            tl.store(acc_ptr + (head_rows + part)[:, None] * HEAD_PAD + d[None, :], acc, mask=g[:, None] < GROUP)
            tl.store(stats_ptr + (head_rows + part) * 2, m, mask=g < GROUP)
            tl.store(stats_ptr + (head_rows + part) * 2 + 1, total, mask=g < GROUP)
            tl.debug_barrier()  # every thread's stores are made before the counter says so
            counter = counters_ptr + seq * tl.num_programs(1) + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:  # the last: combine, in partition order
                parts = tl.arange(0, PARTITIONS_PAD)
                rows = head_rows[None, :] + parts[:, None]  # [partitions, heads of the group]
                used = (parts[:, None] < active) & (g[None, :] < GROUP)
                maxima = tl.load(stats_ptr + rows * 2, mask=used, other=float("-inf"), cache_modifier=".cg")
                weight = tl.where(used, tl.exp(maxima - tl.max(maxima, axis=0)[None, :]), 0.0)
                total = tl.sum(weight * tl.load(stats_ptr + rows * 2 + 1, mask=used, other=0.0, cache_modifier=".cg"),
                               axis=0)
                acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
                for i in tl.range(0, active, loop_unroll_factor=4):  # (unrolled: the loads overlap)
                    acc += tl.sum(tl.where(parts[:, None] == i, weight, 0.0), axis=0)[:, None] * tl.load(
                        acc_ptr + (head_rows + i)[:, None] * HEAD_PAD + d[None, :], mask=g[:, None] < GROUP, other=0.0,
                        cache_modifier=".cg")
                tl.atomic_xchg(counter, 0)  # ready for the next call
                tl.store(outs, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=written)


def partitions(batch: int, kv_heads: int, max_context: int) -> int:
    """How many partitions (P) each sequence and KV head's keys are dealt over: about TARGET_PROGRAMS programs, at
    most one chunk of TOKENS keys each. Depends only on static shapes (the block-table width), as a CUDA graph needs."""
    return min(triton.cdiv(max_context, TOKENS), max(1, TARGET_PROGRAMS // (batch * kv_heads)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, heads, head_dim] (one query per sequence, the newest token); caches [blocks, block_size, kv_heads,
    head_dim] (uint8 for FP8); block_tables [B, W] int32; lengths [B] keys each query sees. -> [B, heads, head_dim]."""
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    parts = partitions(batch, kv_heads, block_tables.shape[1] * block_size)
    head_pad = triton.next_power_of_2(head_dim)
    q = q.contiguous()
    acc = torch.empty(batch * heads * parts, head_pad, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch * heads * parts, 2, dtype=torch.float32, device=q.device)
    counters, _ = COUNTERS.get(q.device, 0, batch * kv_heads)
    out = torch.empty_like(q)
    pdl = gemv.PDL_ATTENTION and gemv.pdl_runs_on(q.device)
    _partition_kernel[(batch, kv_heads, parts)](
        q, k_cache, v_cache, block_tables, lengths, acc, stats, counters, out, scale or head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        parts, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, TOKENS=TOKENS, FP8=k_cache.dtype == torch.uint8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PARTITIONS_PAD=triton.next_power_of_2(parts),
        PDL=pdl, **gemv.launch(pdl))
    return out
