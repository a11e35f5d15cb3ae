"""Triton matrix-vector kernels for the linear layers of one-token decode steps (bf16/fp16 or FP8 E4M3 weights).

At batch 1 a linear layer is bound by the bytes of its weight: the time is the number of round trips to memory
times their latency, unless enough bytes are in flight. So each program owns BLOCK_N output features and a span of
K (SPLIT_K programs share a row of blocks; the last one to finish, found by an atomic counter, adds their fp32
partial sums in a fixed order, so results do not depend on timing), and the loop may be unrolled to issue several
weight tiles' loads at once. The layer's neighbours are folded in where the kernel reads its input or writes its
output, which removes their kernel launches from the step: the RMSNorm before q/k/v and gate/up, SiLU(gate) * up
before down, and the residual add after o and down. Each is rounded as the unfused bf16 ops round it. FP8 weights
carry a scale per output row; their input is quantized per token (dynamic: the row's absolute maximum, after the
fused prologue) or with a calibrated static scale, and the products of E4M3 values are summed in fp32, which is
`Fp8Linear`'s arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    warps: int
    unroll: int = 1


@triton.jit
def _input(x_row, offs, mask, K, r, norm_ptr, NORM: tl.constexpr, SILU: tl.constexpr):
    """The layer's input at `offs` in fp32, rounded to the activations' dtype after each step as the unfused ops do:
    SiLU(gate) * up of a [gate | up] row, or RMSNorm(x) * weight given 1/rms `r`."""
    dtype = x_row.dtype.element_ty
    if SILU:
        g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * u
    else:
        y = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        y = (y * r).to(dtype).to(tl.float32) * tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return y.to(dtype).to(tl.float32)


@triton.jit
def _round_e4m3(v):
    """v (fp32, within +-448) rounded to the nearest E4M3 value, ties to even, as the hardware conversion does. In
    fp32 arithmetic rather than a cast: Triton's CPU interpreter, which runs the tests, mis-rounds casts to fp8."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (v + 24576.0) - 24576.0  # multiples of 2^-9 below 2^-6
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _finish(acc, row, cols, x_scale, out_ptr, w_scale_ptr, bias_ptr, res_ptr, N,
            FP8: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    in_n = cols < N
    if FP8:
        acc = acc * x_scale * tl.load(w_scale_ptr + cols, mask=in_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_n, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        out = (tl.load(res_ptr + row * N + cols, mask=in_n, other=0.0).to(tl.float32) + out.to(tl.float32)).to(
            out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, out, mask=in_n)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, res_ptr, norm_ptr, partial_ptr, lock_ptr,
                 N, eps, K: tl.constexpr, FP8: tl.constexpr, STATIC: tl.constexpr, HAS_BIAS: tl.constexpr,
                 NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, ITERS: tl.constexpr,
                 UNROLL: tl.constexpr):
    pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * (2 * K if SILU else K)
    chunks: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    r = 1.0
    if NORM:  # every program reads the whole row (from L2) for its statistics
        squares = tl.zeros([BLOCK_K], tl.float32)
        for c in range(chunks):
            v = tl.load(x_row + c * BLOCK_K + k, mask=c * BLOCK_K + k < K, other=0.0).to(tl.float32)
            squares += v * v
        r = tl.rsqrt(tl.sum(squares) / K + eps)
    x_scale = 1.0
    if FP8:
        if STATIC:
            x_scale = tl.load(x_scale_ptr)
        else:
            amax = tl.zeros([BLOCK_K], tl.float32)
            for c in range(chunks):
                offs = c * BLOCK_K + k
                amax = tl.maximum(amax, tl.abs(_input(x_row, offs, offs < K, K, r, norm_ptr, NORM, SILU)))
            x_scale = tl.maximum(tl.max(amax) / 448.0, 1e-12)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    first = pid_k * ITERS * BLOCK_K
    acc = tl.zeros([BLOCK_N], tl.float32)
    for i in tl.range(0, ITERS, loop_unroll_factor=UNROLL):
        offs = first + i * BLOCK_K + k
        y = _input(x_row, offs, offs < K, K, r, norm_ptr, NORM, SILU)
        if EVEN:  # N and K are multiples of the blocks: the weight tile needs no mask
            w = tl.load(w_rows + offs[None, :])
        else:
            w = tl.load(w_rows + offs[None, :], mask=(cols[:, None] < N) & (offs[None, :] < K), other=0.0)
        if FP8:
            y = _round_e4m3(tl.clamp(y / x_scale, -448.0, 448.0))
        acc += tl.sum(w.to(tl.float32) * y[None, :], axis=1)
    if SPLIT_K == 1:
        _finish(acc, row, cols, x_scale, out_ptr, w_scale_ptr, bias_ptr, res_ptr, N, FP8, HAS_BIAS, RESIDUAL)
    else:
        partials = partial_ptr + row * SPLIT_K * N + cols
        tl.store(partials + pid_k * N, acc, mask=cols < N)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        lock = lock_ptr + row * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:  # the last of this block's programs
            total = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partials + s * N, mask=cols < N, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock, 0)  # ready for the next call
            _finish(total, row, cols, x_scale, out_ptr, w_scale_ptr, bias_ptr, res_ptr, N, FP8, HAS_BIAS, RESIDUAL)


class _Workspace:
    """fp32 partial sums and zeroed counters for split-K, per device and stream. Buffers are never freed once handed
    out: a CUDA graph keeps the addresses it captured."""

    def __init__(self):
        self.buffers: dict[tuple, list[torch.Tensor]] = {}

    def get(self, device: torch.device, partials: int, locks: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        held = self.buffers.setdefault((device, stream), [])
        if not held or held[-1].numel() < partials or held[-2].numel() < locks:
            held += [torch.zeros(max(locks, 1024), dtype=torch.int32, device=device),
                     torch.empty(max(partials, 1 << 16), dtype=torch.float32, device=device)]
        return held[-2], held[-1]


_WORKSPACE = _Workspace()


def default_config(n: int, k: int, fp8: bool) -> GemvConfig:
    """A config for weight [n, k]; see perf.gemv_sweep for how it was chosen."""
    return GemvConfig(block_n=16, block_k=512 if fp8 else 256, split_k=1, warps=4)


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
         norm: tuple[torch.Tensor, float] | None = None, silu: bool = False, residual: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """residual + f(x) W^T (+ bias) for x [M, K] (M small; [M, 2K] as [gate | up] with `silu`), weight [N, K] in x's
    dtype or E4M3 with `weight_scale` [N, 1]; f = RMSNorm with (weight, eps) `norm`, SiLU(gate) * up with `silu`, or
    nothing. FP8: `input_scale` None quantizes each row with its own scale."""
    (n, k), m = weight.shape, x.shape[0]
    fp8 = weight.dtype == FP8
    if x.shape[1] != (2 * k if silu else k) or (fp8 and weight_scale is None) or (norm is not None and silu):
        raise ValueError(f"gemv: input {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"silu={silu}, norm={norm is not None}")
    c = config or default_config(n, k, fp8)
    chunks = triton.cdiv(k, c.block_k)
    iters = triton.cdiv(chunks, c.split_k)
    split_k = triton.cdiv(chunks, iters)  # no program without work
    blocks = triton.cdiv(n, c.block_n)
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    locks, partials = _WORKSPACE.get(x.device, m * split_k * n, m * blocks) if split_k > 1 else (out, out)
    any_tensor = out
    _gemv_kernel[(blocks, split_k, m)](
        x, weight, out, weight_scale if fp8 else any_tensor, input_scale if input_scale is not None else any_tensor,
        bias if bias is not None else any_tensor, residual.contiguous() if residual is not None else any_tensor,
        norm[0] if norm is not None else any_tensor, partials, locks, n, norm[1] if norm is not None else 0.0,
        K=k, FP8=fp8, STATIC=input_scale is not None, HAS_BIAS=bias is not None, NORM=norm is not None, SILU=silu,
        RESIDUAL=residual is not None, EVEN=n % c.block_n == 0 and k == split_k * iters * c.block_k,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        SPLIT_K=split_k, ITERS=iters, UNROLL=c.unroll, num_warps=c.warps)
    return out
