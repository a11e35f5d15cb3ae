"""What the OpenAI frontend asks tritonserver, over async gRPC: which models are ready and what they take, one
request, or one streamed generation (cancelled with the caller: a client that goes away frees the Triton request).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from client.sdk import infer_inputs
from frontend.errors import OpenAIError, from_triton


@dataclass(frozen=True)
class ServedModel:
    """A ready model and the OpenAI endpoints it can answer, from its config's tensors."""

    name: str
    inputs: frozenset[str]
    outputs: frozenset[str]

    @property
    def generates(self) -> bool:  # llm, smollm2, vlm: tensorrtllm_backend's generation tensors
        return "text_input" in self.inputs and "text_output" in self.outputs

    @property
    def sees_images(self) -> bool:  # vlm: one encoded image with the prompt
        return self.generates and "image" in self.inputs

    @property
    def takes_adapters(self) -> bool:
        return self.generates and "lora_action" in self.inputs

    @property
    def embeds_text(self) -> bool:
        return self.inputs == {"text"} and "text_embeds" in self.outputs

    @property
    def transcribes(self) -> bool:
        return "audio" in self.inputs and "text" in self.outputs


class Triton:
    def __init__(self, url: str, models_ttl_s: float = 2.0):
        self.client = grpcclient.InferenceServerClient(url)
        self.models_ttl_s = models_ttl_s
        self._models: tuple[float, list[ServedModel]] = (-math.inf, [])  # (when listed, the list)

    async def close(self) -> None:
        await self.client.close()

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready()
        except InferenceServerException:
            return False

    async def models(self) -> list[ServedModel]:
        """Ready models, in the repository's order (listed again after `models_ttl_s`: a model loaded or unloaded
        shows within that time, and requests do not each pay for the listing)."""
        listed, models = self._models
        if time.monotonic() - listed < self.models_ttl_s:
            return models
        try:
            index = await self.client.get_model_repository_index(as_json=True)
            served = []
            for entry in index.get("models", []):
                if entry.get("state") != "READY":
                    continue
                config = (await self.client.get_model_config(entry["name"], as_json=True))["config"]
                served.append(ServedModel(entry["name"], frozenset(t["name"] for t in config.get("input", [])),
                                          frozenset(t["name"] for t in config.get("output", []))))
            self._models = (time.monotonic(), served)
            return served
        except InferenceServerException as e:
            raise from_triton(e) from None

    async def model(self, name: str, can: str, what: str) -> ServedModel:
        """The ready model `name`, which must have the property `can` (404 otherwise, saying why)."""
        for model in await self.models():
            if model.name == name:
                if not getattr(model, can):
                    raise OpenAIError(400, f"the model `{name}` cannot serve {what}", "model")
                return model
        raise OpenAIError(404, f"the model `{name}` does not exist or is not ready", "model", "model_not_found")

    async def adapters(self, model: ServedModel) -> list[str]:
        """The LoRA adapters a generating model can serve (loaded or in its adapter root, not unloaded)."""
        if not model.takes_adapters:
            return []
        try:
            listing = json.loads("".join([text async for text in self.generate(
                model.name, {"lora_action": np.array([b"list"], np.object_)})]))
        except OpenAIError:  # e.g. built without adapters (max_loras 0)
            return []
        names = [a["name"] for a in listing["loaded"]] + listing["available"]
        return [n for n in names if n not in listing["unloaded"]]

    async def infer(self, model: str, arrays: dict[str, np.ndarray], outputs: list[str],
                    parameters: dict | None = None) -> dict[str, np.ndarray]:
        inputs = infer_inputs(grpcclient, arrays)
        try:
            result = await self.client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(o)
                                                                     for o in outputs], parameters=parameters)
        except InferenceServerException as e:
            raise from_triton(e) from None
        return {name: result.as_numpy(name) for name in outputs}

    async def generate(self, model: str, arrays: dict[str, np.ndarray],
                       parameters: dict | None = None) -> AsyncIterator[str]:
        """The text deltas of one streamed generation. Deltas that arrived while the caller was busy come merged
        into one (under load the frontend then writes one event for several tokens, as Triton's own outbox merges
        its sends). Leaving the loop early (the HTTP client went away) cancels the gRPC stream, and with it the
        request in Triton."""
        inputs = infer_inputs(grpcclient, arrays)
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex,
                   "enable_empty_final_response": True, "parameters": parameters}
            await finished.wait()  # the stream stays open until the final response

        stream = self.client.stream_infer(requests())
        received: asyncio.Queue[str | Exception | None] = asyncio.Queue()  # None: the final response

        async def read() -> None:
            try:
                async for result, error in stream:
                    if error is not None:
                        raise from_triton(error)
                    response = result.get_response()
                    text = text_output(response)
                    if text:
                        received.put_nowait(text)
                    if response.parameters["triton_final_response"].bool_param:
                        finished.set()  # the request iterator ends, the server closes the stream
                        break
            except Exception as e:  # handed to the consumer, which raises it
                received.put_nowait(e)
            received.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                items = [await received.get()]
                while not received.empty():
                    items.append(received.get_nowait())
                texts = [i for i in items if isinstance(i, str)]
                if texts:
                    yield "".join(texts)
                for item in items:
                    if isinstance(item, Exception):
                        raise item
                if items[-1] is None:
                    return
        finally:
            if not finished.is_set():  # left early (the HTTP client went away, or an error): Triton cancels it
                finished.set()
                stream.cancel()
            reader.cancel()


def text_output(response) -> str:
    """`text_output` of a streamed response, read from the protobuf (a BYTES [1] tensor: a 4-byte length, then
    UTF-8), without building numpy arrays for each token."""
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.name == "text_output":
            return raw[4:].decode("utf-8", errors="replace")
    return ""
