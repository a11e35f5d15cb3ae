"""python -m perf.gemv_sweep: the batch-1 GEMV kernel (backends/llm/gemv.py) over its block configurations, on a GPU.

For each of Llama-3-8B's four projections, in bf16 and in FP8 (per-channel weights, dynamic per-token input), every
configuration in a bounded grid (block sizes, split-K, warps, unrolling) is checked against the float64 product and
timed, beside the library in the same run (cuBLAS: `F.linear` in bf16, `torch._scaled_mm` after quantizing the input
per token in FP8). Each
variant runs in one CUDA graph over enough weight copies (>= 256 MiB) that L2 holds none of them; the figure is the
median per call over 20 replays. The best configuration per layer is then timed with the fused prologue/epilogue the
layer uses in a decode step (RMSNorm before q/k/v and gate/up, SiLU * up before down, the residual after o and down).
Kernels are compiled by worker processes first (Triton caches them on disk), so the sweep fits a short lease.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import multiprocessing
import socket
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.llm.fp8 import quantize_tokens
from backends.llm.gemv import WORKSPACE, FP8, GemvConfig, default_config, gemv
from perf.fp8_layers import graph_time_us as graph_time_us_with_input
from perf.report import hardware_line, stem, write_table

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}
FUSED = {"qkv_proj": "norm", "o_proj": "residual", "gate_up_proj": "norm+gated", "down_proj": "residual",
         "lm_head": "norm"}
BF16_ONLY = ("lm_head",)  # kept in bf16 by the FP8 schemes
SMS = 132


def candidates(n: int, k: int, fp8: bool) -> list[GemvConfig]:
    """The grid, bounded to tiles of 2-32 KB, 8-64 elements per thread, a few waves of programs, and K spans that
    the blocks divide (no masks)."""
    size = 1 if fp8 else 2
    out = []
    for block_n in (2, 4, 8, 16):
        for block_k in (512, 1024, 2048, 4096):
            for split_k in (1, 2, 4):
                for warps in (4, 8):
                    for unroll in (1, 2):
                        tile, per_thread = block_n * block_k * size, block_n * block_k // (32 * warps)
                        programs = -(-n // block_n) * split_k
                        iters, rest = divmod(k, block_k * split_k)
                        if (2048 <= tile <= 32768 and 8 <= per_thread <= 64 and SMS <= programs <= 256 * SMS
                                and rest == 0 and iters % unroll == 0):
                            out.append(GemvConfig(block_n, block_k, split_k, warps, unroll))
    return out


def label(c: GemvConfig) -> str:
    return f"{c.block_n}/{c.block_k}/{c.split_k}/{c.warps}/{c.unroll}"


def with_default(configs: list[GemvConfig], name: str, fp8: bool) -> list[GemvConfig]:
    default = default_config(*SHAPES[name], fp8)
    return configs if default in configs else [*configs, default]


def weights(n: int, k: int, fp8: bool, count: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    out = []
    for _ in range(count):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        if fp8:
            scale = (w.abs().float().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
            out.append(((w.float() / scale).clamp(-448, 448).to(FP8), scale))
        else:
            out.append((w, None))
    return out


def _compile(job: tuple[str, bool, list[GemvConfig]]) -> int:
    """Worker: run each configuration once (compiles it into Triton's disk cache)."""
    name, dtype, configs = job
    n, k = SHAPES[name]
    (w, scale), = weights(n, k, dtype != "bf16", 1)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for c in configs:
        gemv(x, w, scale, quantize_input=dtype == "fp8", config=c)
    torch.cuda.synchronize()
    return len(configs)


def graph_time_us(fn, copies: list) -> float:
    """perf.fp8_layers' graph timing of fn(copy), the input held by fn."""
    return graph_time_us_with_input(lambda copy, _: fn(copy), copies, None)


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, quantize_input: bool = True
              ) -> torch.Tensor:
    if scale is None:
        return x.double() @ w.double().t()
    if not quantize_input:
        return x.double() @ (w.double() * scale).t()
    x_scale = (x.abs().float().amax(dim=-1, keepdim=True) / 448).clamp(min=1e-12)
    xq = (x.float() / x_scale).clamp(-448, 448).to(FP8)
    return (xq.double() * x_scale) @ (w.double() * scale).t()


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.gemv_sweep", description=__doc__)
    parser.add_argument("--layers", nargs="+", default=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "fp8w"],
                        help="fp8w: FP8 weights only, the input left in bf16")
    parser.add_argument("--workers", type=int, default=max(1, (multiprocessing.cpu_count() or 2) - 1))
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("perf.gemv_sweep needs a GPU", file=sys.stderr)
        return 1
    jobs = [(name, dtype, with_default(candidates(*SHAPES[name], dtype != "bf16"), name,
                                       dtype != "bf16"))
            for name in args.layers for dtype in args.dtypes if not (dtype != "bf16" and name in BF16_ONLY)]
    chunked = [(name, dtype, configs[i::args.workers]) for name, dtype, configs in jobs for i in range(args.workers)]
    with concurrent.futures.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        print(f"compiled {sum(pool.map(_compile, [j for j in chunked if j[2]]))} kernels", flush=True)
    quantize = torch.compile(quantize_tokens, dynamic=True)  # as the engine's Kernels.compiled() has it

    def scaled_mm(x, w, scale):
        xq, x_scale = quantize(x, None)
        return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=x.dtype)

    torch.manual_seed(0)
    all_rows, best_rows = [], []
    for name, dtype, configs in jobs:
        n, k = SHAPES[name]
        fp8, quantized = dtype != "bf16", dtype == "fp8"
        size = 1 if fp8 else 2
        copies = weights(n, k, fp8, max(2, -(-256 * 2**20 // (n * k * size))))
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = reference(x, *copies[0], quantized)
        baseline_name = {"bf16": "cuBLAS F.linear", "fp8": "cuBLAS torch._scaled_mm",
                         "fp8w": "widened to bf16, cuBLAS F.linear"}[dtype]
        baseline = {"bf16": lambda c: F.linear(x, c[0]), "fp8": lambda c: scaled_mm(x, *c),
                    "fp8w": lambda c: F.linear(x, c[0].to(x.dtype)).float() * c[1].view(-1)}[dtype]
        base_us = graph_time_us(baseline, copies)
        timed = []
        for c in configs:
            e = error(gemv(x, *copies[0], quantize_input=quantized, config=c), ref)
            row = [name, dtype, c.block_n, c.block_k, c.split_k, c.warps, c.unroll]
            if not e < 1e-2:  # recorded, left out of the ranking; fresh split-K counters for the next one
                print(f"{name} {row[1]} {c}: relative error {e:.2e}", flush=True)
                all_rows.append(row + ["wrong", f"{e:.2e}"])
                WORKSPACE.buffers.clear()
                continue
            us = graph_time_us(lambda w: gemv(x, *w, quantize_input=quantized, config=c), copies)
            timed.append((us, c))
            all_rows.append(row + [f"{us:.2f}", f"{n * k * size / us / 1e3:.0f}"])
        default = default_config(n, k, fp8)
        default_us = next(t for t, c in timed if c == default)
        plain_us = graph_time_us(lambda w: gemv(x, *w, quantize_input=quantized,
                                                config=dataclasses.replace(default, pdl=False)), copies)
        timed.sort(key=lambda t: t[0])
        us, c = timed[0]
        fused = fused_time_us(name, x, copies, c, quantized)
        best_rows.append([name, f"{n}x{k}", dtype, len(configs), label(c), f"{us:.1f}",
                          f"{n * k * size / us / 1e3:.0f}", f"{default_us:.1f}", f"{plain_us:.1f}", baseline_name,
                          f"{base_us:.1f}", f"{n * k * size / base_us / 1e3:.0f}", f"{base_us / us:.2f}", FUSED[name],
                          f"{fused:.1f}", ", ".join(f"{label(b)} {t:.1f}" for t, b in timed[1:4])])
        print(*best_rows[-1], sep=" | ", flush=True)
        del copies
        torch.cuda.empty_cache()
    base = stem(args.results / args.host, "gemv-sweep-configs")
    with base.with_suffix(".csv").open("w", newline="") as f:
        csv.writer(f).writerows([["layer", "dtype", "block_n", "block_k", "split_k", "warps", "unroll", "us", "GB/s"],
                                 *all_rows])
    notes = ["Config: BLOCK_N/BLOCK_K/SPLIT_K/warps/unroll, launched as the engine launches it (with PDL after a "
             "prepare kernel, where the GPU has it: gemv.pdl_runs_on). Times: median of 20 replays of a CUDA graph calling the kernel once per weight "
             "copy (>= 256 MiB, so L2 holds none), per call; GB/s: weight bytes per second. "
             "Every configuration checked against the float64 product (relative error < 1e-2) before timing.",
             "fp8: E4M3 weights with per-channel scales, the input quantized per token first (gemv.prepare, one small "
             "kernel, included in the time, as the engine runs it); its baseline, cuBLAS' FP8 GEMM, includes its "
             "quantization kernel too. (The engine's FP8 kernel before, fp8_gemv.py, quantized inside every program: "
             "qkv 12.4, o 11.1, gate_up 43.2, down 35.8 us in 2026-12-02-gemv-sweep-in-kernel-prologue.md.)",
             "fp8w: the same E4M3 weights, the input left in bf16 (weights-only FP8); its baseline widens each "
             "weight to bf16 for cuBLAS (Fp8Linear's path for long weights-only steps).",
             "fused: the best configuration with the neighbours the decode step folds in: the RMSNorm or SiLU(gate) * "
             "up before (in gemv.prepare, with the FP8 quantization) and the residual add after (as the output is "
             "written); the unfused step runs each of those as its own kernel.",
             "default us: the configuration the engine takes (gemv.default_config); no PDL: the same launched plainly.",
             f"All configurations: {base.name}.csv. Command: `python -m perf.gemv_sweep`."]
    path = write_table(args.results / args.host, "gemv-sweep",
                       ["layer", "N x K", "weights", "configs tried", "best config", "us", "GB/s", "default us",
                        "default, no PDL us",
                        "baseline",
                        "baseline us", "baseline GB/s", "baseline / best", "fused with", "fused us",
                        "next best (us)"], best_rows, hardware_line("n/a (in-process)"), notes)
    print(path.read_text())
    return 0


def fused_time_us(name: str, x: torch.Tensor, copies: list, c: GemvConfig, quantized: bool = True) -> float:
    n, k = SHAPES[name]
    norm = (torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5)
    residual = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
    q = quantized
    call = {"norm": lambda w: gemv(x, *w, quantize_input=q, norm=norm, config=c),
            "residual": lambda w: gemv(x, *w, quantize_input=q, residual=residual, config=c),
            "norm+gated": lambda w: gemv(x, *w, quantize_input=q, norm=norm, gated=True, config=c)
            }[FUSED[name]]
    return graph_time_us(call, copies)


if __name__ == "__main__":
    sys.exit(main())
