"""A model's series on tritonserver's metrics port (Prometheus text format), for benchmarks that report what the
engine did beside what the client saw."""
from __future__ import annotations

import threading
import time
import urllib.request


def model_metrics(metrics_url: str, model: str) -> dict[str, float]:
    """Each metric of `model` (its `model` label), summed over its other labels (classes, versions, buckets)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name, brace, rest = line.partition("{")
        if brace and not line.startswith("#") and f'model="{model}"' in rest:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def engine_steps(before: dict[str, float], after: dict[str, float], wall_s: float) -> str:
    """The LLM engine's steps between two readings (backends/mm_llm's llm_* counters), in words."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prefill, decode = delta("llm_prefill_steps_total"), delta("llm_decode_steps_total")
    prefill_s, decode_s = delta("llm_prefill_seconds_total"), delta("llm_decode_seconds_total")
    return (f"{delta('llm_prefill_tokens_total'):.0f} prompt tokens, {prefill:.0f} prefill steps (mean "
            f"{1e3 * prefill_s / max(prefill, 1):.1f} ms), {decode:.0f} decode steps, short prompts riding some "
            f"(mean {1e3 * decode_s / max(decode, 1):.1f} ms, batch "
            f"{delta('llm_decode_tokens_total') / max(decode, 1):.1f}); the engine stepped "
            f"{100 * (prefill_s + decode_s) / wall_s:.0f}% of {wall_s:.1f} s")


class MetricsWatch:
    """`with MetricsWatch(server.metrics_url, model) as watch: ...` then `watch.growth` (each series' last reading
    less its first: what counters counted meanwhile), `watch.mean` (each series' mean over readings every
    `period_s`: gauges) and `watch.seconds`, all over the span in which the model answered requests (from the last
    reading before its `progress` counter first grew to the first one after it last grew; the whole watch when it
    never grew): a client's start-up and wind-down would otherwise count as idle engine time. The default counts
    the answers of models under our batcher (Triton's nv_inference_request_success counts a request of theirs
    when `execute` returns, before its answer). With `until`, the span ends at the first reading after that counter
    last grew instead: e.g. `qos_admitted_total`, so that the engine draining its last requests after the client
    stopped (fewer at a time, so faster steps) is left out as well."""

    def __init__(self, metrics_url: str, model: str, period_s: float = 0.25,
                 progress: str = "qos_request_seconds_count", until: str | None = None):
        self.metrics_url, self.model, self.period_s, self.progress = metrics_url, model, period_s, progress
        self.until = until or progress
        self.readings: list[tuple[float, dict[str, float]]] = []  # (monotonic time, the model's series)
        self._stop = threading.Event()

    def __enter__(self) -> MetricsWatch:
        self._take()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _take(self) -> None:
        self.readings.append((time.monotonic(), model_metrics(self.metrics_url, self.model)))

    def _read(self) -> None:
        while not self._stop.wait(self.period_s):
            self._take()

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self._take()

    @property
    def span(self) -> list[tuple[float, dict[str, float]]]:
        """The readings from the last one before `progress` first grew to the first one after `until` last grew."""
        def grew(name: str) -> list[int]:
            counts = [reading.get(name, 0.0) for _, reading in self.readings]
            return [i for i in range(1, len(counts)) if counts[i] != counts[i - 1]]
        first, last = grew(self.progress), grew(self.until) or grew(self.progress)  # (`until` may not exist)
        return self.readings[first[0] - 1:last[-1] + 1] if first and last[-1] >= first[0] else self.readings

    @property
    def seconds(self) -> float:
        span = self.span
        return span[-1][0] - span[0][0]

    @property
    def growth(self) -> dict[str, float]:
        span = self.span
        first = span[0][1]
        return {name: value - first.get(name, 0.0) for name, value in span[-1][1].items()}

    @property
    def mean(self) -> dict[str, float]:
        readings = [reading for _, reading in self.span]
        names = set().union(*readings)
        return {name: sum(r.get(name, 0.0) for r in readings) / len(readings) for name in names}
