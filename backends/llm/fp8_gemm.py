"""Triton GEMM for FP8 weights with inputs in bf16/fp16 ("W8A16"), for steps of a few to a few hundred rows.

Weights-only FP8 halves the bytes a decode step reads; cuBLAS has no GEMM for E4M3 weights and 16-bit inputs, and
converting each weight to bf16 before `F.linear` moves 2.5x the bytes of a bf16 model (measured on the H200: 64
streams at a quarter of bf16's throughput). Here each program reads its [BLOCK_N, BLOCK_K] weight tiles once as E4M3,
widens them in registers (exact: every E4M3 value is a bf16/fp16 value) and multiplies them on the tensor cores with
the rows' [BLOCK_M, BLOCK_K] input tiles, accumulating in fp32; the per-channel scale and the bias apply once, to
the fp32 sum, and the output is rounded once. SPLIT_K > 1 cuts K among programs when N alone gives too few of them
to keep the GPU's memory busy; the last of a tile's programs to finish (an atomic counter) adds their fp32 partial
sums in a fixed order and finishes the tile, so results do not depend on timing and no kernel runs after.
perf.fp8_gemm_sweep measured the configurations: against bf16 cuBLAS on the same layers this is 1.1-1.3x faster up to
16 rows and slower above (0.6-0.8x at 64, 0.3-0.6x at 128), but 3-5x faster than widening every weight for cuBLAS.

`swap` computes the transposed product, out^T = W x^T: the widened weight tile becomes the MMA's first operand, which
Hopper's wgmma can take from registers (where the widening leaves it), the input rows the second, read from shared
memory as they are; the rows are then the MMA's N (8 to 256), the weight's columns its M (64 a warp group). This is
how mixed-input GEMMs for few rows are built on Hopper ("swap AB"). Compiled for sm_90 (`python -m perf.kernel_asm`,
any machine), Triton 3.6 does so: swapped, the product is a wgmma with the weight tile in registers; unswapped, the
widened tile is stored to shared memory first, and with fewer than 64 rows a block it runs on mma.sync (Ampere's
instruction) instead of wgmma. perf.fp8_gemm_sweep timed it on the H200 (2026-12-05): within a few percent of the
unswapped configurations, at best, so no default configuration swaps.

The inputs may be E4M3 too, with a scale per row (W8A8, x quantized per token as fp8.quantize_tokens does): nothing
is widened then, the product is a wgmma on E4M3 operands (kernel_asm; swapped from 16 rows on, unswapped from 64),
and both scales apply to the fp32 sum. perf.fp8_gemm_sweep times it beside cuBLAS' `torch._scaled_mm`, which was
faster from 32 rows on (2026-12-05), so the engine's W8A8 steps run that.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from backends.llm.gemv import WORKSPACE  # split-K's partial sums and counters

FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the engine's GPU dtypes; fp32 for exact tests


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    warps: int = 4
    stages: int = 4
    swap: bool = False  # out^T = W x^T: the widened weight tile is the MMA's first operand (see the module's doc)


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # exact fp32 products, not TF32 (fp32 inputs; bf16 ones under the interpreter, see _widens)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _fp8_weight_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, x_scale_ptr, partial_ptr, lock_ptr,
                            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr, ITERS,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            STAGES: tl.constexpr, SWAP: tl.constexpr, X_SCALED: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # row blocks side by side: one
    # weight tile is read from memory once for all of them (L2 serves the others)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * ITERS * BLOCK_K + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * K + k[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for i in tl.range(0, ITERS, num_stages=STAGES):
        in_k = k[None, :] < K - i * BLOCK_K
        x = tl.load(x_tile, mask=(rows[:, None] < M) & in_k, other=0.0)
        w = tl.load(w_tile, mask=(cols[:, None] < N) & in_k, other=0.0)
        w = w.to(x.dtype)  # (E4M3 inputs: nothing to widen, the product runs in FP8)
        if SWAP:
            acc = _mma(w, tl.trans(x), acc, IEEE)
        else:
            acc = _mma(x, tl.trans(w), acc, IEEE)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K > 1:  # fp32 partial sums [SPLIT_K, M, N]; the last of the tile's programs adds them, in order
        partials = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(partials + pid_k * M * N, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        lock = lock_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(partials + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock, 0)  # ready for the next call
            _finish(acc, rows, cols, out_mask, scale_ptr, x_scale_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS, X_SCALED)
    else:
        _finish(acc, rows, cols, out_mask, scale_ptr, x_scale_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS, X_SCALED)


@triton.jit
def _finish(acc, rows, cols, out_mask, scale_ptr, x_scale_ptr, bias_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr,
            X_SCALED: tl.constexpr):
    """The fp32 sum times the weights' (and the rows') scales, plus the bias, rounded once to the output's dtype."""
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if X_SCALED:
        acc = acc * tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _widens(dtype: torch.dtype) -> bool:
    """Whether the products run in fp32: for fp32 inputs, and for bf16 and E4M3 ones in Triton's CPU interpreter,
    whose bf16 dot returns garbage (products of bf16 or E4M3 values are exact in fp32, as on the tensor cores)."""
    return dtype == torch.float32 or (dtype in (torch.bfloat16, FP8) and os.environ.get("TRITON_INTERPRET") == "1")


SWAP_FROM_ROWS: int | None = None  # default configurations swap at this many rows and more (None: never; measured on
# the H200 it was not faster, 2026-12-05; perf.llm_engine's `swap` variants set it)


def default_config(m: int, n: int, k: int) -> GemmConfig:
    c = _unswapped_config(m, n, k)
    return swapped(c) if SWAP_FROM_ROWS is not None and m >= SWAP_FROM_ROWS else c


def _unswapped_config(m: int, n: int, k: int) -> GemmConfig:
    """Blocks for x [m, k] times weight [n, k], from perf.fp8_gemm_sweep on the H200 (Llama-3-8B's projections,
    2026-12-05, perf/results/h200/2026-12-05-fp8-gemm-sweep*): up to 16 rows narrow column blocks and long K tiles;
    above, row blocks of 32, 64 or 128, and K split until there are about 384 programs (at most 8 spans). Summed
    over the four projections that took 136 / 157 / 246 us at 32 / 64 / 128 rows where the fixed blocks before it
    took 148 / 186 / 341 (the best configuration of each projection: 130 / 155 / 196)."""
    if m <= 16:
        return GemmConfig(16, 32, 256, 1, warps=4, stages=4)
    if m <= 32:
        c = GemmConfig(32, 64, 128, 1, warps=4, stages=3)
    elif m <= 64:
        c = GemmConfig(64, 64, 64, 1, warps=4, stages=4)
    elif n * k >= 48 << 20:  # long weights (gate_up, down) in wider column blocks
        c = GemmConfig(128, 128, 64, 1, warps=8, stages=3)
    else:
        c = GemmConfig(128, 64, 64, 1, warps=4, stages=3)
    blocks, split_k = triton.cdiv(n, c.block_n), 1
    while blocks * split_k < 384 and split_k < 8 and triton.cdiv(k, c.block_k) >= 4 * split_k:
        split_k *= 2
    return dataclasses.replace(c, split_k=split_k)


def swapped(c: GemmConfig) -> GemmConfig:
    """`c` computing the transposed product, its column block at least 64 per warp group (wgmma's M)."""
    return dataclasses.replace(c, block_n=max(c.block_n, 16 * c.warps), swap=True)


def fp8_weight_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, config: GemmConfig | None = None,
                      x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(x W^T) * weight_scale (+ bias) in x's dtype, for x [M, K] (bf16, fp16 or fp32) and weight [N, K] in E4M3 with
    per-channel scales [N, 1] (a per-tensor scale repeated). x may be E4M3 too, with per-row scales `x_scale` [M, 1]
    (W8A8): the product then runs on FP8 tensor cores, times both scales, in `out_dtype`."""
    (n, k), m = weight.shape, x.shape[0]
    quantized = x.dtype == FP8 and x_scale is not None and x_scale.numel() == m and out_dtype in DTYPES
    if weight.dtype != FP8 or x.shape[-1] != k or not (x.dtype in DTYPES or quantized) or \
            weight_scale.numel() != n:
        raise ValueError(f"fp8_weight_matmul: input {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, scale {tuple(weight_scale.shape)}, input scale "
                         f"{None if x_scale is None else tuple(x_scale.shape)}, output {out_dtype}")
    out_dtype = out_dtype if quantized else x.dtype
    c = config or default_config(m, n, k)
    iters = triton.cdiv(triton.cdiv(k, c.block_k), c.split_k)
    split_k = triton.cdiv(triton.cdiv(k, c.block_k), iters)  # no program without work
    x = x.contiguous()
    scale = weight_scale.reshape(n).float().contiguous()  # the kernel reads them densely, not through strides
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rows_scale = x_scale.reshape(m).float().contiguous() if quantized else scale  # a per-tensor scale expanded too
    grid = (triton.cdiv(m, c.block_m), triton.cdiv(n, c.block_n), split_k)
    locks, partials = WORKSPACE.get(x.device, split_k * m * n, grid[0] * grid[1]) if split_k > 1 else (out, out)
    _fp8_weight_gemm_kernel[grid](x, weight, scale, bias if bias is not None else scale, out, m, n, k, rows_scale,
                                  partials, locks, HAS_BIAS=bias is not None, IEEE=_widens(x.dtype), SPLIT_K=split_k,
                                  ITERS=iters, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                                  STAGES=c.stages, SWAP=c.swap, X_SCALED=quantized, num_warps=c.warps)
    return out
