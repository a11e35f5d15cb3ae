"""Every backend's per-request error policy through the real server: a request that fails unexpectedly (a fault
injected at one stage) fails alone with INTERNAL while its neighbours, batched with it, succeed; non-UTF-8 or
undecodable bytes in any BYTES input of any model are INVALID_ARG naming the input; the committed configs are what
the builder writes."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from client.sdk import generation_arrays, infer_inputs
from tests.conftest import ROOT, encode, random_image, wav
from tests.integration.test_llm import metric

IMAGE = encode(random_image(64, 48))
AUDIO = wav(np.random.default_rng(0).normal(0, 0.1, 16000).astype(np.float32))
NOT_UTF8 = b"\xff\xfe\xfa not UTF-8 \xc3"


def column(*items: bytes) -> np.ndarray:
    return np.array([[x] for x in items], dtype=object)


# model -> (inputs of one good request, an output to ask for)
REQUESTS = {
    "vit": ({"image": column(IMAGE)}, "logits"),
    "clip_vision": ({"image": column(IMAGE)}, "image_embeds"),
    "clip_text": ({"text": column(b"a photo of a cat")}, "text_embeds"),
    "whisper": ({"audio": column(AUDIO), "max_tokens": np.array([[4]], np.int32)}, "text"),
    "clip": ({"image": np.array([IMAGE], dtype=object), "text": np.array([b"a cat", b"a dog"], dtype=object)},
             "scores"),
    "anyres": ({"image": np.array([IMAGE], dtype=object)}, "num_image_tokens"),
    "sam": ({"image": np.array([IMAGE], dtype=object), "point_coords": np.array([[10, 10]], np.float32),
             "point_labels": np.array([1], np.int32)}, "iou_scores"),
}
# Triton's dynamic batcher merges their requests; whisper's engine batches continuously (its own metrics show it)
BATCHED = ("vit", "clip_vision", "clip_text", "whisper")


def infer(server, model: str, inputs: dict | None = None, parameters: dict | None = None):
    """(output array, None) or (None, (HTTP status, message))."""
    inputs = inputs or REQUESTS[model][0]
    client = http.InferenceServerClient(server.http_url)
    try:
        result = client.infer(model, infer_inputs(http, inputs), parameters=parameters,
                              outputs=[http.InferRequestedOutput(REQUESTS[model][1])])
        return result.as_numpy(REQUESTS[model][1]), None
    except InferenceServerException as e:
        return None, (str(e.status()), e.message())
    finally:
        client.close()


def generate(server, model: str, arrays: dict[str, np.ndarray], parameters: dict | None = None):
    """(streamed text, error message or None) of one gRPC stream."""
    async def go():
        client = grpc_aio.InferenceServerClient(server.grpc_url)
        done, text = asyncio.Event(), []

        async def request():
            yield {"model_name": model, "inputs": infer_inputs(grpc_aio, arrays), "parameters": parameters,
                   "enable_empty_final_response": True}
            await done.wait()
        try:
            async for result, error in client.stream_infer(request()):
                if error is not None:
                    return "".join(text), str(error)
                output = result.as_numpy("text_output")
                if output is not None and output.size:
                    text.append(output.reshape(-1)[0].decode("utf-8", errors="replace"))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return "".join(text), None
        finally:
            done.set()
            await client.close()
    return asyncio.run(go())


def stats(model: str, server) -> tuple[int, int]:
    """(requests, engine batches) so far; for whisper (tokens fed, decoder steps)."""
    if model == "whisper":
        return (int(metric(server, "whisper_decode_tokens_total", "whisper")),
                int(metric(server, "whisper_decode_steps_total", "whisper")))
    client = http.InferenceServerClient(server.http_url)
    s = client.get_inference_statistics(model)["model_stats"][0]
    client.close()
    return int(s["inference_count"]), int(s["execution_count"])


@pytest.mark.parametrize("stage", ["read", "prepare", "infer"])
@pytest.mark.parametrize("model", BATCHED)
def test_an_unexpected_failure_fails_alone_in_its_dynamic_batch(server, model, stage):
    count, faulty = 16, 5
    before = stats(model, server)
    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(lambda i: infer(server, model, parameters={"inject_fault": stage} if i == faulty
                                                else None), range(count)))
    for i, (output, error) in enumerate(results):
        if i == faulty:
            assert error is not None and error[0] == "500", error  # INTERNAL
            assert f"{model} failed on this request (InjectedFault)" in error[1]
        else:
            assert error is None and output is not None and output.size > 0, error
    deadline = time.monotonic() + 10  # statistics are recorded after the responses went out
    while (after := stats(model, server))[0] - before[0] < count - 1:
        assert time.monotonic() < deadline, "the statistics never counted the requests"
        time.sleep(0.05)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    assert executions < inferences, f"not batched: {executions} executions for {inferences} inferences"


@pytest.mark.parametrize("model, stage", [("clip", "read"), ("clip", "infer"), ("anyres", "prepare"),
                                          ("sam", "read"), ("sam", "infer")])
def test_an_unexpected_failure_fails_alone_in_the_other_models(server, model, stage):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: infer(server, model, parameters={"inject_fault": stage} if i == 1
                                                else None), range(4)))
    assert [error is None for _, error in results] == [True, False, True, True]
    assert results[1][1][0] == "500" and "(InjectedFault)" in results[1][1][1]


@pytest.mark.parametrize("model, stage", [("llm", "read"), ("llm", "infer"), ("vlm", "prepare"), ("vlm", "infer")])
def test_an_unexpected_failure_ends_only_its_own_stream(server, model, stage):
    image = {"image": IMAGE} if model == "vlm" else {}
    arrays = generation_arrays("a photo of the cat", 6, **image)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: generate(server, model, arrays, {"inject_fault": stage} if i == 1
                                                   else None), range(4)))
    assert [error is None for _, error in results] == [True, False, True, True], results
    assert "(InjectedFault)" in results[1][1]
    assert len({text for text, _ in (results[0], results[2], results[3])}) == 1  # greedy: the same text


def test_a_sequence_whose_sampling_fails_ends_alone(server):
    """A sequence whose sampling raises (an injected fault) fails alone: its neighbours in the same engine steps
    stream on. A temperature so small it once overflowed the sampler to NaN (1e-40) is greedy decoding now."""
    good = generation_arrays("a photo of the cat", 16)
    tiny_temperature = generation_arrays("a photo of the cat", 16, temperature=1e-40)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: generate(server, "llm", job[0], job[1]),
                                [(good, None), (good, {"inject_fault": "sample"}), (tiny_temperature, None),
                                 (good, None)]))
    assert [error is None for _, error in results] == [True, False, True, True], results
    assert "llm failed on this request (InjectedFault)" in results[1][1]
    assert results[0][0] == results[2][0] == results[3][0] != ""


def utf8_cases():
    """(model, input, bytes, what the message must say) for every BYTES input of every model."""
    def text(model, name):
        return model, name, NOT_UTF8, f"{name} is not valid UTF-8"
    return [("vit", "image", NOT_UTF8, "not a known image format"),
            ("clip_vision", "image", NOT_UTF8, "not a known image format"),
            text("clip_text", "text"),
            ("clip", "image", NOT_UTF8, "not a known image format"),
            ("clip", "text", NOT_UTF8, "text is not valid UTF-8"),
            ("anyres", "image", NOT_UTF8, "not a known image format"),
            ("sam", "image", NOT_UTF8, "not a known image format"),
            ("whisper", "audio", NOT_UTF8, "not a readable audio file"),
            text("whisper", "language"), text("whisper", "task"),
            text("llm", "text_input"), text("llm", "stop"),
            text("vlm", "text_input"), text("vlm", "stop"), ("vlm", "image", NOT_UTF8, "not a known image format")]


@pytest.mark.parametrize("model, name, data, message", utf8_cases(), ids=[f"{c[0]}-{c[1]}" for c in utf8_cases()])
def test_undecodable_bytes_in_any_bytes_input_are_invalid_arg(server, model, name, data, message):
    if model in ("llm", "vlm"):
        arrays = generation_arrays("a cat", 4, stop=["x"], **({"image": IMAGE} if model == "vlm" else {}))
        arrays[name] = np.array([data], dtype=object)
        text, error = generate(server, model, arrays)
        assert error is not None and message in error, error
        text, error = generate(server, model, generation_arrays("a cat", 2, **({"image": IMAGE} if model == "vlm"
                                                                                else {})))
        assert error is None
        return
    inputs = dict(REQUESTS[model][0])
    shape = inputs.get(name, column(b"")).shape
    inputs[name] = np.full(shape, data, dtype=object)
    _, error = infer(server, model, inputs)
    assert error is not None and error[0] == "400" and message in error[1], error
    assert infer(server, model)[1] is None  # and the next good request is served


def test_committed_configs_are_what_the_builder_writes(repository):
    """The `repository` fixture ran the default build over model_repository/: its configs must equal git's."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    changed = subprocess.run(["git", "status", "--porcelain", "--", "model_repository"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    assert changed == "", f"the builder writes configs that differ from the committed ones:\n{changed}"
