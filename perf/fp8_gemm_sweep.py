"""python -m perf.fp8_gemm_sweep: weights-only FP8 layers at decode batch sizes (backends/llm/fp8_gemm.py), on a GPU.

For Llama-3-8B's four projections at 2 to 256 rows: bf16 `F.linear`, W8A8 (`torch._scaled_mm` after the per-token
quantization, as the engine runs it), and weights-only FP8 two ways: each weight widened to bf16 before `F.linear`
(the engine's path before the kernel, still its path above fp8.FP8_GEMM_MAX_ROWS) and the Triton GEMM with its
default configuration; at some row counts every configuration of a bounded grid too. Beside them the GEMV kernels
(backends/llm/gemv.py, the engine's one-token path; FP8 weights only and W8A8), so `--rows 1 --sweep-rows 1` says
whether a tensor-core GEMM (rows padded to 16) would read the weights faster than the GEMV at batch 1. Each
variant runs in one CUDA graph over enough weight copies (>= 256 MiB) that L2 holds none of them (perf.fp8_layers'
timing); every kernel configuration is checked against the float64 product first. Kernels are compiled by worker
processes first (Triton caches them on disk), so the sweep fits a short lease.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import math
import multiprocessing
import socket
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from backends.llm.fp8 import quantize_tokens
from backends.llm.fp8_gemm import GemmConfig, default_config, fp8_weight_matmul, swapped
from backends.llm.gemv import gemv
from perf.gemv_sweep import SHAPES, error, graph_time_us, weights
from perf.report import hardware_line, stem, write_table

LAYERS = [name for name in SHAPES if name != "lm_head"]  # the FP8 schemes keep the LM head in bf16
SMS = 132


def candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    """The grid, bounded to register tiles of at most 32K elements, 1-16 waves of programs, >= 2 K tiles each."""
    out = []
    for block_m in sorted({min(128, max(16, 1 << (m - 1).bit_length())), min(64, max(16, 1 << (m - 1).bit_length()))}):
        for block_n in (32, 64, 128):
            for block_k in (64, 128, 256):
                for split_k in (1, 2, 4, 8):
                    for warps, stages in ((4, 3), (4, 4), (8, 3), (8, 4)):
                        programs = -(-m // block_m) * -(-n // block_n) * split_k
                        staged = stages * (2 * block_m + block_n) * block_k  # bytes of shared memory, about
                        if (max(block_m, block_n) * block_k <= 32768 and block_m * block_n <= 16384
                                and staged <= 160 * 1024 and SMS // 2 <= programs <= 16 * SMS
                                and k // (block_k * split_k) >= 2):
                            # swapped (weights as the MMA's first operand): 64 of its columns a warp group
                            out += [GemmConfig(block_m, block_n, block_k, split_k, warps, stages, swap)
                                    for swap in (False, True)[:1 + (block_n >= 16 * warps)]]
    return out


def label(c: GemmConfig) -> str:
    return f"{c.block_m}/{c.block_n}/{c.block_k}/{c.split_k}/{c.warps}/{c.stages}" + ("/swap" if c.swap else "")


def _compile(job: tuple[str, int, list[GemmConfig]]) -> list[GemmConfig]:
    """Worker: run each configuration once (compiles it into Triton's disk cache); those that do not fit the GPU
    (shared memory, registers) or do not compile are returned."""
    name, m, configs = job
    n, k = SHAPES[name]
    (w, scale), = weights(n, k, True, 1)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    unfit = []
    for c in configs:
        try:
            fp8_weight_matmul(x, w, scale, config=c)
        except triton.runtime.errors.OutOfResources:
            unfit.append(c)
        except Exception as e:  # noqa: BLE001 - e.g. a swapped configuration this Triton cannot compile
            print(f"{name} M={m} {label(c)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            unfit.append(c)
    torch.cuda.synchronize()
    return unfit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.fp8_gemm_sweep", description=__doc__)
    parser.add_argument("--layers", nargs="+", default=LAYERS)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=[4, 16, 64, 256],
                        help="row counts at which every configuration of the grid is timed")
    parser.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 2) - 1))
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.fp8_gemm_sweep needs a GPU", file=sys.stderr)
        return 1
    jobs = {(name, m): [default_config(m, *SHAPES[name])] + (candidates(m, *SHAPES[name]) if m in args.sweep_rows
                                                             else []) for name in args.layers for m in args.rows}
    chunked = [(name, m, configs[i::args.workers]) for (name, m), configs in jobs.items() for i in range(args.workers)]
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        unfit = {c for found in pool.map(_compile, [j for j in chunked if j[2]]) for c in found}
    jobs = {key: [c for c in configs if c not in unfit] for key, configs in jobs.items()}
    print(f"compiled {sum(map(len, jobs.values()))} kernels ({len(unfit)} did not fit or compile)", flush=True)
    quantize = torch.compile(quantize_tokens, dynamic=True)  # as the engine's Kernels.compiled() has it

    def scaled_mm(x, w, scale):
        xq, x_scale = quantize(x, None)
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)

    def w8a8_kernel(x, w, scale, config):  # the same quantization, then our GEMM on FP8 inputs
        xq, x_scale = quantize(x, None)
        return fp8_weight_matmul(xq, w, scale, config=config, x_scale=x_scale, out_dtype=x.dtype)

    def widened(x, w, scale):  # fp8.Fp8Linear's path for long weights-only steps
        return (F.linear(x, w.to(x.dtype)).float() * scale.view(-1)).to(x.dtype)

    torch.manual_seed(0)
    all_rows, rows = [], []
    for name in args.layers:
        n, k = SHAPES[name]
        copies = weights(n, k, True, max(2, -(-256 * 2**20 // (n * k))))
        bf16 = [(w.to(torch.bfloat16) * s.to(torch.bfloat16), None) for w, s in copies[:max(2, len(copies) // 2)]]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ (copies[0][0].double() * copies[0][1].double()).t()
            timed = []
            for c in jobs[name, m]:
                e = error(fp8_weight_matmul(x, *copies[0], config=c), ref)
                if not e < 1e-2:
                    print(f"{name} M={m} {label(c)}: relative error {e:.2e}", flush=True)
                    all_rows.append([name, m, label(c), "wrong", f"{e:.2e}"])
                    continue
                us = graph_time_us(lambda w: fp8_weight_matmul(x, *w, config=c), copies)
                timed.append((us, c))
                all_rows.append([name, m, label(c), f"{us:.2f}", f"{n * k / us / 1e3:.0f}"])
            default_us = timed[0][0] if timed and timed[0][1] == jobs[name, m][0] else float("nan")
            best_us, best = min(timed, key=lambda t: t[0])
            bf16_us = graph_time_us(lambda w: F.linear(x, w[0]), bf16)
            w8a8_us = graph_time_us(lambda w: scaled_mm(x, *w), copies)
            widened_us = graph_time_us(lambda w: widened(x, *w), copies)
            gemv_us = [graph_time_us(lambda w: gemv(x, *w, quantize_input=q), copies) for q in (False, True)]
            kernel_w8a8 = []
            for c in (jobs[name, m][0], swapped(jobs[name, m][0])):  # checked against cuBLAS' W8A8 first
                try:
                    e = error(w8a8_kernel(x, *copies[0], c), scaled_mm(x, *copies[0]).double())
                    kernel_w8a8.append(graph_time_us(lambda w: w8a8_kernel(x, *w, c), copies) if e < 1e-2
                                       else math.nan)
                except Exception as exc:  # noqa: BLE001 - a column of its own; the sweep goes on
                    print(f"{name} M={m} W8A8 kernel {label(c)}: {type(exc).__name__}: {exc}", flush=True)
                    kernel_w8a8.append(math.nan)
            rows.append([name, f"{n}x{k}", m, f"{bf16_us:.1f}", f"{w8a8_us:.1f}",
                         *(f"{us:.1f}" for us in kernel_w8a8), *(f"{us:.1f}" for us in gemv_us), f"{widened_us:.1f}",
                         f"{default_us:.1f}", label(jobs[name, m][0]), f"{best_us:.1f}", label(best),
                         f"{n * k / default_us / 1e3:.0f}", f"{bf16_us / default_us:.2f}"])
            print(*rows[-1], sep=" | ", flush=True)
        del copies, bf16
        torch.cuda.empty_cache()
    base = stem(args.results / args.host, "fp8-gemm-sweep-configs")
    with base.with_suffix(".csv").open("w", newline="") as f:
        csv.writer(f).writerows([["layer", "rows", "config", "us", "GB/s"], *all_rows])
    notes = ["Times: median of 20 replays of a CUDA graph calling the layer once per weight copy (>= 256 MiB of FP8 "
             "weights, so L2 holds none), per call. GB/s: FP8 weight bytes per second of the kernel's default.",
             "w8a8: the input quantized per token (one torch.compile'd kernel) and cuBLAS' FP8 GEMM; w8a8 kernel: the "
             "same quantization, then backends/llm/fp8_gemm.py on the E4M3 inputs with their row scales (FP8 tensor "
             "cores), its default configuration and that configuration swapped; gemv: backends/llm/gemv.py with its "
             "default configuration, weights only (w8a16) or after its prepare kernel's per-token quantization "
             "(w8a8); widened: each "
             "E4M3 weight converted to bf16, F.linear, the per-channel scale after (the engine's weights-only path "
             "before fp8_gemm.py); kernel: backends/llm/fp8_gemm.py, config BLOCK_M/BLOCK_N/BLOCK_K/SPLIT_K/warps/"
             "stages[/swap: the transposed product, weights as the MMA's first operand], its default "
             "(fp8_gemm.default_config) and the best of the grid where swept "
             f"(rows {', '.join(map(str, args.sweep_rows))}).",
             f"All configurations: {base.name}.csv. Command: `python -m perf.fp8_gemm_sweep`."]
    path = write_table(args.results / args.host, "fp8-gemm-sweep",
                       ["layer", "N x K", "rows", "bf16 us", "w8a8 us", "w8a8 kernel us", "w8a8 kernel swapped us",
                        "w8a16 gemv us", "w8a8 gemv us", "w8a16 widened us", "w8a16 kernel us",
                        "kernel config", "best us", "best config", "kernel GB/s", "bf16 / kernel"], rows,
                       hardware_line("n/a (in-process)"), notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
