"""Deep health: what a probe needs to know beyond "the process answers" (Triton's /v2/health/*).

- compute: a matrix product with a known answer on the device (a GPU that returns wrong numbers or hangs fails it);
- gpu: NVML readings (pynvml) against thresholds: uncorrected ECC errors, temperature, hardware slowdown;
- engines: the age of every engine loop's heartbeat in this server (backends.core.heartbeat).
Each check gives ok plus what it saw; the report is healthy only if all are. Pure library: the `health` model
(backends/mm_health) serves it, the tests call it directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.core.heartbeat import ages
from backends.core.params import Parameters, bounded, device

CHECKS = ("compute", "gpu", "engines")
# NVML's clocks-event reasons that mean the GPU is protecting itself (not power capping or idling)
BAD_THROTTLE = {"hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80}


@dataclass(frozen=True)
class HealthParams(Parameters):
    """The `mm_health` backend's parameters."""

    device: str = device()  # where the compute check runs (auto: the GPU when there is one)
    matmul_size: int = bounded(512, 8, 8192)
    max_temperature_c: float = bounded(90.0, 0)
    max_ecc_errors: int = bounded(0, 0)  # uncorrected, volatile
    # an engine loop silent this long (after the allowance of the step it announced) is unhealthy
    heartbeat_timeout_s: float = bounded(0.75, 0, low_open=True)
    # the compute and NVML checks run at most this often (probes may come ten times a second; the heartbeats are
    # read on every one)
    device_check_interval_s: float = bounded(1.0, 0)


def check_compute(device_name: str, size: int) -> dict[str, Any]:
    """ones[size, size] @ arange[size] must be size * arange summed per row: exact in float32 for these sizes."""
    import torch

    from backends.core.devices import resolve_device

    dev = resolve_device(device_name)
    start = time.perf_counter()
    column = torch.arange(size, dtype=torch.float32, device=dev)
    product = torch.ones(size, size, device=dev) @ column
    expected = float(size * (size - 1) / 2)
    wrong = int((product != expected).sum().item())  # .item() waits for the device
    return {"ok": wrong == 0, "device": str(dev), "wrong_elements": wrong,
            "ms": round((time.perf_counter() - start) * 1e3, 2)}


def check_gpu(params: HealthParams, index: int = 0) -> dict[str, Any]:
    """NVML readings of GPU `index`; without NVML or a GPU there is nothing to check (ok, said so)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # no package, no driver, no GPU
        return {"ok": True, "skipped": f"NVML unavailable ({type(e).__name__})"}
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     pynvml.NVML_VOLATILE_ECC)
        except pynvml.NVMLError:  # ECC off or not supported
            ecc = 0
        reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        throttled = sorted(name for name, bit in BAD_THROTTLE.items() if reasons & bit)
        problems = [f"temperature {temperature} C > {params.max_temperature_c:g} C"] * \
            (temperature > params.max_temperature_c) + \
            [f"{ecc} uncorrected ECC errors > {params.max_ecc_errors}"] * (ecc > params.max_ecc_errors) + \
            [f"clocks held back: {', '.join(throttled)}"] * bool(throttled)
        return {"ok": not problems, "problems": problems, "temperature_c": temperature, "ecc_uncorrected": ecc,
                "memory_used_fraction": round(memory.used / memory.total, 3), "throttle": throttled}
    finally:
        pynvml.nvmlShutdown()


def check_engines(timeout_s: float, folder: Path | None = None) -> dict[str, Any]:
    loops = ages(folder)
    stale = sorted(name for name, age in loops.items() if age > timeout_s)
    return {"ok": not stale, "stale": stale,
            "heartbeat_age_s": {k: (round(v, 3) if v != float("inf") else "process gone") for k, v in loops.items()}}


def report(params: HealthParams, failing: str | None = None, folder: Path | None = None,
           recent: dict[str, tuple[float, dict]] | None = None) -> dict[str, Any]:
    """Every check; `failing` (fault injection in tests) names one that reports failure whatever it saw.
    `recent`: the caller's memory of the device checks' last results, reused within device_check_interval_s."""
    checks = {}
    for name, run in (("compute", lambda: check_compute(params.device, params.matmul_size)),
                      ("gpu", lambda: check_gpu(params)),
                      ("engines", lambda: check_engines(params.heartbeat_timeout_s, folder))):
        last = recent.get(name) if recent is not None else None
        if last is not None and time.monotonic() - last[0] < params.device_check_interval_s:
            checks[name] = {**last[1], "age_s": round(time.monotonic() - last[0], 3)}
        else:
            try:
                checks[name] = run()
            except Exception as e:  # a check that cannot run is a failed check, with the reason
                checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            if recent is not None and name != "engines":
                recent[name] = (time.monotonic(), checks[name])
        if name == failing:
            checks[name] = {**checks[name], "ok": False, "injected": True}
    return {"healthy": all(c["ok"] for c in checks.values()), "checks": checks}
