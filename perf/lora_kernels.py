"""python -m perf.lora_kernels: the LoRA kernels' time per projection of Llama-3-8B's shapes in one decode step.

64 rows, 64 device slots of rank 16, bf16: the rows' adapters all distinct, all one, or none. For each projection,
backends/llm/lora_kernels.py's `shrink` and `expand` at a few block configurations, beside the product they replaced
(every slot's A and B for every row, masked by the rows' weights: cuBLAS) and the time the adapters' bytes take at
this run's copy bandwidth. Times are medians of CUDA graph replays over copies of the weights larger than the L2
cache, so each call reads from memory as a step does.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
from pathlib import Path

import torch

from backends.llm import lora_kernels
from backends.llm.lora import plan_tiles
from perf.fp8_layers import graph_time_us
from perf.llm_engine import copy_bandwidth
from perf.report import hardware_line, write_table

PROJECTIONS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
               "down": (14336, (4096,))}
SHRINK = [{}, {"K_SPLIT": 512}, {"BLOCK_K": 128}, {"SHRINK_WARPS": 4}]  # the defaults, then changes to them
# the expand at other pipeline depths and program lengths (the H200's sweep of these and more:
# perf/results/h200/2026-12-07-lora-kernels.md)
EXPAND = [{}, {"CHUNK": 8}, {"CHUNK": 2}, {"EXPAND_STAGES": 2}, {"EXPAND_STAGES": 4}, {"BLOCK_N": 128, "CHUNK": 8}]


def step_tensors(case: str, rows: int, device) -> tuple[torch.Tensor, ...]:
    """perm, tiles, weights, tile_count of a step whose rows use distinct adapters, one adapter, or none."""
    slots = {"distinct": range(rows), "one": [0] * rows, "none": []}[case]
    plan = plan_tiles((i, 1, [s, 0], [1.0, 0.0]) for i, s in enumerate(slots))
    return (*(torch.from_numpy(t).to(device) for t in (plan.perm, plan.tiles, plan.weights)),
            torch.tensor([len(plan.tiles)], device=device))


@contextlib.contextmanager
def changed(settings: dict):
    """backends/llm/lora_kernels' block configuration with `settings` changed, for the time of the block."""
    before = {name: getattr(lora_kernels, name) for name in settings}
    for name, value in settings.items():
        setattr(lora_kernels, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(lora_kernels, name, value)


def label(settings: dict | None) -> str:
    return "" if settings is None else ", ".join(f"{k}={v}" for k, v in settings.items()) or "default"


def every_slot(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, widths: tuple[int, ...],
               mix: torch.Tensor) -> None:
    """The product before the kernels: x over every slot's A, masked by the rows' weights [T, S], then every slot's B
    per part, added into the part's columns."""
    parts, slots, rank, k = a.shape
    xa = ((x @ a.view(-1, k).t()).view(-1, parts, slots, rank) * mix[:, None, :, None]).view(-1, parts, slots * rank)
    start = 0
    for p, width in enumerate(widths):
        out[:, start:start + width].addmm_(xa[:, p], b[:, :, start:start + width].reshape(slots * rank, width))
        start += width


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="gpu")
    args = parser.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.bfloat16
    bandwidth = copy_bandwidth(device)  # bytes moved per second (the engine's roofline uses it for reads alone)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 60 * 2**20)
    columns = ["projection", "rows' adapters", "shrink", "shrink us", "expand", "expand us", "kernels us",
               "every-slot product us", "adapters' bytes at copy bandwidth us"]
    rows = []
    for name, (k, widths) in PROJECTIONS.items():
        n = sum(widths)
        size = 2 * args.slots * args.rank * (len(widths) * k + n)
        copies = [(torch.randn(len(widths), args.slots, args.rank, k, device=device, dtype=dtype) * 0.02,
                   torch.randn(args.slots, args.rank, n, device=device, dtype=dtype) * 0.02)
                  for _ in range(max(2, 3 * l2 // size + 1))]
        x = torch.randn(args.rows, k, device=device, dtype=dtype)
        out = torch.zeros(args.rows, n, device=device, dtype=dtype)
        for case in ("distinct", "one", "none"):
            step = step_tensors(case, args.rows, device)
            used = {"distinct": min(args.rows, args.slots), "one": 1, "none": 0}[case]
            mix = torch.zeros(args.rows, args.slots, device=device, dtype=dtype)
            if used:
                mix[torch.arange(args.rows), step[0].new_tensor(range(args.rows)) % used] = 1
            dense = graph_time_us(lambda c, _: every_slot(out, x, *c, widths, mix), copies, None)
            floor = used * size / args.slots / bandwidth * 1e6
            configs = itertools.zip_longest(SHRINK, EXPAND)
            for shrink_changes, expand_changes in configs if used else [(SHRINK[0], EXPAND[0])]:  # none: launches
                shrink_us = expand_us = None
                if shrink_changes is not None:
                    with changed(shrink_changes):
                        shrink_us = graph_time_us(lambda c, _: lora_kernels.shrink(x, c[0], *step), copies, None)
                if expand_changes is not None:
                    xa = lora_kernels.shrink(x, copies[0][0], *step)
                    with changed(expand_changes):
                        expand_us = graph_time_us(lambda c, _: lora_kernels.expand(out, xa, c[1], widths, *step),
                                                  copies, None)
                both = f"{shrink_us + expand_us:.1f}" if shrink_us and expand_us else ""
                rows.append([name, case, label(shrink_changes), f"{shrink_us:.1f}" if shrink_us else "",
                             label(expand_changes), f"{expand_us:.1f}" if expand_us else "", both, f"{dense:.1f}",
                             f"{floor:.1f}"])
                print(" | ".join(rows[-1]), flush=True)
    notes = [f"{args.rows} rows, {args.slots} slots of rank {args.rank}, bf16; Llama-3-8B projections (qkv and "
             "gate_up fused); configurations: backends/llm/lora_kernels.py's defaults and the changes named. "
             "Kernels us: the shrink and expand of a row together (the first row of each case: the defaults). "
             f"Copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)."]
    path = write_table(args.results / args.host, "lora-kernels", columns, rows, hardware_line("n/a (in-process)"),
                       notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
