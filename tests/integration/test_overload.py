"""Overload (issue 21): many times what a model can serve, at once. The dynamic batcher's queue is bounded
(`--max-queue-size`, by default 16 batches): requests beyond it are refused at once with UNAVAILABLE, every accepted
request completes, none waits without bound, and the server serves normally afterwards. (The LLM engines bound
their queues per QoS class: tests/integration/test_qos.py.)"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backends.server import TritonServer, free_port
from tests.conftest import ROOT, build_engines, encode, random_image

IMAGE = encode(random_image(64, 48))


def infer(url: str) -> tuple[float, str | None]:
    """(seconds, None or the error's status and message)."""
    client = httpclient.InferenceServerClient(url, connection_timeout=60, network_timeout=60)
    tensor = httpclient.InferInput("image", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[IMAGE]], dtype=np.object_))
    start = time.monotonic()
    try:
        client.infer("vit", [tensor])
        return time.monotonic() - start, None
    except InferenceServerException as e:
        return time.monotonic() - start, f"{e.status()} {e.message()}"
    except Exception as e:  # the connection itself failed (a server restarting)
        return time.monotonic() - start, f"{type(e).__name__}: {e}"
    finally:
        client.close()


def test_overload_is_refused_at_once_and_accepted_requests_complete(vit_checkpoint, tmp_path):
    repository = tmp_path / "repository"
    assert build_engines(["vit", "--checkpoint", str(vit_checkpoint), "--repository", str(repository),
                          "--max-batch-size", "4", "--max-queue-size", "8"]) == 0
    with TritonServer(repository, free_port(), free_port(), free_port(), ROOT / "logs" / "test-overload.log") as s:
        with ThreadPoolExecutor(64) as pool:  # 64 requests at once against a queue of 8 and batches of 4
            results = list(pool.map(lambda _: infer(s.http_url), range(256)))
        refused = [(t, e) for t, e in results if e is not None]
        served = [t for t, e in results if e is None]
        assert refused and served, results[:4]
        assert all(e.startswith("503") and "maximum queue size" in e for _, e in refused), refused[:3]
        assert max(t for t, _ in refused) < 2.0  # refused at once, not after waiting
        assert max(served) < 30.0  # nobody waits without bound
        assert infer(s.http_url)[1] is None  # and the server serves on
