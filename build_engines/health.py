"""health: the deep health check probes call (backends/mm_health): no checkpoint, no weights, one config."""
from __future__ import annotations

from backends.core.health import HealthParams
from build_engines.common import BuildOptions
from build_engines.repository import PythonModelConfig, Tensor


def build_health(opts: BuildOptions) -> None:
    name = opts.model_name("health")
    opts.write(PythonModelConfig(
        name, "mm_health", [Tensor("fail", "BYTES", [1], optional=True)], [Tensor("status", "BYTES", [1])],
        opts.parameters(HealthParams, device=opts.device), max_batch_size=0, max_queue_delay_us=None, instances=1, kind="KIND_CPU"))
    print(f"{name}: deep health check (compute, NVML, engine heartbeats)")
