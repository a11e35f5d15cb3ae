"""SAM throughput: the encoder path (every request a new image: the embedding cache is turned off by a config
override) and the decoder path (clicks on an image already embedded: cache hits; the masks as bool pixels, then as
COCO run lengths, `mask_format` "rle", then as packed bits, "packed") vs concurrency through the served
`sam` (perf_analyzer, gRPC), the bool masks again with the responses sent by the batcher's own thread
(`response_threads` 0), beside the engine in process on the same inputs in the same run, and what a cache hit
saves: the in-process latency of a first click (encoder + decoder) over a second click (decoder only). --py-spy:
the stub recorded from the start of the first (bool masks) sweep; --response-threads N..: the bool masks again with
N threads answering (the model reloaded).

python -m perf.sam_bench [--repository model_repository] [--concurrency 1 4 16] [--host NAME]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from backends.server import TritonServer, free_port
from perf.analyzer import sweep
from perf.gpu import served_device
from perf.inputs import bytes_entry, encoded_images
from perf.llm_scenarios import reload_with
from perf.report import bench_arguments, hardware_line, write_table
from perf.server_metrics import model_metrics
from perf.stub_profile import add_arguments as add_profile_arguments, stub_profile

IMAGES = [(640, 480, "JPEG"), (1280, 720, "JPEG"), (1024, 1024, "JPEG"), (800, 1200, "JPEG")]


def write_input_data(path: Path, images: list[bytes], clicks: int, mask_format: str = "binary") -> Path:
    """`clicks` steps per image, each a different point inside it; perf_analyzer cycles through the steps."""
    rng = np.random.default_rng(0)
    steps = []
    for data, (width, height, _) in zip(images, IMAGES):
        for _ in range(clicks):
            point = [float(rng.uniform(0, width)), float(rng.uniform(0, height))]
            steps.append({"image": bytes_entry(data), "point_coords": {"content": point, "shape": [1, 2]},
                          "point_labels": {"content": [1], "shape": [1]},
                          "mask_format": {"content": [mask_format], "shape": [1]}})
    path.write_text(json.dumps({"data": steps}))
    return path


def in_process(folder: Path, images: list[bytes], device: str, repeats: int = 5, batch: int = 16
               ) -> dict[str, float]:
    """Median ms of a first click (no cache), of a further click (cache hit), and of `batch` clicks on the images
    (cached) as one `segment_batch`, in process."""
    from backends.sam.engine import Prompt, SamEngine, SamParams

    params = SamParams()  # the served model's graphs
    engine = SamEngine(folder, device=device, cache_mb=0, max_prompts=params.max_prompts,
                       graph_tokens=params.graph_tokens)
    cached = SamEngine(folder, device=device, max_prompts=params.max_prompts, graph_tokens=params.graph_tokens)
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
    prompts = [Prompt(images[i % len(images)], point + i, label) for i in range(batch)]
    times[f"batch of {batch} clicks"] = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        cached.segment_batch(prompts)
        times[f"batch of {batch} clicks"].append((time.perf_counter() - start) * 1e3)
    times[f"batch of {batch} clicks"].pop(0)
    return {name: statistics.median(values) for name, values in times.items()}


def answer_sizes(folder: Path, images: list[bytes], device: str) -> tuple[float, float, float]:
    """Mean KB of a click's masks over the images: as bool pixels (`masks`), packed bits (`masks_packed`) and the
    JSON run lengths `sam` sends with `mask_format` rle (`masks_rle`)."""
    from backends.sam.engine import Prompt, SamEngine

    engine = SamEngine(folder, device=device)
    point, label = np.array([[10.0, 10.0]], dtype=np.float32), np.array([1])
    binary, packed, rle = [], [], []
    for data in images:
        pixels, bits, runs = engine.segment_batch([Prompt(data, point, label, mask_format=f)
                                                   for f in ("binary", "packed", "rle")])
        binary.append(pixels.masks.nbytes)
        packed.append(bits.masks_packed.nbytes)
        rle.append(sum(len(json.dumps(mask)) for mask in runs.masks_rle))
    return statistics.mean(binary) / 1024, statistics.mean(packed) / 1024, statistics.mean(rle) / 1024


def batched(server) -> tuple[float, float]:
    """(requests, batches) our batcher has counted for `sam` so far."""
    totals = model_metrics(server.metrics_url, "sam")
    return totals.get("batcher_requests_total", 0.0), totals.get("batcher_batches_total", 0.0)


def mean_batch(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Requests per engine call between two `batched` readings."""
    return (after[0] - before[0]) / max(1.0, after[1] - before[1])


def rows_of(label: str, points) -> list[list]:
    return [[label, p.load, p.throughput, p.p50_us / 1e3, p.p99_us / 1e3,
             "-" if p.gpu_util is None else f"{100 * p.gpu_util:.0f}%"] for p in points]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.sam_bench", description=__doc__)
    add_profile_arguments(parser)
    parser.add_argument("--response-threads", type=int, nargs="*", default=[],
                        help="the bool-mask sweep again with the model reloaded with each of these response_threads")
    args = bench_arguments(parser, 3000).parse_args(argv)
    images = encoded_images(IMAGES)
    folder = args.repository / "sam" / "1"
    engine_meta = json.loads((folder / "engine.json").read_text())
    precision = engine_meta["precision"]
    with tempfile.TemporaryDirectory() as tmp_name, TritonServer(
            args.repository, free_port(), free_port(), free_port(), Path("logs/bench-sam.log"),
            model_control="explicit", load_models=["sam"]) as server:
        tmp = Path(tmp_name)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        version = client.get_server_metadata(as_json=True)["version"]
        config = client.get_model_config("sam", as_json=True)["config"]
        device = served_device(config)
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        before = batched(server)
        with stub_profile(args, server, "sam"):
            points, _, notes = sweep("sam", server, write_input_data(tmp / "clicks.json", images, 8), tmp,
                                     "concurrency", args.concurrency, args.interval_ms)
        after = batched(server)
        per_call = mean_batch(before, after)
        rows = rows_of("decoder (clicks on embedded images)", points)
        points, _, lost = sweep("sam", server, write_input_data(tmp / "rle.json", images, 8, "rle"), tmp,
                                "concurrency", args.concurrency, args.interval_ms)
        rows, notes = rows + rows_of("decoder, masks as RLE (mask_format rle)", points), notes + lost
        points, _, lost = sweep("sam", server, write_input_data(tmp / "packed.json", images, 8, "packed"), tmp,
                                "concurrency", args.concurrency, args.interval_ms)
        rows, notes = rows + rows_of("decoder, masks as packed bits (mask_format packed)", points), notes + lost
        for threads in args.response_threads:
            reload_with(client, "sam", config, device, response_threads=str(threads))
            points, _, lost = sweep("sam", server, write_input_data(tmp / "clicks.json", images, 8), tmp,
                                    "concurrency", args.concurrency, args.interval_ms)
            rows, notes = rows + rows_of(f"decoder, answers on {threads} threads (response_threads {threads})",
                                         points), notes + lost
        # the responses made and sent by the batcher's own thread, as before response_threads
        reload_with(client, "sam", config, device, response_threads="0")
        before = batched(server)
        points, _, lost = sweep("sam", server, write_input_data(tmp / "clicks.json", images, 8), tmp,
                                "concurrency", args.concurrency, args.interval_ms)
        inline_per_call = mean_batch(before, batched(server))
        rows, notes = rows + rows_of("decoder, sent by the batcher's thread (response_threads 0)", points), \
            notes + lost
        reload_with(client, "sam", config, device, embedding_cache_mb="0")  # every request runs the encoder
        client.close()
        points, _, lost = sweep("sam", server, write_input_data(tmp / "images.json", images, 1), tmp,
                                "concurrency", args.concurrency, args.interval_ms)
        rows, notes = rows + rows_of("encoder (every request a new image)", points), notes + lost
    latency = in_process(folder, images, device)
    binary_kb, packed_kb, rle_kb = answer_sizes(folder, images, device)
    rows += [["in process, first click (encoder + decoder)", 1, 1e3 / latency["first click"],
              latency["first click"], "-", "-"],
             ["in process, second click (cache hit)", 1, 1e3 / latency["second click"], latency["second click"],
              "-", "-"],
             ["in process, 16 clicks on cached images in one batch", 16, 16e3 / latency["batch of 16 clicks"],
              latency["batch of 16 clicks"], "-", "-"]]
    notes = [f"Images: {', '.join(f'{w}x{h}' for w, h, _ in IMAGES)} JPEGs (photo-like); one foreground click per "
             "request. Decoder rows: 8 clicks per image cycled, the embeddings cached after the first round. Encoder "
             "rows: the model reloaded with `embedding_cache_mb` 0.",
             f"Model: {precision} {engine_meta['runtime']} engines (image encoder, prompt encoder + mask decoder) "
             f"from {Path(engine_meta['checkpoint']).name}, device {device}, one instance; batch_window "
             f"{params.get('batch_window', 'triton')}, up to {params.get('max_prompts', 1)} requests per engine call: "
             f"{per_call:.1f} on average over the first decoder rows (our batcher's counters), {inline_per_call:.1f} "
             f"with response_threads 0; otherwise responses made and sent on {params.get('response_threads', 0)} "
             "threads of their own.",
             "In-process batch: 16 clicks, 4 on each image, as one segment_batch (one decoder call: the clicks have "
             "one length, whatever their images' sizes).",
             f"A click's masks (3, at the image's size) take {binary_kb:.0f} KB as bool pixels, {packed_kb:.0f} KB "
             f"as packed bits and {rle_kb:.0f} KB as run lengths (mean over the images; the runs depend on how "
             "speckled the masks are); its low-res logits 768 KB (fp32).",
             f"A cache hit makes a click {latency['first click'] / latency['second click']:.1f}x faster in process "
             f"({latency['first click']:.1f} ms -> {latency['second click']:.1f} ms, median over "
             f"{len(images)} images x 5).", *notes]
    header = ["path", "concurrency", "requests/s", "latency p50 ms", "latency p99 ms", "GPU util"]
    print(write_table(args.results / args.host, "sam-throughput", header, rows, hardware_line(version), notes),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
