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
    `period_s`: gauges) and `watch.seconds`."""

    def __init__(self, metrics_url: str, model: str, period_s: float = 0.25):
        self.metrics_url, self.model, self.period_s = metrics_url, model, period_s
        self.readings: list[dict[str, float]] = []
        self.seconds = 0.0
        self._stop = threading.Event()

    def __enter__(self) -> MetricsWatch:
        self._start = time.monotonic()
        self.readings.append(model_metrics(self.metrics_url, self.model))
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        while not self._stop.wait(self.period_s):
            self.readings.append(model_metrics(self.metrics_url, self.model))

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()
        self.readings.append(model_metrics(self.metrics_url, self.model))
        self.seconds = time.monotonic() - self._start

    @property
    def growth(self) -> dict[str, float]:
        first = self.readings[0]
        return {name: value - first.get(name, 0.0) for name, value in self.readings[-1].items()}

    @property
    def mean(self) -> dict[str, float]:
        names = set().union(*self.readings)
        return {name: sum(r.get(name, 0.0) for r in self.readings) / len(self.readings) for name in names}
