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

    def update(self, gauges: dict[str, float] | None = None, totals: dict[str, int] | None = None) -> None:
        for name, value in (gauges or {}).items():
            self.metrics[name].set(value)
        for name, total in (totals or {}).items():
            if total > self.counted[name]:
                self.metrics[name].increment(total - self.counted[name])
                self.counted[name] = total

    def close(self) -> None:
        """Metrics before their families, as the python backend requires."""
        self.metrics.clear()
        self.families.clear()
