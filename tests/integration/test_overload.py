"""Overload (issue 21): many times what a model can serve, at once, against a bounded queue: Triton's dynamic
batcher's (`--max-queue-size`) and our batcher's (`--batch-window adaptive`, `qos_max_queued` per class). Requests
beyond it are refused at once with UNAVAILABLE, every accepted request completes, none waits without bound, and the
server serves normally afterwards. (The LLM engines bound their queues per QoS class: tests/integration/test_qos.py;
`make stress` runs four times capacity for longer, with memory: perf.overload.)"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from backends.server import TritonServer, free_port
from tests.conftest import ROOT, build_engines, encode, random_image

IMAGE = encode(random_image(64, 48))


def infer(url: str, model: str = "vit") -> tuple[float, str | None]:
    """(seconds, None or the error's status and message)."""
    client = httpclient.InferenceServerClient(url, connection_timeout=60, network_timeout=60)
    tensor = httpclient.InferInput("image", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[IMAGE]], dtype=np.object_))
    start = time.monotonic()
    try:
        client.infer(model, [tensor])
        return time.monotonic() - start, None
    except InferenceServerException as e:
        return time.monotonic() - start, f"{e.status()} {e.message()}"
    except Exception as e:  # the connection itself failed (a server restarting)
        return time.monotonic() - start, f"{type(e).__name__}: {e}"
    finally:
        client.close()


def test_overload_is_refused_at_once_and_accepted_requests_complete(vit_checkpoint, tmp_path):
    repository = tmp_path / "repository"
    common = ["vit", "--checkpoint", str(vit_checkpoint), "--repository", str(repository), "--max-batch-size", "4"]
    assert build_engines([*common, "--max-queue-size", "8"]) == 0
    assert build_engines([*common, "--name", "vit_ours", "--batch-window", "adaptive",
                          "--qos-max-queued", "high=8,normal=8,low=8"]) == 0
    refusals = {"vit": "maximum queue size", "vit_ours": "the server is overloaded, retry later"}
    with TritonServer(repository, free_port(), free_port(), free_port(), ROOT / "logs" / "test-overload.log") as s:
        for model, refusal in refusals.items():
            with ThreadPoolExecutor(64) as pool:  # 64 requests at once against a queue of 8 and batches of 4
                results = list(pool.map(lambda _: infer(s.http_url, model), range(256)))
            refused = [(t, e) for t, e in results if e is not None]
            served = [t for t, e in results if e is None]
            assert refused and served, (model, results[:4])
            assert all(e.startswith("503") and refusal in e for _, e in refused), (model, refused[:3])
            assert max(t for t, _ in refused) < 2.0, model  # refused at once, not after waiting
            assert max(served) < 30.0, model  # nobody waits without bound
            assert infer(s.http_url, model)[1] is None  # and the server serves on
