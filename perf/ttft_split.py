"""Where a served stream's time to first token goes, stage by stage.

Joins, by request id, what perf/llm.py saw (when it sent the request, when the first token arrived), Triton's trace of
the request (level TIMESTAMPS: the frontend and the queue up to `execute`) and the LLM engine's spans
(backends.core.spans: after `execute`). All three are CLOCK_MONOTONIC (time.perf_counter on Linux), so the stages
are differences of one clock. Only the requests Triton traced (every `trace_rate`-th) are counted.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from backends.core.spans import read_spans
from client.timeline import triton_traces
from perf.llm import StreamTiming

TRACE_RATE = 8  # one request in 8 traced: enough for the p90s, little cost to the load measured

# (stage, from, to): ("client", "sent" | "first"), ("triton", a trace timestamp) or ("engine", a span)
STAGES = (("client to Triton", ("client", "sent"), ("triton", "REQUEST_START")),
          ("Triton's queue", ("triton", "REQUEST_START"), ("triton", "COMPUTE_START")),
          ("execute", ("triton", "COMPUTE_START"), ("engine", "queued")),
          ("waiting for the engine loop", ("engine", "queued"), ("engine", "admitted")),
          ("admitted to first token", ("engine", "admitted"), ("engine", "first_token")),
          ("first token to client", ("engine", "first_token"), ("client", "first")))


def stage_ms(timings: list[StreamTiming], trace_file: Path) -> dict[str, np.ndarray]:
    """Each stage's milliseconds over the requests of `timings` that Triton traced and the engine logged."""
    traces = {t["request_id"]: dict(t["timestamps"]) for t in triton_traces(trace_file).values()
              if "request_id" in t and "parent_id" not in t}
    spans = {s["request_id"]: s["spans"] for s in read_spans(trace_file)}
    rows = []
    for timing in timings:
        if timing.request_id not in traces or timing.request_id not in spans or not timing.arrivals:
            continue
        times = {"client": {"sent": timing.sent * 1e9, "first": timing.arrivals[0] * 1e9},
                 "triton": traces[timing.request_id], "engine": spans[timing.request_id]}
        rows.append([times[b[0]][b[1]] - times[a[0]][a[1]] for _, a, b in STAGES])
    values = np.array(rows, dtype=float).reshape(-1, len(STAGES)) / 1e6
    return {name: values[:, i] for i, (name, _, _) in enumerate(STAGES)}


def describe(stages: dict[str, np.ndarray], slowest: bool = False) -> str | None:
    """One sentence for a results table's notes; None when no request was traced. `slowest`: also the stages of the
    traced request whose TTFT was longest (where a tail comes from)."""
    count = len(next(iter(stages.values())))
    if not count:
        return None
    parts = "; ".join(f"{name} {np.percentile(ms, 50):.1f} / {np.percentile(ms, 90):.1f}"
                      for name, ms in stages.items())
    total = sum(stages.values())
    text = (f"TTFT by stage (perf.ttft_split, {count} traced requests), ms p50 / p90: {parts}; all of them "
            f"{np.percentile(total, 50):.1f} / {np.percentile(total, 90):.1f}")
    if slowest:
        worst = int(np.argmax(total))
        text += f"; the slowest, {total[worst]:.1f}: " + "; ".join(f"{name} {ms[worst]:.1f}"
                                                                    for name, ms in stages.items())
    return text + "."
