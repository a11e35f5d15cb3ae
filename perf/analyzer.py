"""Run the real perf_analyzer and read its CSV: throughput, latency percentiles, server-side breakdown."""
from __future__ import annotations

import csv
import dataclasses
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from perf.gpu import GpuUtilization
from perf.server_metrics import MetricsWatch

PERF_ANALYZER = Path(sys.prefix) / "bin" / "perf_analyzer"


@dataclass(frozen=True)
class LoadPoint:
    """One measured load level. Latencies in microseconds, as perf_analyzer reports them."""

    load: float  # concurrency or request rate (req/s)
    throughput: float  # inferences/s
    p50_us: int
    p90_us: int
    p99_us: int
    server_queue_us: int
    server_compute_input_us: int
    server_compute_infer_us: int
    server_compute_output_us: int
    # the client's side (perf_analyzer's averages): serialising a request, the wait on the network and the server
    # beyond the server's own figures above, deserialising the response
    client_send_us: int = 0
    network_server_us: int = 0
    client_recv_us: int = 0
    gpu_util: float | None = None  # mean over the run (0..1), set by the caller when it measured one
    watched: MetricsWatch | None = None  # the model's metrics over the run (sweep's `watch`)


class UnstableMeasurement(RuntimeError):
    """perf_analyzer found no stable window at this load (it exits non-zero and writes no CSV)."""


def parse_csv(path: Path) -> list[LoadPoint]:
    """perf_analyzer's `-f` CSV (with --verbose-csv), sorted by load (the file is sorted by throughput)."""
    points = []
    for row in csv.DictReader(path.open()):
        load = row.get("Concurrency") or row.get("Request Rate")
        if load is None:
            raise ValueError(f"{path}: no Concurrency or Request Rate column")
        points.append(LoadPoint(float(load), float(row["Inferences/Second"]), int(row["p50 latency"]),
                                int(row["p90 latency"]), int(row["p99 latency"]), int(row["Server Queue"]),
                                int(row["Server Compute Input"]), int(row["Server Compute Infer"]),
                                int(row["Server Compute Output"]), int(row.get("Client Send") or 0),
                                int(row.get("Network+Server Send/Recv") or 0), int(row.get("Client Recv") or 0)))
    return sorted(points, key=lambda p: p.load)


def run_perf_analyzer(model: str, url: str, input_data: Path, csv_path: Path, *, concurrency: str | None = None,
                      request_rate: str | None = None, protocol: str = "grpc", interval_ms: int = 2000,
                      extra: list[str] | None = None, timeout_s: float = 600) -> list[LoadPoint]:
    """One sweep: `concurrency="1:16:4"` or `request_rate="10:40:10"` (perf_analyzer's start:end:step)."""
    if (concurrency is None) == (request_rate is None):
        raise ValueError("give exactly one of concurrency or request_rate")
    sweep = ["--concurrency-range", concurrency] if concurrency else ["--request-rate-range", request_rate]
    cmd = [str(PERF_ANALYZER), "-m", model, "-u", url, "-i", protocol, "--input-data", str(input_data), *sweep,
           "--measurement-interval", str(interval_ms), "--stability-percentage", "100", "--max-trials", "6",
           "--percentile=99", "-f", str(csv_path), "--verbose-csv", *(extra or [])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if run.returncode != 0 and "Failed to obtain stable measurement" in run.stdout + run.stderr:
        raise UnstableMeasurement(f"{model}: no stable measurement at {concurrency or request_rate}")
    if run.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({run.returncode}): {' '.join(cmd)}\n{run.stdout[-3000:]}"
                           f"{run.stderr[-2000:]}")
    return parse_csv(csv_path)


def sweep(model: str, server, data: Path, tmp: Path, kind: str, levels: list[float], interval_ms: int,
          watch: bool = False, protocol: str = "grpc", extra: list[str] | None = None,
          watch_until: str | None = None) -> tuple[list[LoadPoint], str | None, list[str]]:
    """One perf_analyzer run per level (power-of-two sweeps; perf_analyzer's own ranges are linear), each with the
    mean GPU utilisation during it. Returns the points, where the utilisation came from (None: no GPU) and notes on
    levels left out because perf_analyzer found no stable measurement there. `watch`: each point also gets the
    model's metrics read over its run (what the engine did: steps and tokens counted, clips in its gauges;
    `watch_until`: MetricsWatch's `until`).
    `protocol`: perf_analyzer's, grpc or http; `extra`: more perf_analyzer arguments (e.g. --async)."""
    points, source, notes = [], None, []
    url = server.grpc_url if protocol == "grpc" else server.http_url
    for level in levels:
        value = f"{level:g}"
        args = {"concurrency": value} if kind == "concurrency" else {"request_rate": value}
        try:
            with GpuUtilization(server.metrics_url) as gpu, \
                    MetricsWatch(server.metrics_url, model, until=watch_until) if watch else nullcontext() as watched:
                (point,) = run_perf_analyzer(model, url, data, tmp / f"{model}-{kind}-{value}.csv",
                                             protocol=protocol, interval_ms=interval_ms, extra=extra, **args)
            point = dataclasses.replace(point, watched=watched)
        except UnstableMeasurement:
            notes.append(f"{kind} {value}: perf_analyzer found no stable measurement (6 trials); left out.")
            continue
        except RuntimeError as e:  # e.g. a load the client side cannot generate: said in the results, not hidden
            if "Failed to maintain requested inference load" not in str(e):
                raise
            said = [line for line in str(e).splitlines() if "rror" in line or "fail" in line.lower()]
            notes.append(f"{kind} {value}: perf_analyzer could not keep that load up (its worker threads' requests "
                         f"failed: {said[-1].strip()[:200] if said else 'no reason given'}); left out.")
            continue
        points.append(dataclasses.replace(point, gpu_util=gpu.mean))
        source = source or gpu.source
    return points, source, notes
