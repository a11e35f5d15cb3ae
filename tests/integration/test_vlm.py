"""The served `vlm` (image + prompt -> streamed text) against LlavaNextForConditionalGeneration greedy generate on
the same tiny checkpoint, image and prompt; placeholder handling and bad images."""
from __future__ import annotations

import asyncio
import io
import time

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
from PIL import Image

from client.sdk import generation_inputs
from perf.llm import stream_one
from tests.conftest import encode, random_image
from tests.integration.reference import llava_greedy


@pytest.fixture(scope="module")
def reference(llava_checkpoint):
    return llava_greedy(llava_checkpoint)


def ask(server, requests: list[tuple[bytes, str, int]], parameters: dict | None = None):
    async def go():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            calls = []
            for image, prompt, max_tokens in requests:
                inputs = generation_inputs(grpcclient, prompt, max_tokens)
                tensor = grpcclient.InferInput("image", [1], "BYTES")
                tensor.set_data_from_numpy(np.array([image], dtype=object))
                calls.append(stream_one(client, "vlm", [tensor, *inputs], parameters))
            return await asyncio.gather(*calls)
        finally:
            await client.close()
    return asyncio.run(go())


IMAGES = [encode(random_image(640, 480, seed=1)), encode(random_image(90, 400, seed=2), "JPEG"),
          encode(random_image(1200, 100, seed=3))]


def test_greedy_answers_equal_llava_next_for_concurrent_requests(server, reference):
    prompts = ["<image> a photo of the cat", "what is in <image> this", "<image>\nthe dog and the red car"]
    timings = ask(server, [(image, prompt, 16) for image, prompt in zip(IMAGES, prompts)])
    for image, prompt, timing in zip(IMAGES, prompts, timings):
        assert timing.error is None
        assert timing.text == reference(image, prompt, 16), prompt


def test_the_same_image_asked_again_shares_its_prefix_blocks(server, reference):
    from tests.integration.test_llm import metric

    image, prompts = encode(random_image(500, 300, seed=7)), ["<image> a photo of the cat", "<image> the red car"]
    hits = metric(server, "llm_prefix_cache_hit_tokens_total", "vlm")
    (first,) = ask(server, [(image, prompts[0], 12)])
    (second,) = ask(server, [(image, prompts[1], 12)])  # same image, another question: image blocks shared
    assert first.error is None and second.error is None
    assert [first.text, second.text] == [reference(image, p, 12) for p in prompts]
    assert metric(server, "llm_prefix_cache_hit_tokens_total", "vlm") - hits >= 16  # at least a block of image tokens


def test_prompt_without_placeholder_gets_the_image_first(server, reference):
    (timing,) = ask(server, [(IMAGES[0], "a photo of the cat", 12)])
    assert timing.error is None and timing.text == reference(IMAGES[0], "<image>\na photo of the cat", 12)


def test_a_qos_class_is_taken_and_counted(server, reference):
    from tests.integration.test_qos import metrics, value

    before = value(metrics(server), "qos_admitted_total", model="vlm", qos_class="low")
    (timing,) = ask(server, [(IMAGES[1], "<image> what is this", 8)], {"qos_class": "low"})
    assert timing.error is None and timing.text == reference(IMAGES[1], "<image> what is this", 8)
    deadline = time.monotonic() + 5  # metrics are set by the outbox thread, a few ms after the responses
    while value(metrics(server), "qos_admitted_total", model="vlm", qos_class="low") != before + 1:
        assert time.monotonic() < deadline, "the request was not counted in its class"
        time.sleep(0.02)


def test_bad_requests_are_refused_and_server_keeps_serving(server):
    bomb = io.BytesIO()
    Image.new("1", (50000, 50000)).save(bomb, "PNG")
    cases = [(IMAGES[0], "<image> and <image>", "2 image placeholders"), (b"not an image", "hi", "not a known image"),
             (bomb.getvalue(), "hi", "pixels"), (b"", "hi", "image is empty")]
    results = ask(server, [(image, prompt, 4) for image, prompt, _ in cases])
    for (_, _, message), timing in zip(cases, results):
        assert timing.error is not None and message in timing.error
    (good,) = ask(server, [(IMAGES[1], "cat", 4)])
    assert good.error is None and good.text
