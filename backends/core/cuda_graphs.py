"""A batched module replayed from CUDA graphs, one per power-of-two batch size (or finer, `step`).

An encoder run op by op from Python launches hundreds of small kernels per batch; on a fast GPU the host then sets
the pace (ViT-B/16 on the H200: 20 ms of Python for a batch the GPU runs in about 2 ms). A graph replays the same
kernels with one launch. A batch runs in the smallest graph that holds it, its rows copied into the graph's static
input; the padding rows compute garbage nobody reads (every row of these encoders is independent of the others).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)


def batch_sizes(largest: int, step: int | None = None) -> list[int]:
    """1, 2, 4, ... up to and including `largest` (which need not be a power of two); with `step`, the powers of two
    below it, then its multiples: for a module whose cost grows with its rows, a batch then pays for fewer padding
    rows (33 rows: 40 with step 8, not 64)."""
    sizes = [1 << i for i in range(largest.bit_length()) if 1 << i < min(largest, step or largest)]
    if step:
        sizes += range(step, largest, step)
    return sizes + [largest]


class GraphedBatches:
    """`module(*inputs)` for inputs whose dimensions after the first are fixed (`shapes`, `dtypes`). `exact`: every
    batch must fill a graph (a module that writes beyond its outputs, where padding rows would write garbage).
    `step`: graph sizes as batch_sizes'."""

    def __init__(self, module: Callable, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                 device: torch.device, largest: int, exact: bool = False, step: int | None = None):
        self.module, self.largest, self.exact = module, largest, exact
        self.lock = threading.Lock()  # one batch at a time owns the static buffers
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        pool = None
        # captured on a stream of its own, not on torch's one capture stream shared by every graph: whisper's join
        # graphs replayed beside its decoder step's hung the GPU when both were captured there, and ran once each
        # had its own stream (H100, 2026-12-07). Our reading: cuBLAS keeps a workspace per stream, which the
        # captured kernels use again at replay, so graphs captured on one stream share it
        stream = torch.cuda.Stream(device)
        for size in reversed(batch_sizes(largest, step)):  # largest first: the smaller ones reuse its pool memory
            inputs = [torch.zeros((size, *shape), dtype=dtype, device=device) for shape, dtype in zip(shapes, dtypes)]
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # lazy initialisation (cuBLAS handles, autotuning) happens outside the capture
                    module(*inputs)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream), torch.inference_mode():
                outputs = module(*inputs)
            pool = graph.pool()
            self.graphs[size] = graph, inputs, outputs if isinstance(outputs, (tuple, list)) else (outputs,)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Outputs of the whole batch, in chunks of the largest graph when it is larger; the results are copies
        (the graphs' outputs are overwritten by the next replay)."""
        rows = args[0].shape[0]
        chunks = [self.run_chunk([a[start:start + self.largest] for a in args])
                  for start in range(0, rows, self.largest)]
        return tuple(torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*chunks))

    def run_chunk(self, args: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        rows = args[0].shape[0]
        size = next(s for s in sorted(self.graphs) if s >= rows)
        if self.exact and size != rows:
            raise ValueError(f"{rows} rows fill no graph exactly (sizes {sorted(self.graphs)})")
        graph, inputs, outputs = self.graphs[size]
        with self.lock:
            for static, value in zip(inputs, args):
                static[:rows].copy_(value, non_blocking=True)
            graph.replay()
            return tuple(o[:rows].clone() for o in outputs)


def try_graphs(module: Callable, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
               device: torch.device, largest: int, exact: bool = False, step: int | None = None
               ) -> GraphedBatches | None:
    """The module as graphs, or None (said in the log) when it cannot be captured: then it runs op by op."""
    try:
        return GraphedBatches(module, shapes, dtypes, device, largest, exact, step)
    except Exception as exc:  # a CPU synchronisation or an op that capture refuses: a slower path, not a failure
        log.warning("CUDA graphs unavailable for this engine (%s: %s); running it op by op", type(exc).__name__, exc)
        torch.cuda.synchronize(device)
        try:
            end_random_capture(device)
        except Exception as again:
            log.warning("after the failed capture, random ops on %s may fail (%s: %s)", device,
                        type(again).__name__, again)
        return None


def end_random_capture(device: torch.device) -> None:
    """A capture that failed leaves the device's random generator marked as capturing (torch clears the mark only
    at a capture's successful end), and every random op on the device then raises "Offset increment outside graph
    capture" (an H100, 2026-12-07: torch.randn after a capture refused a sync). A capture that succeeds clears it."""
    scratch = torch.zeros(1, device=device)
    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.Stream(device)):
        scratch.add_(1)
    torch.cuda.synchronize(device)
