"""SAM throughput: the encoder path (every request a new image: the embedding cache is turned off by a config
override) and the decoder path (clicks on an image already embedded: cache hits) vs concurrency through the served
`sam` (perf_analyzer, gRPC), beside the engine in process on the same inputs in the same run, and what a cache hit
saves: the in-process latency of a first click (encoder + decoder) over a second click (decoder only).

python -m perf.sam_bench [--repository model_repository] [--concurrency 1 4 16] [--host NAME]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from backends.server import TritonServer, free_port
from perf.analyzer import UnstableMeasurement, run_perf_analyzer
from perf.gpu import GpuUtilization
from perf.inputs import bytes_entry, encoded_images
from perf.llm_scenarios import wait_unloaded
from perf.report import hardware_line, write_table

IMAGES = [(640, 480, "JPEG"), (1280, 720, "JPEG"), (1024, 1024, "JPEG"), (800, 1200, "JPEG")]


def write_input_data(path: Path, images: list[bytes], clicks: int) -> Path:
    """`clicks` steps per image, each a different point inside it; perf_analyzer cycles through the steps."""
    rng = np.random.default_rng(0)
    steps = []
    for data, (width, height, _) in zip(images, IMAGES):
        for _ in range(clicks):
            point = [float(rng.uniform(0, width)), float(rng.uniform(0, height))]
            steps.append({"image": bytes_entry(data), "point_coords": {"content": point, "shape": [1, 2]},
                          "point_labels": {"content": [1], "shape": [1]}})
    path.write_text(json.dumps({"data": steps}))
    return path


def in_process(folder: Path, images: list[bytes], dtype: str, device: str, repeats: int = 5) -> dict[str, float]:
    """Median ms of a first click (no cache) and of a further click (cache hit), in process."""
    from backends.sam.engine import SamEngine

    engine = SamEngine(folder, dtype, device, cache_mb=0)
    cached = SamEngine(folder, dtype, device)
    point, label = np.array([[10.0, 10.0]], dtype=np.float32), np.array([1])
    times: dict[str, list[float]] = {"first click": [], "second click": []}
    for name, run in (("first click", lambda d: engine.segment(d, point, label)),
                      ("second click", lambda d: cached.segment(d, point, label))):
        for data in images:
            run(data)  # warm-up; fills `cached`
        for _ in range(repeats):
            for data in images:
                start = time.perf_counter()
                run(data)
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def sweep(server: TritonServer, data: Path, tmp: Path, label: str, concurrencies: list[int],
          interval_ms: int) -> tuple[list[list], list[str]]:
    rows, notes = [], []
    for concurrency in concurrencies:
        try:
            with GpuUtilization(server.metrics_url) as gpu:
                (point,) = run_perf_analyzer("sam", server.grpc_url, data, tmp / f"{label}-{concurrency}.csv",
                                             concurrency=str(concurrency), interval_ms=interval_ms)
        except UnstableMeasurement:
            notes.append(f"{label}, concurrency {concurrency}: no stable measurement; left out.")
            continue
        rows.append([label, concurrency, point.throughput, point.p50_us / 1e3, point.p99_us / 1e3,
                     "-" if gpu.mean is None else f"{100 * gpu.mean:.0f}%"])
        print(rows[-1], flush=True)
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.sam_bench", description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--interval-ms", type=int, default=3000)
    args = parser.parse_args(argv)
    images = encoded_images(IMAGES)
    folder = args.repository / "sam" / "1"
    precision = json.loads((folder / "engine.json").read_text())["precision"]
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp_name, TritonServer(
            args.repository, free_port(), free_port(), free_port(), Path("logs/bench-sam.log"),
            model_control="explicit", load_models=["sam"]) as server:
        tmp = Path(tmp_name)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        version = client.get_server_metadata(as_json=True)["version"]
        config = client.get_model_config("sam", as_json=True)["config"]
        device = "cuda" if config["instance_group"][0]["kind"] == "KIND_GPU" else "cpu"
        found, lost = sweep(server, write_input_data(tmp / "clicks.json", images, 8), tmp,
                            "decoder (clicks on embedded images)", args.concurrency, args.interval_ms)
        rows, notes = rows + found, notes + lost
        # every request runs the encoder. Unload first: Triton 2.51 aborts when a model with custom metrics is
        # reloaded in place (the new instance registers the same metric families while the old one still holds them)
        client.unload_model("sam")
        wait_unloaded(client, "sam", device)
        config["parameters"]["embedding_cache_mb"] = {"string_value": "0"}
        client.load_model("sam", config=json.dumps(config))
        client.close()
        found, lost = sweep(server, write_input_data(tmp / "images.json", images, 1), tmp,
                            "encoder (every request a new image)", args.concurrency, args.interval_ms)
        rows, notes = rows + found, notes + lost
    latency = in_process(folder, images, precision, device)
    rows += [["in process, first click (encoder + decoder)", 1, 1e3 / latency["first click"],
              latency["first click"], "-", "-"],
             ["in process, second click (cache hit)", 1, 1e3 / latency["second click"], latency["second click"],
              "-", "-"]]
    notes = [f"Images: {', '.join(f'{w}x{h}' for w, h, _ in IMAGES)} JPEGs (photo-like); one foreground click per "
             "request. Decoder rows: 8 clicks per image cycled, the embeddings cached after the first round. Encoder "
             "rows: the model reloaded with `embedding_cache_mb` 0.",
             f"Model: {precision} weights from {Path(json.loads((folder / 'engine.json').read_text())['checkpoint']).name}"
             f", device {device}, one instance, no dynamic batching (max_batch_size 0).",
             f"A cache hit makes a click {latency['first click'] / latency['second click']:.1f}x faster in process "
             f"({latency['first click']:.1f} ms -> {latency['second click']:.1f} ms, median over "
             f"{len(images)} images x 5).", *notes]
    header = ["path", "concurrency", "requests/s", "latency p50 ms", "latency p99 ms", "GPU util"]
    print(write_table(args.results / args.host, "sam-throughput", header, rows, hardware_line(version), notes),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
