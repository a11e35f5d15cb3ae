"""QoS on the served `llm` (one batch slot, small class queues): a burst of heavy low-class requests does not hold
up a high-class one, a full class queue refuses at once with UNAVAILABLE and the reason, nothing hangs, the KV cache
goes back to idle, and the per-class metrics count what happened. The same for `whisper` in our own batcher."""
from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient

from backends.server import TritonServer, free_port
from build_engines.cli import main as build_engines
from client.sdk import generation_inputs
from perf.llm import stream_one
from tests.conftest import ROOT, encode, wav

HEAVY = "the cat sat on the red car by the tree " * 6
RNG = np.random.default_rng(17)


def built_server(tmp_path_factory, family: str, checkpoint, *flags: str, **server_options):
    """A server over a repository holding one `family` model built with `flags` (a fixture's body)."""
    repository = tmp_path_factory.mktemp(f"qos-{family}")
    assert build_engines([family, "--checkpoint", str(checkpoint), "--repository", str(repository), *flags]) == 0
    with TritonServer(repository, free_port(), free_port(), free_port(), ROOT / "logs" / f"test-qos-{family}.log",
                      **server_options) as running:
        yield running


@pytest.fixture(scope="module")
def server(tmp_path_factory, llm_checkpoint):
    yield from built_server(tmp_path_factory, "llm", llm_checkpoint, "--kv-cache-memory-mb", "16", "--max-batch", "1",
                            "--qos-max-queued", "high=4,normal=4,low=3")


def metrics(server) -> str:
    return urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()


def value(text: str, name: str, **labels: str) -> float:
    """The first series `name` whose labels include `labels`."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no series {name}{labels} in the metrics")


async def until(server, name: str, count: int, **labels: str) -> None:
    deadline = time.monotonic() + 10
    while value(metrics(server), name, **labels) < count:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {count}"
        await asyncio.sleep(0.005)


async def burst(server) -> tuple[list, object, object, object]:
    """Four heavy low-class requests (one runs, three wait: the low queue is full), then one more low one and a
    high one."""
    client = grpcclient.InferenceServerClient(server.grpc_url)

    def send(prompt: str, tokens: int, qos_class: str):
        inputs = generation_inputs(grpcclient, prompt, tokens, min_length=tokens)
        return asyncio.ensure_future(stream_one(client, "llm", inputs, {"qos_class": qos_class}))

    try:
        lows = [send(HEAVY, 400, "low")]
        await until(server, "llm_sequences_running", 1)
        lows += [send(HEAVY, 400, "low") for _ in range(3)]
        await until(server, "qos_queue_depth", 3, qos_class="low")
        refused = send("one more", 4, "low")
        high = send("urgent", 4, "high")
        unknown = send("urgent", 4, "urgent")
        results = await asyncio.wait_for(asyncio.gather(*lows, refused, high, unknown), timeout=120)
    finally:
        await client.close()
    return results[:4], results[4], results[5], results[6]


def test_under_a_burst_the_high_class_goes_first_and_a_full_queue_refuses_at_once(server):
    before = metrics(server)
    lows, refused, high, unknown = asyncio.run(burst(server))
    assert [t.error for t in lows] == [None] * 4 and high.error is None
    # the high request arrived last but ran as soon as the batch slot was free: before every low one still waiting
    assert high.ended < min(t.ended for t in lows[1:])
    assert refused.error and "the low queue is full (3 requests waiting)" in refused.error
    assert refused.ended - refused.sent < 0.05, "refused at once, not left to time out"
    assert unknown.error and "'qos_class' = 'urgent': expected one of ['high', 'normal', 'low']" in unknown.error
    deadline = time.monotonic() + 5  # the metrics are set a few ms after the last response
    while True:
        after = metrics(server)
        idle = value(after, "llm_kv_blocks_free") == value(after, "llm_kv_blocks_total")
        if idle and value(after, "qos_queue_depth", qos_class="low") == 0 and value(
                after, "qos_wait_seconds_count", qos_class="low") - value(before, "qos_wait_seconds_count",
                                                                          qos_class="low") == 4:
            break
        assert time.monotonic() < deadline, "KV blocks or the qos metrics never came back to idle"
        time.sleep(0.02)
    for name, labels, grew in (("qos_rejected_total", {"qos_class": "low", "reason": "queue_full"}, 1),
                               ("qos_admitted_total", {"qos_class": "low"}, 4),
                               ("qos_admitted_total", {"qos_class": "high"}, 1),
                               ("qos_wait_seconds_count", {"qos_class": "low"}, 4)):
        assert value(after, name, **labels) - value(before, name, **labels) == grew, (name, labels)
    # the lows that waited behind the running one show it in the histogram: some wait of at least 10 ms
    assert value(after, "qos_wait_seconds_bucket", qos_class="low", le="0.01") < value(
        after, "qos_wait_seconds_count", qos_class="low")


def test_the_server_keeps_serving_after_the_burst(server):
    async def one():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            return await stream_one(client, "llm", generation_inputs(grpcclient, "hello", 4), {"qos_class": "normal"})
        finally:
            await client.close()
    timing = asyncio.run(one())
    assert timing.error is None and timing.text
    assert re.search(r'qos_queue_depth\{.*qos_class="normal"', metrics(server))


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_client_sends_the_class_over_both_protocols(server, protocol):
    from client.sdk import Client

    before = value(metrics(server), "qos_admitted_total", qos_class="high")
    with Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol) as client:
        assert "".join(client.generate("hello", 4, qos_class="high"))
        with pytest.raises(Exception, match="expected one of"):
            "".join(client.generate("hello", 4, qos_class="urgent"))
    deadline = time.monotonic() + 5
    while value(metrics(server), "qos_admitted_total", qos_class="high") == before:
        assert time.monotonic() < deadline, "the request was not counted in the high class"
        time.sleep(0.02)


# --- whisper: our continuous batcher (4 decoder slots here: a long clip's chunks fill them), QoS by class and audio
# length ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def whisper_server(tmp_path_factory, whisper_checkpoint):
    yield from built_server(tmp_path_factory, "whisper", whisper_checkpoint, "--max-batch-size", "1", "--max-batch",
                            "4", "--batch-window", "adaptive", "--qos-max-queued", "high=2,normal=2,low=2",
                            model_control="explicit", load_models=["whisper"])


def infer_task(client, model: str, tensors: dict[str, np.ndarray], qos_class: str) -> asyncio.Future:
    """One request in the background; its result is (sent, ended, error)."""
    from tritonclient.utils import InferenceServerException, np_to_triton_dtype

    inputs = []
    for name, array in tensors.items():
        inputs.append(grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype)))
        inputs[-1].set_data_from_numpy(array)

    async def call():
        sent = time.perf_counter()
        try:
            await client.infer(model, inputs, parameters={"qos_class": qos_class})
            return sent, time.perf_counter(), None
        except InferenceServerException as e:
            return sent, time.perf_counter(), str(e)
    return asyncio.ensure_future(call())


async def heavy_burst(server, model: str, heavy: list[dict], light: dict,
                      running_s: float) -> tuple[list, object, object]:
    """Three heavy low-class requests (one runs, two wait: the low queue is full), then one more low one and a
    light high one. The first one has started `running_s` after the model started it (a large request takes a
    while to reach the engine on a busy machine) and still runs when the other two have arrived."""
    client = grpcclient.InferenceServerClient(server.grpc_url)

    async def taken() -> int:  # requests the model's `execute` has taken (admitted to our queue or refused)
        stats = await client.get_inference_statistics(model, as_json=True)
        return int(stats["model_stats"][0].get("inference_count", 0))

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + 30
        while not await condition():
            assert time.monotonic() < deadline, f"{model}: {what}"
            await asyncio.sleep(0.01)
    try:
        before = value(metrics(server), "qos_admitted_total", model=model, qos_class="low")
        count = await taken()
        lows = [infer_task(client, model, heavy[0], "low")]

        async def started() -> bool:
            return value(metrics(server), "qos_admitted_total", model=model, qos_class="low") > before
        await until(started, "never started the first request")
        await asyncio.sleep(running_s)
        lows += [infer_task(client, model, tensors, "low") for tensors in heavy[1:3]]

        async def queued() -> bool:  # both large requests arrived (a small one sent next must not overtake them)
            return await taken() >= count + 3
        await until(queued, "never took the second and third requests")
        refused, high = infer_task(client, model, light, "low"), infer_task(client, model, light, "high")
        results = await asyncio.wait_for(asyncio.gather(*lows, refused, high), timeout=120)
    finally:
        await client.close()
    return results[:3], results[3], results[4]


def check_burst(lows: list, refused, high) -> None:
    assert [error for *_, error in lows] == [None] * 3 and high[2] is None, (lows, high)
    assert high[1] < min(ended for _, ended, _ in lows[1:]), "the high request waited behind low ones queued first"
    assert refused[2] and "the low queue is full (2 requests waiting)" in refused[2]
    assert refused[1] - refused[0] < 0.05, "refused at once, not left to time out"


def test_whisper_serves_the_high_class_first_and_refuses_a_full_queue_at_once(whisper_server):
    long = wav(RNG.normal(0, 0.1, 16000 * 300).astype(np.float32))  # 300 s: 15 chunks, about 3 s here
    short = wav(RNG.normal(0, 0.1, 16000).astype(np.float32))
    check_burst(*asyncio.run(heavy_burst(whisper_server, "whisper", [{"audio": np.array([[long]], np.object_)}] * 3,
                                         {"audio": np.array([[short]], np.object_)}, running_s=1.0)))
    deadline = time.monotonic() + 5
    while value(after := metrics(whisper_server), "qos_admitted_total", model="whisper", qos_class="low") < 3:
        assert time.monotonic() < deadline, "the low clips were never counted"
        time.sleep(0.05)
    assert value(after, "qos_rejected_total", model="whisper", qos_class="low", reason="queue_full") == 1
    assert value(after, "qos_admitted_total", model="whisper", qos_class="high") == 1
    assert value(after, "qos_queue_depth", model="whisper", qos_class="low") == 0


def test_whisper_reloaded_in_place_keeps_serving_and_batches(whisper_server):
    """A config override reload (a fixed window, batches of 4) runs the new copy beside the old one; their metrics
    must not share series (Triton 2.51 crashed at the next update when the old copy deleted them). Requests sent
    together within the window run as fewer batches."""
    import json

    import tritonclient.grpc as grpc_sync

    client = grpc_sync.InferenceServerClient(whisper_server.grpc_url)
    config = client.get_model_config("whisper", as_json=True)["config"]
    config["max_batch_size"] = 4
    config["parameters"]["batch_window"] = {"string_value": "fixed"}
    config["parameters"]["batch_window_max_ms"] = {"string_value": "200"}
    config["parameters"]["qos_max_queued"] = {"string_value": "high=8,normal=8,low=8"}
    client.load_model("whisper", config=json.dumps(config))
    client.close()
    audio = np.array([[wav(RNG.normal(0, 0.1, 16000).astype(np.float32))]], dtype=np.object_)

    def one(_):
        with grpc_sync.InferenceServerClient(whisper_server.grpc_url) as own:
            tensor = grpc_sync.InferInput("audio", [1, 1], "BYTES")
            tensor.set_data_from_numpy(audio)
            return own.infer("whisper", [tensor]).as_numpy("text")

    with ThreadPoolExecutor(4) as pool:
        assert all(text is not None for text in pool.map(one, range(4)))
    deadline = time.monotonic() + 5  # the metrics are set just after the responses
    while True:
        series = {name: [float(line.rsplit(" ", 1)[1]) for line in metrics(whisper_server).splitlines()
                         if line.startswith(name + "{") and 'model="whisper"' in line]
                  for name in ("batcher_requests_total", "batcher_batches_total")}
        # the new copy's own series (the old copy's may linger until it is gone)
        if 4 in series["batcher_requests_total"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert 4 in series["batcher_requests_total"], series
    assert min(series["batcher_batches_total"]) < 4, series  # the four ran in fewer batches


# --- sam: our batcher as a QoS queue (one prompt per engine call), a new image costs its encoder run ----------
@pytest.fixture(scope="module")
def sam_server(tmp_path_factory, sam_checkpoint):
    yield from built_server(tmp_path_factory, "sam", sam_checkpoint, "--batch-window", "fixed",
                            "--batch-window-max-ms", "0", "--qos-max-queued", "high=2,normal=2,low=2")


def test_sam_serves_a_high_click_before_queued_new_images(sam_server):
    from perf.inputs import photo_like

    def click(image: bytes) -> dict:
        return {"image": np.array([image], np.object_), "point_coords": np.array([[10.0, 10.0]], np.float32),
                "point_labels": np.array([1], np.int32)}
    small = encode(photo_like(64, 48, 0), "JPEG")
    heavy = [click(encode(photo_like(6000, 4000, seed), "JPEG")) for seed in (1, 2, 3)]  # decoded by the engine

    async def warm():  # the small image's embedding is cached: clicking it again costs nothing in the score
        client = grpcclient.InferenceServerClient(sam_server.grpc_url)
        try:
            assert (await infer_task(client, "sam", click(small), "normal"))[2] is None
        finally:
            await client.close()
    asyncio.run(warm())
    check_burst(*asyncio.run(heavy_burst(sam_server, "sam", heavy, click(small), running_s=0.3)))
    deadline = time.monotonic() + 5
    while value(after := metrics(sam_server), "qos_admitted_total", model="sam", qos_class="low") < 3:
        assert time.monotonic() < deadline, "the low requests were never counted"
        time.sleep(0.05)
    assert value(after, "qos_rejected_total", model="sam", qos_class="low", reason="queue_full") == 1
