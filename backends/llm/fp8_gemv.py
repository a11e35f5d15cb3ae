"""A Triton kernel for FP8 linear layers at decode batch sizes (a few rows of activations).

At batch 1 a linear layer is a matrix-vector product bound by the bytes of its weight. cuBLAS' FP8 GEMM
(`torch._scaled_mm`) is built for big tiles and reads FP8 weights far below the memory bandwidth at small M, and the
separate kernels that quantize the activations cost more than the product itself. Here one kernel does it all: each
program owns BLOCK_N output features, finds each row's absolute maximum (dynamic per-token scale) or takes
the static scale, quantizes the activations to E4M3 as it streams them, and multiplies them with its FP8 weights
on the tensor cores (rows padded to 16; the padding costs no memory traffic). The arithmetic is `Fp8Linear`'s:
products of E4M3 operands summed in fp32, then the two scales and the bias. Widening the weights to fp32 in
registers instead was conversion-bound at 1.5-2.2 TB/s (perf/results/h200/2026-12-01-fp8-layers.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
             for n, k, w, s in [(16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 4),
                                (64, 128, 4, 5), (16, 128, 2, 6), (32, 128, 4, 6)]],
    key=["N", "K"],
)
@triton.jit
def _fp8_gemv(x_ptr, w_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, out_ptr, M, N, K, STATIC: tl.constexpr,
              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    in_rows = rows < M
    x_rows = x_ptr + rows[:, None] * K
    if STATIC:
        x_scale = tl.load(x_scale_ptr + rows * 0)
    else:  # each row's absolute maximum (the rows are in L2: every program reads them)
        span = tl.arange(0, 512)
        amax = tl.zeros([BLOCK_M, 512], dtype=tl.float32)
        for start in range(0, K, 512):
            x = tl.load(x_rows + start + span[None, :], mask=in_rows[:, None] & (start + span[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        x_scale = tl.maximum(tl.max(amax, axis=1) / 448.0, 1e-12)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        in_k = start + k < K
        x = tl.load(x_rows + start + k[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0).to(tl.float32)
        xq = tl.clamp(x / x_scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
        w = tl.load(w_rows + start + k[None, :], mask=(cols[:, None] < N) & in_k[None, :], other=0.0)
        acc = tl.dot(xq, tl.trans(w), acc)  # E4M3 x E4M3 on the tensor cores, fp32 accumulation
    out = acc * x_scale[:, None] * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_rows[:, None] & (cols[None, :] < N))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
             bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (M <= 16; any float dtype) times E4M3 weight [N, K] with scales [N, 1] -> [M, N] in x's dtype;
    `input_scale` None quantizes each row with its own scale."""
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _fp8_gemv[grid](x, weight, weight_scale, input_scale if input_scale is not None else weight_scale,
                    bias if bias is not None else weight_scale, out, m, n, k, STATIC=input_scale is not None,
                    HAS_BIAS=bias is not None, BLOCK_M=16)
    return out
