"""Engine statistics as Triton custom metrics, served on the metrics port beside Triton's own."""
from __future__ import annotations


class CustomMetrics:
    """Gauges set to a value, counters advanced to an engine's running total (by the difference since the last
    update, as Prometheus counters only go up)."""

    def __init__(self, pb, labels: dict[str, str], gauges: dict[str, str], counters: dict[str, str]):
        # a family must outlive its metrics: keep both
        self.families = {name: pb.MetricFamily(name, doc, pb.MetricFamily.GAUGE) for name, doc in gauges.items()}
        self.families.update({name: pb.MetricFamily(name, doc, pb.MetricFamily.COUNTER)
                              for name, doc in counters.items()})
        self.metrics = {name: family.Metric(labels) for name, family in self.families.items()}
        self.counted = dict.fromkeys(counters, 0)
        self.shown: dict[str, float] = {}  # gauges' last values set

    def update(self, gauges: dict[str, float] | None = None, totals: dict[str, float] | None = None) -> None:
        """Only what changed: each call is a round trip to the server that holds the GIL, and an idle model that
        keeps making them can be caught in one when Triton unloads it (a hang seen on 2.51)."""
        for name, value in (gauges or {}).items():
            if self.shown.get(name) != value:
                self.metrics[name].set(value)
                self.shown[name] = value
        for name, total in (totals or {}).items():
            if total > self.counted[name]:
                self.metrics[name].increment(total - self.counted[name])
                self.counted[name] = total

    def close(self) -> None:
        """Metrics before their families, as the python backend requires."""
        self.metrics.clear()
        self.families.clear()


class RequestHistograms:
    """Request-level distributions Triton does not have for a streaming model, one observation per finished request:
    time to first token, the mean time between its tokens, and how many it generated."""

    BUCKETS = {
        "llm_time_to_first_token_seconds": ("arrival to first token, per request",
                                            [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]),
        "llm_inter_token_latency_seconds": ("mean time between a request's tokens, per request",
                                            [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1]),
        "llm_output_tokens": ("tokens generated, per request", [1, 4, 16, 64, 256, 1024, 4096, 16384]),
    }

    def __init__(self, pb, labels: dict[str, str]):
        self.families = {name: pb.MetricFamily(name, doc, pb.MetricFamily.HISTOGRAM)
                         for name, (doc, _) in self.BUCKETS.items()}
        self.metrics = {name: family.Metric(labels, buckets=self.BUCKETS[name][1])
                        for name, family in self.families.items()}

    def observe(self, ttft_s: float, itl_s: float | None, tokens: int) -> None:
        self.metrics["llm_time_to_first_token_seconds"].observe(ttft_s)
        if itl_s is not None:  # one token has no gap
            self.metrics["llm_inter_token_latency_seconds"].observe(itl_s)
        self.metrics["llm_output_tokens"].observe(tokens)

    def close(self) -> None:
        self.metrics.clear()
        self.families.clear()


class QosMetrics:
    """Per-class QoS series (label `qos_class`): queue depth, admitted, refused by reason, and as histograms the wait
    from arrival to start and the latency from arrival to end (in the model: Triton's queue before it not counted)."""

    WAIT_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]

    def __init__(self, pb, labels: dict[str, str], classes: tuple[str, ...], reasons: tuple[str, ...]):
        self.families = [
            depth := pb.MetricFamily("qos_queue_depth", "requests waiting to start, per QoS class",
                                     pb.MetricFamily.GAUGE),
            admitted := pb.MetricFamily("qos_admitted_total", "requests started, per QoS class",
                                        pb.MetricFamily.COUNTER),
            rejected := pb.MetricFamily("qos_rejected_total", "requests refused (UNAVAILABLE), per QoS class and reason",
                                        pb.MetricFamily.COUNTER),
            wait := pb.MetricFamily("qos_wait_seconds", "time from arrival to start, per QoS class",
                                    pb.MetricFamily.HISTOGRAM),
            latency := pb.MetricFamily("qos_request_seconds", "time from arrival to end of the requests that "
                                       "started, per QoS class", pb.MetricFamily.HISTOGRAM)]
        by_class = {c: {**labels, "qos_class": c} for c in classes}
        self.depth = {c: depth.Metric(by_class[c]) for c in classes}
        self.admitted = {c: admitted.Metric(by_class[c]) for c in classes}
        self.rejected = {(c, r): rejected.Metric({**by_class[c], "reason": r}) for c in classes for r in reasons}
        self.wait = {c: wait.Metric(by_class[c], buckets=self.WAIT_BUCKETS_S) for c in classes}
        self.latency = {c: latency.Metric(by_class[c], buckets=self.WAIT_BUCKETS_S) for c in classes}
        self.counted: dict = {}
        self.shown: dict[str, int] = {}  # depths last set

    def update(self, stats: dict) -> None:
        """`stats`: backends.core.qos.ClassStats by class (running totals, new waits and latencies: its `drain`)."""
        for c, s in stats.items():
            if self.shown.get(c) != s.queued:  # only what changed (see CustomMetrics.update)
                self.depth[c].set(s.queued)
                self.shown[c] = s.queued
            self._advance(self.admitted[c], s.admitted)
            for reason, total in s.rejected.items():
                self._advance(self.rejected[c, reason], total)
            for value in s.waits:
                self.wait[c].observe(value)
            for value in s.latencies:
                self.latency[c].observe(value)

    def _advance(self, counter, total: int) -> None:
        done = self.counted.get(id(counter), 0)
        if total > done:
            counter.increment(total - done)
            self.counted[id(counter)] = total

    def close(self) -> None:
        for series in (self.depth, self.admitted, self.rejected, self.wait, self.latency):
            series.clear()
        self.families.clear()
