"""Where an image encoder's batch spends its time, in one process: host reads (pool threads), decode, pixel tensors,
the engine op by op and from CUDA graphs. Milliseconds per batch, the device synchronised after each stage.

    python -m perf.encoder_stages --version-dir REPO/vit/1 --batch 16 64 [--on-device] [--image-set thumbnails]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from backends.vision.encoders import EncoderParams, ImageEncoder, prepare_requests, stack
from perf.inputs import IMAGE_SETS, model_items


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median milliseconds of `fn()` (the device synchronised), and its last result."""
    times, result = [], None
    for _ in range(repeats + 1):  # the first call warms up
        start = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:]), result


def profile(version_dir: Path, model: str, image_set: str, batch: int, on_device: bool, repeats: int,
            preprocessor_dir: Path | None) -> dict[str, float]:
    params = dataclasses.replace(EncoderParams(), preprocess_on_device=on_device, prepare_threads=16)
    graphed = ImageEncoder(version_dir, params, preprocessor_dir=preprocessor_dir)
    eager = ImageEncoder(version_dir, dataclasses.replace(params, cuda_graph_batch=0), preprocessor_dir=preprocessor_dir)
    items = (model_items(model, image_set) * batch)[:batch]
    pool = ThreadPoolExecutor(params.prepare_threads)
    read_ms, prepared = timed(lambda: prepare_requests(graphed, pool, [[x] for x in items]), repeats)
    flat = [x for request in prepared for x in request]
    stages = {"prepare (threads)": read_ms}
    if on_device:
        from backends.media.device_images import decode_on_device, pixel_values

        stages["decode on device"], decoded = timed(lambda: decode_on_device(flat, graphed.pixel_device), repeats)
        stages["pixel tensors"], pixels = timed(lambda: pixel_values(decoded, graphed.preprocess), repeats)
    else:
        stages["stack"], pixels = timed(lambda: stack(flat), repeats)
    stages["engine op by op"], _ = timed(lambda: eager.engine.run({"pixel_values": pixels}), repeats)
    stages["engine, CUDA graphs"], _ = timed(lambda: graphed.engine.run({"pixel_values": pixels}), repeats)
    stages["whole batch (infer)"], _ = timed(lambda: graphed.infer(prepare_requests(graphed, pool, [[x] for x in items])),
                                             repeats)
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version-dir", type=Path, required=True, help="the engine's version folder")
    parser.add_argument("--preprocessor-dir", type=Path, help="where preprocessor_config.json is, if not there")
    parser.add_argument("--model", default="vit")
    parser.add_argument("--image-set", default="thumbnails", choices=sorted(IMAGE_SETS))
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--on-device", action="store_true", help="decode and resize on the device")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"| batch | stage | ms per batch | images/s |\n|---|---|---|---|")
    for batch in args.batch:
        stages = profile(args.version_dir, args.model, args.image_set, batch, args.on_device, args.repeats,
                         args.preprocessor_dir)
        for name, ms in stages.items():
            print(f"| {batch} | {name} | {ms:.2f} | {batch / ms * 1e3:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
