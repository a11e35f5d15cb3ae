"""The OpenAI-compatible frontend (frontend/) with the official `openai` client, against a real tritonserver: each
endpoint's answer equals the Triton model's own for the same input (greedy), streamed and not; a client that
disconnects mid-stream frees its KV blocks; bad requests get OpenAI's error body with the right status."""
from __future__ import annotations

import asyncio
import base64
import json
import threading
import time

import numpy as np
import openai
import pytest
import tritonclient.grpc.aio as grpcclient
import uvicorn

from backends.server import free_port
from client.sdk import Client, generation_inputs
from frontend.app import create_app
from perf.llm import stream_one
from tests.conftest import encode, random_image, wav
from tests.integration.test_llm import metric


@pytest.fixture(scope="module")
def frontend(server, repository):
    port = free_port()
    config = uvicorn.Config(create_app(server.grpc_url, repository), host="127.0.0.1", port=port, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the frontend did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    running.should_exit = True
    thread.join(10)


@pytest.fixture
def api(frontend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0)


def direct(server, model: str, prompt: str, max_tokens: int, **options) -> str:
    """The model's greedy text for `prompt` (and `image=` for vlm) straight from Triton (gRPC stream)."""
    async def go():
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            return await stream_one(client, model, generation_inputs(grpcclient, prompt, max_tokens,
                                                                     temperature=0.0, **options))
        finally:
            await client.close()
    timing = asyncio.run(go())
    assert timing.error is None
    return timing.text


def test_models_lists_the_served_models_and_their_adapters(api):
    names = {m.id for m in api.models.list()}
    assert {"llm", "smollm2", "clip_text", "whisper", "smollm2:pirate"} <= names
    assert not any(n.startswith("llm:") for n in names)  # the tiny llm serves no adapters


def test_a_lora_adapter_is_a_model_id(api, server, repository):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Where is the treasure?"}]
    prompt = AutoTokenizer.from_pretrained(repository / "smollm2" / "1").apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    expected = direct(server, "smollm2", prompt, 16, lora_id="pirate")
    answer = api.chat.completions.create(model="smollm2:pirate", messages=messages, max_tokens=16, temperature=0)
    assert answer.choices[0].message.content == expected and answer.model == "smollm2:pirate"
    assert expected != direct(server, "smollm2", prompt, 16)  # the adapter changes the answer


def test_chat_equals_the_model_on_its_own_chat_template(api, server, repository):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is the sun?"}]
    prompt = AutoTokenizer.from_pretrained(repository / "smollm2" / "1").apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    expected = direct(server, "smollm2", prompt, 24)
    whole = api.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens > 10 and 0 < whole.usage.completion_tokens <= 24
    assert whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(api.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed in pieces
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_an_image_chat_equals_vlm_on_its_chat_template(api, server, repository):
    from transformers import AutoTokenizer

    photo = encode(random_image(150, 90, seed=7), "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    prompt = AutoTokenizer.from_pretrained(repository / "vlm" / "1").apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert prompt.count("<image>") == 1
    expected = direct(server, "vlm", prompt, 16, image=photo)
    assert expected
    whole = api.chat.completions.create(model="vlm", messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == expected
    chunks = api.chat.completions.create(model="vlm", messages=messages, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected


def test_completion_equals_the_model_streamed_and_not(api, server):
    expected = direct(server, "llm", "a photo of the cat", 12)
    whole = api.completions.create(model="llm", prompt="a photo of the cat", max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    streamed = api.completions.create(model="llm", prompt="a photo of the cat", max_tokens=12, temperature=0,
                                      stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_embeddings_equal_clip_text(api, server):
    texts = ["a photo of a cat", "dog"]
    with Client(server.grpc_url, "grpc") as client:
        expected = client.infer("clip_text", {"text": np.array([[t.encode()] for t in texts], dtype=object)},
                                ["text_embeds"])["text_embeds"]
    got = api.embeddings.create(model="clip_text", input=texts)  # the SDK asks for base64 and decodes it
    np.testing.assert_array_equal(np.array([d.embedding for d in got.data], np.float32), expected)
    floats = api.embeddings.create(model="clip_text", input=texts[0], encoding_format="float")
    np.testing.assert_array_equal(np.array(floats.data[0].embedding, np.float32), expected[0])


def test_transcription_and_translation_equal_whisper(api, server):
    audio = wav(np.random.default_rng(3).normal(0, 0.1, 16000 * 3).astype(np.float32), subtype="FLOAT")
    with Client(server.grpc_url, "grpc") as client:
        expected, _ = client.transcribe(audio, "en", "transcribe")
        translated, _ = client.transcribe(audio, None, "translate")
    assert api.audio.transcriptions.create(model="whisper", file=("clip.wav", audio), language="en").text == expected
    text = api.audio.transcriptions.create(model="whisper", file=("clip.wav", audio), language="en",
                                           response_format="text")
    assert text == expected
    assert api.audio.translations.create(model="whisper", file=("clip.wav", audio)).text == translated


def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(api, server):
    idle = metric(server, "llm_kv_blocks_total")
    stream = api.completions.create(model="llm", prompt="the " * 100, max_tokens=400, temperature=0, stream=True)
    next(iter(stream))
    deadline = time.monotonic() + 2  # the gauge is refreshed every few ms while the engine works
    while metric(server, "llm_kv_blocks_free") == idle and time.monotonic() < deadline:
        time.sleep(0.005)
    assert metric(server, "llm_kv_blocks_free") < idle  # the request holds blocks now
    stream.close()  # the connection goes: the frontend cancels the Triton stream
    deadline = time.monotonic() + 10
    while metric(server, "llm_kv_blocks_free") != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "llm_kv_blocks_free") == idle


def image_message(url: str) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "What is it?"}]}


IMAGE_MESSAGE = image_message("data:image/png;base64," + base64.b64encode(encode(random_image(20, 20))).decode())


@pytest.mark.parametrize("call, status, message", [
    (lambda api: api.completions.create(model="nope", prompt="hi"), 404, "the model `nope` does not exist"),
    (lambda api: api.completions.create(model="llm:pirate", prompt="hi"), 400, "serves no LoRA adapters"),
    (lambda api: api.completions.create(model="smollm2:nope", prompt="hi"), 400, "nope"),
    (lambda api: api.completions.create(model="llm", prompt="hi", n=2), 400, "only n=1 is supported"),
    (lambda api: api.completions.create(model="llm", prompt="hi", logprobs=2), 400, "logprobs"),
    (lambda api: api.completions.create(model="llm", prompt="", max_tokens=4), 400, "text_input is empty"),
    (lambda api: api.completions.create(model="llm", prompt="", max_tokens=4, stream=True), 400,
     "text_input is empty"),
    (lambda api: api.chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}]), 400,
     "has no chat template"),
    (lambda api: api.embeddings.create(model="llm", input="hi"), 400, "cannot serve embeddings"),
    (lambda api: api.chat.completions.create(model="smollm2", messages=[IMAGE_MESSAGE]), 400, "takes no images"),
    (lambda api: api.chat.completions.create(model="vlm", messages=[{"role": "user", "content": "hi"}]), 400,
     "takes exactly one image per request"),
    (lambda api: api.chat.completions.create(model="vlm", messages=[IMAGE_MESSAGE, IMAGE_MESSAGE]), 400,
     "(the messages hold 2)"),
    (lambda api: api.chat.completions.create(model="vlm", messages=[image_message("https://example.com/a.jpg")]),
     400, "only base64 data: URLs"),
    (lambda api: api.chat.completions.create(model="vlm", messages=[image_message("data:image/png;base64,!!")]),
     400, "not valid base64"),
    (lambda api: api.chat.completions.create(model="vlm", messages=[image_message("data:image/png;base64,aGk=")]),
     400, "invalid input"),
    (lambda api: api.completions.create(model="vlm", prompt="hi"), 400, "needs an image"),
    (lambda api: api.audio.transcriptions.create(model="whisper", file=("x.wav", b"not audio")), 400,
     "invalid input: audio bytes"),
    (lambda api: api.audio.transcriptions.create(model="whisper", file=("x.wav", b"x"), response_format="srt"), 400,
     "response_format 'srt'"),
])
def test_bad_requests_get_openai_errors_with_the_right_status(api, call, status, message):
    with pytest.raises(openai.APIStatusError) as info:
        call(api)
    assert info.value.status_code == status, info.value
    assert message in info.value.body["message"] and info.value.body["type"]


def test_an_oversized_body_is_refused_before_it_is_read(frontend):
    import http.client

    host, port = frontend.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/embeddings")
    connection.putheader("content-type", "application/json")
    connection.putheader("content-length", str(33 * 2**20))
    connection.endheaders()  # the body is never sent: the answer comes first
    response = connection.getresponse()
    assert response.status == 413 and "takes up to 32 MB" in json.loads(response.read())["error"]["message"]
    connection.close()
