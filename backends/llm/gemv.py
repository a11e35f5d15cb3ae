"""Triton matrix-vector kernels for the linear layers of one-token decode steps (bf16/fp16 or FP8 E4M3 weights).

At batch 1 a linear layer is bound by the bytes of its weight, and its time is the number of round trips to memory
times their latency unless enough bytes are in flight. So each program of `_gemv_kernel` owns a few output features
and a long span of K, read in wide tiles (perf.gemv_sweep measured the block sizes; small BLOCK_N, BLOCK_K of 1-2K);
SPLIT_K > 1 lets several programs share a row of blocks, the last to finish (an atomic counter) adding their fp32
partial sums in a fixed order, so results do not depend on timing. What comes after the layer happens as the
output is written: the residual add, or (`gated`, for gate/up) SiLU(gate) * up, each program owning the same features
of both halves, so down_proj takes its input as it is. What comes before runs once per row in `_prepare_kernel`, not
in every program (the sweep measured that: recomputed by each program it cost up to 17 us on down_proj): the RMSNorm
before q/k/v and gate/up, rounded as the unfused bf16 ops round it, and for FP8 weights with FP8 inputs the input's
E4M3 quantization (per token, or with a calibrated static scale). Its output holds the E4M3 values in the
activations' dtype (exact in bf16 and fp16), and the products are summed in fp32: `Fp8Linear`'s arithmetic.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP8 = torch.float8_e4m3fn
MAX_K = 32768  # the longest input row `prepare` takes (one program holds it in registers)
PDL_UNPREPARED = False  # PDL for GEMVs with no prepare kernel before them too (o_proj, down_proj); perf.llm_engine
# rotary + cache write (rope_cache.py) and paged decode attention (paged_decode.py) launched with PDL, each letting the
# next launch early, and o_proj's GEMV after them (`early`): its first weight tile read while attention runs. Off until
# measured on a GPU (perf.llm_engine's "pdlattn" variant)
PDL_ATTENTION = False


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows a program reads (gated: half of them gate rows, half up rows)
    block_k: int
    split_k: int
    warps: int
    unroll: int = 1
    pdl: bool = True  # programmatic dependent launch after a prepare kernel, where the GPU has it (see pdl_runs_on)


@triton.jit
def _round_e4m3(v):
    """v (fp32, within +-448) rounded to the nearest E4M3 value, ties to even, as the hardware conversion does. In
    fp32 arithmetic rather than a cast: Triton's CPU interpreter, which runs the tests, mis-rounds casts to fp8."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
    subnormal = (v + 24576.0) - 24576.0  # multiples of 2^-9 below 2^-6
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def _scaled(acc, cols, x_scale, w_scale_ptr, bias_ptr, N, FP8: tl.constexpr, HAS_BIAS: tl.constexpr):
    if FP8:
        acc = acc * x_scale * tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _finish(acc, up, row, cols, x_scale, out_ptr, w_scale_ptr, bias_ptr, res_ptr, N, FP8: tl.constexpr,
            HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr):
    """The output features `cols` of `row`, rounded to the output's dtype; GATED: SiLU(gate) * up, where `up` sums
    the weight rows N further on, each rounded as the unfused linear layer and SiLU * up round them."""
    dtype = out_ptr.dtype.element_ty
    out = _scaled(acc, cols, x_scale, w_scale_ptr, bias_ptr, N, FP8, HAS_BIAS).to(dtype)
    if GATED:
        gate = out.to(tl.float32)
        up = _scaled(up, cols, x_scale, w_scale_ptr + N, bias_ptr + N, N, FP8, HAS_BIAS).to(dtype).to(tl.float32)
        out = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)
    if RESIDUAL:
        out = (tl.load(res_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32) + out.to(tl.float32)).to(
            dtype)
    tl.store(out_ptr + row * N + cols, out, mask=cols < N)


@triton.jit
def _prepare_kernel(x_ptr, out_ptr, scale_ptr, norm_ptr, eps, K: tl.constexpr, NORM: tl.constexpr,
                    QUANTIZE: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per row, the whole row in registers (BLOCK >= K), read and written once: out = x or RMSNorm(x) *
    weight, rounded to the activations' dtype after each step as the unfused ops do; with QUANTIZE, out / scale
    rounded to E4M3 and the scale (the row's absolute maximum / 448, or the static one) in scale_ptr[row]. (A loop
    over K tiles made the row's loads wait on each other: 7.8 us for a row of 14336 on the H200.)"""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the GEMV after this starts reading its weights
    row = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    y = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(y * y) / K + eps)
        y = (y * r).to(dtype).to(tl.float32) * tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = y.to(dtype).to(tl.float32)
    if QUANTIZE:
        if STATIC:
            scale = tl.load(scale_ptr)
        else:
            scale = tl.maximum(tl.max(tl.abs(y)) / 448.0, 1e-12)
            tl.store(scale_ptr + row, scale)
        y = _round_e4m3(tl.clamp(y / scale, -448.0, 448.0))
    tl.store(out_ptr + row * K + offs, y.to(dtype), mask=mask)


@triton.jit
def _load_weights(w_rows, offs, cols, N, K: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:  # N and K are multiples of the blocks: no masks
        return tl.load(w_rows + offs[None, :])
    return tl.load(w_rows + offs[None, :], mask=(cols[:, None] < N) & (offs[None, :] < K), other=0.0)


@triton.jit
def _input(x_row, offs, K: tl.constexpr, EVEN: tl.constexpr):
    return (tl.load(x_row + offs) if EVEN else tl.load(x_row + offs, mask=offs < K, other=0.0)).to(tl.float32)


@triton.jit
def _dot(w, x):
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, w_scale_ptr, x_scale_ptr, bias_ptr, res_ptr, partial_ptr, lock_ptr, N,
                 K: tl.constexpr, FP8: tl.constexpr, QUANTIZED: tl.constexpr, STATIC: tl.constexpr,
                 HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, ITERS: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_k, row = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * K
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    up_rows = w_ptr + (cols[:, None] + N).to(tl.int64) * K  # GATED: [gate | up] weights, the up half's rows
    first = pid_k * ITERS * BLOCK_K
    acc = tl.zeros([BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_N], tl.float32)
    if PDL:  # started while the kernel before may still run: read the first weight tile now (no kernel writes it),
        w = _load_weights(w_rows, first + k, cols, N, K, EVEN)
        if GATED:
            w_up = _load_weights(up_rows, first + k, cols, N, K, EVEN)
        gdc_wait()  # the input, the residual and every write only once that kernel is done
        gdc_launch_dependents()
        x = _input(x_row, first + k, K, EVEN)
        acc += _dot(w, x)
        if GATED:
            up += _dot(w_up, x)
    for i in tl.range(1 if PDL else 0, ITERS, loop_unroll_factor=UNROLL):
        offs = first + i * BLOCK_K + k
        # the weights asked for before the input: the input's trip through shared memory (a barrier) would otherwise
        # come first, and the weight loads wait behind it (sm_90 code read with nvdisasm)
        w = _load_weights(w_rows, offs, cols, N, K, EVEN)
        if GATED:
            w_up = _load_weights(up_rows, offs, cols, N, K, EVEN)
        x = _input(x_row, offs, K, EVEN)
        acc += _dot(w, x)
        if GATED:
            up += _dot(w_up, x)
    x_scale = 1.0  # unquantized inputs: bf16 weights, or FP8 weights only
    if QUANTIZED:
        x_scale = tl.load(x_scale_ptr) if STATIC else tl.load(x_scale_ptr + row)
    if SPLIT_K == 1:
        _finish(acc, up, row, cols, x_scale, out_ptr, w_scale_ptr, bias_ptr, res_ptr, N, FP8, HAS_BIAS, RESIDUAL,
                GATED)
    else:
        partials = partial_ptr + row * SPLIT_K * N + cols
        up_partials = partials + tl.num_programs(2) * SPLIT_K * N  # GATED: the up half's, after every row's gate
        tl.store(partials + pid_k * N, acc, mask=cols < N)
        if GATED:
            tl.store(up_partials + pid_k * N, up, mask=cols < N)
        tl.debug_barrier()  # every thread's partial is written before the counter says so
        lock = lock_ptr + row * tl.num_programs(0) + pid_n
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:  # the last of this block's programs
            total = tl.zeros([BLOCK_N], tl.float32)
            up_total = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(partials + s * N, mask=cols < N, other=0.0, cache_modifier=".cg")
                if GATED:
                    up_total += tl.load(up_partials + s * N, mask=cols < N, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock, 0)  # ready for the next call
            _finish(total, up_total, row, cols, x_scale, out_ptr, w_scale_ptr, bias_ptr, res_ptr, N, FP8, HAS_BIAS,
                    RESIDUAL, GATED)


class Workspace:
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


WORKSPACE = Workspace()


def launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}  # (only asked for on GPUs: Triton's interpreter has no such option)


def default_config(n: int, k: int, fp8: bool) -> GemvConfig:
    """A config for weight [n, k] from perf.gemv_sweep on the H200 (Llama-3-8B's projections, 2026-12-02): K tiles
    of 2048, no split-K, the loop unrolled twice where the tile count is even; four output features per program for
    FP8 weights and long bf16 rows, two for the other bf16 ones. Within 3% of the best configuration swept for each
    projection (perf/results/h200/2026-12-02-gemv-sweep-configs.csv)."""
    block_k = min(2048, triton.next_power_of_2(k))
    unroll = 2 if triton.cdiv(k, block_k) % 2 == 0 else 1
    if fp8 or k > 8192:
        return GemvConfig(block_n=4, block_k=block_k, split_k=1, warps=4, unroll=unroll)
    return GemvConfig(block_n=2, block_k=block_k, split_k=1, warps=8, unroll=unroll)


@functools.cache
def pdl_runs_on(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper on): a kernel launched with it may start while the one before it in the
    stream is finishing, and waits for it (gdc_wait) only before reading what it wrote. The GEMV reads its first
    weight tile before waiting, so the launch, the ramp-up and the tail of the kernel before overlap with weight
    reads; inside CUDA graphs too."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def prepare(x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None, quantize: bool = False,
            input_scale: torch.Tensor | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(f(x), scale): see `_prepare_kernel`; `scale` is [M] for dynamic quantization, `input_scale` for static, None
    without quantization."""
    m, k = x.shape
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    scale = input_scale if input_scale is not None or not quantize else torch.empty(m, dtype=torch.float32,
                                                                                    device=x.device)
    if k > MAX_K:
        raise ValueError(f"gemv.prepare: rows of {k} > {MAX_K} do not fit one program's registers")
    block = triton.next_power_of_2(k)
    _prepare_kernel[(m,)](x.contiguous(), out, scale if scale is not None else out,
                          norm[0] if norm is not None else out, norm[1] if norm is not None else 0.0, K=k,
                          NORM=norm is not None, QUANTIZE=quantize, STATIC=input_scale is not None,
                          BLOCK=block, PDL=pdl, num_warps=min(16, max(4, block // 1024)), **launch(pdl))
    return out, scale


def gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
         input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, quantize_input: bool = True, *,
         norm: tuple[torch.Tensor, float] | None = None, gated: bool = False, residual: torch.Tensor | None = None,
         config: GemvConfig | None = None, early: bool = False) -> torch.Tensor:
    """residual + f(x) W^T (+ bias) for x [M, K] (M small), weight [N, K] in x's dtype or E4M3 with `weight_scale`
    [N, 1]; f = RMSNorm with (weight, eps) `norm`, or nothing. `gated`: W is [gate | up] and the output [M, N / 2] is
    SiLU(gate) * up (no residual then). FP8: `input_scale` None quantizes each row with its own scale;
    `quantize_input` False leaves the input as it is (weights-only FP8). `early`: the kernel before it is attention,
    which lets it launch early under PDL_ATTENTION."""
    (n, k), m = weight.shape, x.shape[0]
    fp8 = weight.dtype == FP8
    if x.shape[1] != k or (fp8 and weight_scale is None) or (gated and (n % 2 or residual is not None)):
        raise ValueError(f"gemv: input {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"gated={gated}, residual={residual is not None}")
    c = config or default_config(n, k, fp8)
    if gated:  # a program's block_n weight rows: half its features' gate rows, half their up rows
        n, c = n // 2, dataclasses.replace(c, block_n=max(1, c.block_n // 2))
    quantize = fp8 and quantize_input
    prepared = norm is not None or quantize
    # PDL where a prepare kernel comes first: the weight reads start while it runs (FP8: 1-2 us a projection on the
    # H200); bf16 GEMVs after each other were slower with it (gate_up 59.9 vs 57.4 us), the early CTAs competing
    pdl = c.pdl and (prepared or PDL_UNPREPARED or early and PDL_ATTENTION) and pdl_runs_on(x.device)
    x_scale = None
    if prepared:
        x, x_scale = prepare(x, norm, quantize, input_scale, pdl)
    chunks = triton.cdiv(k, c.block_k)
    iters = triton.cdiv(chunks, c.split_k)
    split_k = triton.cdiv(chunks, iters)  # no program without work
    unroll = c.unroll if (iters - pdl) % c.unroll == 0 else 1  # (with PDL the first tile is read before the loop)
    blocks = triton.cdiv(n, c.block_n)
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    locks, partials = WORKSPACE.get(x.device, m * split_k * weight.shape[0], m * blocks) if split_k > 1 else (out, out)
    _gemv_kernel[(blocks, split_k, m)](
        x, weight, out, weight_scale if fp8 else out,
        x_scale if x_scale is not None else out, bias if bias is not None else out,
        residual.contiguous() if residual is not None else out, partials, locks, n, K=k, FP8=fp8, QUANTIZED=quantize,
        STATIC=input_scale is not None, HAS_BIAS=bias is not None, RESIDUAL=residual is not None, GATED=gated,
        EVEN=n % c.block_n == 0 and k == split_k * iters * c.block_k, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        SPLIT_K=split_k, ITERS=iters, UNROLL=unroll, PDL=pdl, num_warps=c.warps, **launch(pdl))
    return out
