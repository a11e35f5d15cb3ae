"""Triton kernels that add LoRA products to a step's rows reading only the adapters the step uses (segmented GEMV).

A step's rows with adapters are grouped by their (slots, weights) and cut into tiles of up to TILE_ROWS rows
(backends/llm/lora.py plans them on the host): `perm` lists the rows tile after tile, and each tile row holds
(start in perm, rows, slot of adapter 0, slot of adapter 1) with the two weights beside it. Rows without adapters are
in no tile and cost nothing. `shrink` writes xa = w * x A^T for each tile's rows, in K splits (fp32 partial sums);
`expand` sums the splits and adds xa B into the projection's output in place. One tile reads its adapter's weights
once for all its rows, so a batch of 64 rows with one adapter reads it 4 times, and 64 rows with 64 adapters read each
once. Both read the number of tiles in use from the device, so one CUDA graph serves a step with any number of tiles:
their programs past the last tile return at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from backends.llm.gemv import launch, pdl_runs_on
from backends.llm.lora import TILE_ROWS  # rows of one tile (tl.dot needs at least 16)

# block configuration: the best of perf.lora_kernels' sweep on the H200 (perf/results/h200/2026-12-04-lora-kernels*)
K_SPLIT = 1024  # input features of one shrink work item
BLOCK_K = 256
SHRINK_WARPS = 2
BLOCK_N = 256  # output features of one expand block
CHUNK = 4  # expand blocks of one program
EXPAND_WARPS = 4
EXPAND_STAGES = 3  # expand blocks in flight through shared memory (at least 2; H200 2026-12-07)
PDL = True  # programmatic dependent launch where the GPU has it (gemv.pdl_runs_on): see _shrink_kernel


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, perm_ptr, tiles_ptr, weights_ptr, tile_count_ptr, xa_ptr, rows_total, stride_x,
                   K: tl.constexpr, R: tl.constexpr, SLOTS: tl.constexpr, PARTS: tl.constexpr, SPLITS: tl.constexpr,
                   MIXED: tl.constexpr, BM: tl.constexpr, R_PAD: tl.constexpr, BK: tl.constexpr,
                   K_SPLIT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, part, split): xa[split, row, j, part, :] = w_j * x[row, split's K] A[part, slot_j]^T.
    The tile's entry and weights are read beside the number of tiles in use (`_planned`; the buffers hold max_tiles
    entries), so a program's dependent reads are tile -> rows -> x and A; programs past the tiles in use return at
    once. Until 2026-12-07 a fixed number of programs looped over the work items, each reading the number of tiles,
    then its tile, then its weight, then the rows: on an H100 both forms took 43.4-43.5 us for a layer's shrinks
    with 64 distinct adapters (perf/results/h100/2026-12-07b-lora-kernels.md).
    PDL: the kernels are launched before the kernel ahead of them ends (the base product, then this one for expand)
    and read what no kernel of the step writes (the tile plan, the rows, the adapters) before gdc_wait, which they
    call before reading what it wrote (x; xa and the output in expand). Every program calls it, those without work
    too, so each kernel ends after the one before it."""
    tl.static_assert(MIXED == 2)
    if PDL:
        gdc_launch_dependents()  # expand may start: it waits for this kernel's end before reading xa
    tile, part, split = tl.program_id(0), tl.program_id(1) // SPLITS, tl.program_id(1) % SPLITS
    used = tl.load(tile_count_ptr)
    start, count = tl.load(tiles_ptr + tile * 4), tl.load(tiles_ptr + tile * 4 + 1)
    slot0, slot1 = tl.load(tiles_ptr + tile * 4 + 2), tl.load(tiles_ptr + tile * 4 + 3)
    w0, w1 = tl.load(weights_ptr + tile * MIXED), tl.load(weights_ptr + tile * MIXED + 1)
    if _planned(tile, used, start, count, slot0, slot1, w0, w1):
        m, r, ks = tl.arange(0, BM), tl.arange(0, R_PAD), tl.arange(0, BK)
        in_tile = m < count
        rows = tl.load(perm_ptr + start + m, mask=in_tile, other=0)
        if PDL:
            gdc_wait()
        for j in tl.static_range(MIXED):
            w, slot = tl.where(j == 0, w0, w1), tl.where(j == 0, slot0, slot1)
            if w != 0:
                a_rows = a_ptr + ((part * SLOTS + slot) * R + r[None, :]) * K
                acc = tl.zeros([BM, R_PAD], dtype=tl.float32)
                for k0 in range(split * K_SPLIT, split * K_SPLIT + K_SPLIT, BK):
                    k = k0 + ks
                    xk = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                                 mask=in_tile[:, None] & (k < K)[None, :], other=0.0)
                    ak = tl.load(a_rows + k[:, None], mask=(r < R)[None, :] & (k < K)[:, None], other=0.0)
                    acc = tl.dot(xk, ak, acc, input_precision=PRECISION)
                out = xa_ptr + (((split * rows_total + rows[:, None]) * MIXED + j) * PARTS + part) * R_PAD + r[None, :]
                tl.store(out, acc * w, mask=in_tile[:, None])
    elif PDL:
        gdc_wait()


@triton.jit
def _planned(tile, used, start, count, slot0, slot1, w0, w1):
    """The tile is in use and its entry is one that lora.plan_tiles writes (it always is). Every value is read
    before the branch that tests this, with the number of tiles in use, in one round trip: a value used only inside
    the branch is read after it, the compiler sinking its load there (sm_90 code)."""
    return (tile < used) & (start >= 0) & (count > 0) & (slot0 >= 0) & (slot1 >= 0) & ((w0 != 0) | (w1 != 0))


@triton.jit
def _tile_xa(xa_ptr, rows, in_tile, r, j, part, rows_total, PARTS: tl.constexpr, SPLITS: tl.constexpr,
             MIXED: tl.constexpr, R_PAD: tl.constexpr, BM: tl.constexpr):
    """The tile rows' xa for adapter j and one part, its K splits summed."""
    xa = tl.zeros([BM, R_PAD], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        xa += tl.load(xa_ptr + (((split * rows_total + rows[:, None]) * MIXED + j) * PARTS + part) * R_PAD + r[None, :],
                      mask=in_tile[:, None], other=0.0)
    return xa


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, out_ptr, perm_ptr, tiles_ptr, weights_ptr, tile_count_ptr, rows_total, stride_out,
                   W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, R: tl.constexpr, PARTS: tl.constexpr,
                   SPLITS: tl.constexpr, MIXED: tl.constexpr, BM: tl.constexpr, R_PAD: tl.constexpr,
                   BN: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (tile, part, chunk): out[rows, the chunk's columns of the part] += sum_j xa[rows, j, part] B[slot_j].
    The tile's rows and xa are read once, then CHUNK column blocks of BN, each reading a B block per adapter and the
    rows' outputs (B holds the parts side by side: [slots, R, W0 + W1 + W2]), in a software-pipelined loop: B's
    blocks and the outputs are copied into shared memory STAGES - 1 blocks ahead (cp.async), so the bytes in flight
    are bounded by shared memory, not registers. On the H200 this took a layer's expands from 70.2 to 52.0 us with 64
    distinct adapters against B prefetched into registers (120 registers a thread, four programs an SM;
    perf/results/h200/2026-12-07-lora-kernels.md). A program's reads form a chain (tile -> rows -> xa -> output);
    the tile's entry is read beside the number of tiles (`_planned`, since that run), and programs whose columns lie
    past their part (the narrower parts of qkv) return at once."""
    tl.static_assert(MIXED == 2)
    tile = tl.program_id(0)
    used = tl.load(tile_count_ptr)
    start, count = tl.load(tiles_ptr + tile * 4), tl.load(tiles_ptr + tile * 4 + 1)
    slot0, slot1 = tl.load(tiles_ptr + tile * 4 + 2), tl.load(tiles_ptr + tile * 4 + 3)
    w0, w1 = tl.load(weights_ptr + tile * MIXED), tl.load(weights_ptr + tile * MIXED + 1)
    part, chunk = tl.program_id(1) % PARTS, tl.program_id(1) // PARTS
    col0 = tl.where(part == 0, 0, tl.where(part == 1, W0, W0 + W1))
    end = tl.where(part == 0, W0, tl.where(part == 1, W0 + W1, W0 + W1 + W2))
    first = col0 + chunk * CHUNK * BN
    if _planned(tile, used, start, count, slot0, slot1, w0, w1) & (first < end):
        m, r, n = tl.arange(0, BM), tl.arange(0, R_PAD), tl.arange(0, BN)
        rank1 = tl.where(w1 != 0, R, 0)
        b0 = b_ptr + (slot0 * R + r[:, None]) * (W0 + W1 + W2)
        b1 = b_ptr + (slot1 * R + r[:, None]) * (W0 + W1 + W2)
        in_tile = m < count
        rows = tl.load(perm_ptr + start + m, mask=in_tile, other=0)
        if PDL:
            gdc_wait()
        xa0 = _tile_xa(xa_ptr, rows, in_tile, r, 0, part, rows_total, PARTS, SPLITS, MIXED, R_PAD, BM)
        xa1 = _tile_xa(xa_ptr, rows, m < tl.where(rank1 > 0, count, 0), r, 1, part, rows_total, PARTS, SPLITS, MIXED,
                       R_PAD, BM)
        xa0, xa1 = xa0.to(b_ptr.dtype.element_ty), xa1.to(b_ptr.dtype.element_ty)
        for block in tl.range(0, CHUNK, num_stages=STAGES):
            cols = first + block * BN + n
            inside = (cols < end)[None, :]
            mask = in_tile[:, None] & inside
            out = out_ptr + rows[:, None] * stride_out + cols[None, :]
            before = tl.load(out, mask=mask, other=0.0).to(tl.float32)
            blk0 = tl.load(b0 + cols[None, :], mask=(r < R)[:, None] & inside, other=0.0)
            blk1 = tl.load(b1 + cols[None, :], mask=(r < rank1)[:, None] & inside, other=0.0)
            acc = tl.dot(xa1, blk1, tl.dot(xa0, blk0, before, input_precision=PRECISION), input_precision=PRECISION)
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif PDL:
        gdc_wait()


def shrink(x: torch.Tensor, a: torch.Tensor, perm: torch.Tensor, tiles: torch.Tensor, weights: torch.Tensor,
           tile_count: torch.Tensor) -> torch.Tensor:
    """xa [splits, T, MIXED, parts, R_PAD] (fp32): each tiled row's w_j x A[part, slot_j]^T over each K split."""
    parts, slots, rank, k = a.shape
    rows_total, mixed, max_tiles = x.shape[0], weights.shape[1], tiles.shape[0]
    block_k = min(BLOCK_K, max(16, triton.next_power_of_2(k)))
    k_split = min(K_SPLIT, triton.cdiv(k, block_k) * block_k)
    splits = triton.cdiv(k, k_split)
    xa = torch.empty(splits, rows_total, mixed, parts, max(16, triton.next_power_of_2(rank)), dtype=torch.float32,
                     device=x.device)
    early = pdl(x)
    _shrink_kernel[(max_tiles, parts * splits)](
        x, a, perm, tiles, weights, tile_count, xa, rows_total, x.stride(0), K=k, R=rank, SLOTS=slots, PARTS=parts,
        SPLITS=splits, MIXED=mixed, BM=TILE_ROWS, R_PAD=xa.shape[-1], BK=block_k, K_SPLIT=k_split,
        PRECISION=precision(x), PDL=early, num_warps=SHRINK_WARPS, **launch(early))
    return xa


def expand(out: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, widths: tuple[int, ...], perm: torch.Tensor,
           tiles: torch.Tensor, weights: torch.Tensor, tile_count: torch.Tensor) -> None:
    """out [T, sum(widths)] += xa (summed over its splits) B, for each tiled row, in place."""
    splits, rows_total, mixed, parts, r_pad = xa.shape
    w0, w1, w2 = (tuple(widths) + (0, 0))[:3]
    block_n = min(BLOCK_N, max(16, triton.next_power_of_2(max(widths))))
    chunk = min(CHUNK, triton.cdiv(max(widths), block_n))  # column blocks a program adds
    chunks = triton.cdiv(triton.cdiv(max(widths), block_n), chunk)
    early = pdl(out)
    _expand_kernel[(tiles.shape[0], parts * chunks)](
        xa, b, out, perm, tiles, weights, tile_count, rows_total, out.stride(0), W0=w0, W1=w1, W2=w2, R=b.shape[1],
        PARTS=parts, SPLITS=splits, MIXED=mixed, BM=TILE_ROWS, R_PAD=r_pad, BN=block_n, CHUNK=chunk,
        STAGES=EXPAND_STAGES, PRECISION=precision(out), PDL=early, num_warps=EXPAND_WARPS, **launch(early))


def pdl(t: torch.Tensor) -> bool:
    """Launch with PDL (read at every launch, and kept by the CUDA graphs that capture one)."""
    return PDL and pdl_runs_on(t.device)


def precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, widths: tuple[int, ...],
             perm: torch.Tensor, tiles: torch.Tensor, weights: torch.Tensor, tile_count: torch.Tensor) -> None:
    """out [T, sum(widths)] += each tiled row's adapter products. a [parts, slots, R, K], b [slots, R, sum(widths)];
    perm [>= rows in tiles], tiles [max_tiles, 4], weights [max_tiles, MIXED]; tile_count [1]: tiles in use (read
    on the device; at most max_tiles)."""
    expand(out, shrink(x, a, perm, tiles, weights, tile_count), b, widths, perm, tiles, weights, tile_count)
