"""In-process baseline: the same encoder the Triton model runs, called directly with the same inputs and batch,
so a report can show Triton throughput / in-process throughput (the serving overhead) from one run."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backends.encoders import ImageEncoder, TextEncoder, prepare_requests


def in_process_throughput(version_dir: Path, params: dict[str, str], items: list[bytes], batch: int,
                          seconds: float = 3.0) -> float:
    """Items/s of prepare + infer over `batch`-sized groups cycling through `items`, for about `seconds`."""
    encoder = (TextEncoder if (version_dir / "tokenizer").exists() else ImageEncoder)(version_dir, params)
    pool = ThreadPoolExecutor(int(params.get("prepare_threads", 4)))  # as the Triton adapter does
    requests = [[items[i % len(items)]] for i in range(batch)]  # a dynamic batch of one-item requests
    encoder.infer(prepare_requests(encoder, pool, requests))  # warm-up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        encoder.infer(prepare_requests(encoder, pool, requests))
        done += batch
    return done / (time.perf_counter() - start)
