"""GPU utilisation during a measurement, from the server's own metrics (`nv_gpu_utilization`, which Triton exports
when its DCGM-based GPU metrics work), else from NVML (nvidia-ml-py) sampled beside it. The source is reported."""
from __future__ import annotations

import threading
import urllib.request


def server_gpu_utilization(metrics_url: str) -> float | None:
    """Mean `nv_gpu_utilization` over the server's GPUs (0..1), or None when the server exports none."""
    try:
        text = urllib.request.urlopen(metrics_url, timeout=2).read().decode()
    except OSError:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("nv_gpu_utilization{")]
    return sum(values) / len(values) if values else None


def _nvml_reader():
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no NVML library, no driver, no GPU
        return None
    return lambda: sum(pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles) / len(handles) / 100


class GpuUtilization:
    """`with GpuUtilization(server.metrics_url) as gpu: ...` then `gpu.mean` (0..1 or None) and `gpu.source`."""

    def __init__(self, metrics_url: str, period_s: float = 0.25):
        self.metrics_url, self.period_s = metrics_url, period_s
        self.samples: list[float] = []
        self.source: str | None = None
        self._stop = threading.Event()

    def __enter__(self) -> GpuUtilization:
        if server_gpu_utilization(self.metrics_url) is not None:
            self.source, read = "server metrics (nv_gpu_utilization)", lambda: server_gpu_utilization(self.metrics_url)
        elif (nvml := _nvml_reader()) is not None:
            self.source, read = "NVML", nvml
        else:
            return self
        self._thread = threading.Thread(target=self._sample, args=(read,), daemon=True)
        self._thread.start()
        return self

    def _sample(self, read) -> None:
        while not self._stop.wait(self.period_s):
            value = read()
            if value is not None:
                self.samples.append(value)

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self.source:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def served_device(config: dict) -> str:
    """"cuda" or "cpu": where a served model's (first) instance group runs, from its config as JSON."""
    return "cuda" if config["instance_group"][0]["kind"] == "KIND_GPU" else "cpu"
