"""In-process baseline: the same encoder the Triton model runs, called directly with the same inputs and batch,
so a report can show Triton throughput / in-process throughput (the serving overhead) from one run."""
from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backends.vision.encoders import EncoderParams, ImageEncoder, TextEncoder, prepare_requests


def in_process_throughput(version_dir: Path, params: EncoderParams, items: list[bytes], batch: int,
                          seconds: float = 3.0, preprocessor_dir: Path | None = None) -> float:
    """Items/s of prepare + infer over `batch`-sized groups cycling through all `items` (as perf_analyzer cycles
    through its input data), for about `seconds`. `preprocessor_dir`: an ensemble's preprocessing step, whose
    folder holds the image processor the engine's does not."""
    if (version_dir / "tokenizer").exists():
        encoder = TextEncoder(version_dir, params)
    else:
        encoder = ImageEncoder(version_dir, params, preprocessor_dir=preprocessor_dir)
    pool = ThreadPoolExecutor(params.prepare_threads)  # as the backend does
    stream = itertools.cycle(items)

    def next_batch() -> list[list[bytes]]:  # a dynamic batch of one-item requests
        return [[next(stream)] for _ in range(batch)]

    encoder.infer(prepare_requests(encoder, pool, next_batch()))  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or done < len(items):
        encoder.infer(prepare_requests(encoder, pool, next_batch()))
        done += batch
    return done / (time.perf_counter() - start)
