"""A Triton kernel for FP8 linear layers at batch 1 (a matrix-vector product).

At batch 1 a linear layer is bound by the bytes of its weight. cuBLAS' FP8 GEMM (`torch._scaled_mm`) is built for
big tiles and reads FP8 weights well below the memory bandwidth at one row, after a separate kernel quantizes the
activations. Here one kernel does it all: each program owns BLOCK_N output features of one row, finds the row's
absolute maximum (dynamic per-token scale) or takes the static scale, quantizes the activations to E4M3 as it
streams them, and multiplies by the FP8 weights widened to fp32 in registers. The arithmetic is `Fp8Linear`'s:
products of E4M3 operands (exact in fp32) summed in fp32, then the two scales and the bias.

Measured on the H200 (perf/results/h200/2026-12-01-fp8-layers*.md): 1.5-3.1 TB/s of FP8 weights at one row; on
Llama-3-8B's four projections together 1.36x faster than bf16 (94 us against 128 us); with more rows this one-row-per-program form falls behind
cuBLAS, and so did a tensor-core (tl.dot) variant padded to 16 rows, at one row too. Reaching the bandwidth on the
narrow projections (q/k/v, o, down: 25-60 MB each) needs more work per byte in flight (split-K) and is still open.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantized_dot(x_row, w_ptr, cols, x_scale, N, K, first, last, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32: the row's inputs in [first, last), quantized to E4M3 with `x_scale`, times the FP8 weight rows
    `cols` (products exact in fp32, summed in fp32; the scales are applied by the caller)."""
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    for start in range(first, last, BLOCK_K):
        in_k = start + k < last
        x = tl.load(x_row + start + k, mask=in_k, other=0.0).to(tl.float32)
        xq = tl.clamp(x / x_scale, -448.0, 448.0).to(tl.float8e4nv).to(tl.float32)
        w = tl.load(w_rows + start + k[None, :], mask=(cols[:, None] < N) & in_k[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xq[None, :], axis=1)
    return acc


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for n, k, w, s in [(16, 512, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 8, 3), (16, 1024, 8, 3),
                                (8, 1024, 4, 4)]],
    key=["N", "K"],
)
@triton.jit
def _fp8_gemv(x_ptr, w_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, out_ptr, N, K,
              STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)  # fastest-varying: the rows sharing a weight block run together
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * K
    if STATIC:
        x_scale = tl.load(x_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            x = tl.load(x_row + start + k, mask=start + k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        x_scale = tl.maximum(tl.max(amax) / 448.0, 1e-12)
    acc = _quantized_dot(x_row, w_ptr, cols, x_scale, N, K, 0, K, BLOCK_N, BLOCK_K)
    out = acc * x_scale * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (one row or a few; any float dtype) times E4M3 weight [N, K] with scales [N, 1] -> [M, N] in x's dtype;
    `input_scale` None quantizes each row with its own scale."""
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (m, triton.cdiv(n, meta["BLOCK_N"]))  # noqa: E731
    _fp8_gemv[grid](x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
                    bias if bias is not None else weight_scale, out, n, k,
                    STATIC=input_scale is not None, HAS_BIAS=bias is not None)
    return out


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s}, num_warps=w, num_stages=3)
             for n, k, s, w in [(16, 512, 2, 4), (16, 512, 4, 4), (32, 256, 4, 4), (16, 1024, 4, 8), (32, 512, 2, 4),
                                (16, 512, 8, 4), (64, 256, 4, 8)]],
    key=["N", "K"], reset_to_zero=["acc_ptr"],
)
@triton.jit
def _fp8_gemv_split_k(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, acc_ptr, N, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    first = tl.program_id(1) * span
    x_scale = tl.load(x_scale_ptr)
    acc = _quantized_dot(x_ptr, w_ptr, cols, x_scale, N, K, first, tl.minimum(first + span, K), BLOCK_N, BLOCK_K)
    out = acc * x_scale * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    tl.atomic_add(acc_ptr + cols, out, mask=cols < N)


def fp8_gemv_split_k(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     x_scale: torch.Tensor) -> torch.Tensor:
    """Experiment (perf.fp8_layers): one row, its scale given, K split over several programs whose fp32 partial
    sums are added atomically, then cast: more programs in flight on the narrow projections."""
    n, k = weight.shape
    acc = torch.zeros(1, n, dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])  # noqa: E731
    _fp8_gemv_split_k[grid](x.contiguous(), x_scale, weight, weight_scale, acc, n, k)
    return acc.to(x.dtype)
