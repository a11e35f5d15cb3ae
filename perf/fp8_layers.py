"""python -m perf.fp8_layers: one linear layer of Llama-3-8B's shapes at decode batch sizes, three ways, on a GPU.

bf16 `F.linear` against the FP8 paths: cuBLAS' FP8 GEMM (`torch._scaled_mm` after quantizing the activations per
token, backends/llm/fp8.py) and, for one row, the Triton kernels of backends/llm/gemv.py (perf.gemv_sweep tunes them). Each variant is captured in one CUDA
graph that runs it over enough weight copies (>= 256 MiB) that no weight comes from L2, and the graph's replays are
timed with CUDA events; the figure is the median time per layer call and the weight bytes it read per second. Every
variant's output is checked against the float product of the same quantized operands first.
"""
from __future__ import annotations

import argparse
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from backends.llm import fp8
from backends.llm.model import GEMV_MAX_ROWS
from perf.report import hardware_line, write_table

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


def fp8_layer(weight: torch.Tensor) -> fp8.Fp8Linear:
    layer = fp8.Fp8Linear(weight.shape[1], weight.shape[0], bias=False).to(weight.device)
    layer.weight.data, layer.weight_scale.data = fp8.quantize_weight(weight)
    return layer


def graph_time_us(fn, copies: list, x: torch.Tensor, replays: int = 20) -> float:
    """Median time of one fn(copy, x) call, from replays of a graph that calls it once per copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in copies[:2]:  # compile / autotune outside the capture
            fn(c, x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in copies:
            fn(c, x)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(copies))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.fp8_layers", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    if not (torch.cuda.is_available() and fp8.scaled_mm_available(torch.device("cuda", 0))):
        print("perf.fp8_layers needs a GPU with FP8 (compute capability 8.9 or newer)", file=sys.stderr)
        return 1
    from backends.llm.gemv import gemv

    torch.manual_seed(0)
    quantize_tokens = torch.compile(fp8.quantize_tokens, dynamic=True)  # as the engine's Kernels.compiled() has it
    rows = []
    for name, (n, k) in SHAPES.items():
        count = max(2, -(-256 * 2**20 // (n * k)))  # fp8 copies: >= 256 MiB, the bf16 ones twice that
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        layers = [fp8_layer(w) for w in weights]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_scale = fp8.token_scales(x)
            reference = (fp8.quantize(x, x_scale).double() * x_scale) @ (
                layers[0].weight.double() * layers[0].weight_scale).t()

            def scaled_mm(layer, x):
                xq, x_scale = quantize_tokens(x, None)
                return torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale,
                                        scale_b=layer.weight_scale.view(1, -1), out_dtype=x.dtype)

            def kernel(layer, x):
                return gemv(x, layer.weight, layer.weight_scale)

            variants = {"scaled_mm": scaled_mm} | ({"triton": kernel} if m <= GEMV_MAX_ROWS else {})
            for variant, fn in variants.items():
                error = ((fn(layers[0], x).double() - reference).norm() / reference.norm()).item()
                if not error < 1e-2:
                    raise AssertionError(f"{name} M={m} {variant}: relative error {error:.2e}")
            bf16_us = graph_time_us(lambda w, x: F.linear(x, w), weights, x)
            fp8_us = {variant: graph_time_us(fn, layers, x) for variant, fn in variants.items()}
            best = min(fp8_us["scaled_mm"], fp8_us.get("triton", float("inf")))  # the engine's paths
            rows.append([name, f"{n}x{k}", m, f"{bf16_us:.1f}", *(f"{fp8_us[v]:.1f}" if v in fp8_us else "-" for v in (
                "scaled_mm", "triton")),
                f"{2 * n * k / bf16_us / 1e3:.0f}", f"{n * k / best / 1e3:.0f}", f"{bf16_us / best:.2f}"])
            print(*rows[-1], flush=True)
        del weights, layers
        torch.cuda.empty_cache()
    notes = ["Times: median of 20 replays of a CUDA graph calling the layer once per weight copy (>= 256 MiB of FP8 "
             "weights, so L2 holds none of them); per call. GB/s: weight bytes read per second.",
             "scaled_mm includes the per-token activation quantization before it (one torch.compile'd kernel, as in "
             "the engine); the Triton kernels (gemv.py: the quantization, then the product; one row, as the engine "
             "runs them). FP8 results checked against the float product of the quantized operands (relative error "
             "< 1e-2) before timing."]
    path = write_table(args.results / args.host, "fp8-layers",
                       ["layer", "N x K", "rows", "bf16 us", "fp8 scaled_mm us", "fp8 triton us", "bf16 GB/s",
                        "fp8 GB/s (engine's faster path)", "bf16 / fp8"], rows, hardware_line("n/a (in-process)"),
                       notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
