"""`clip`: score one image against N texts.

BLS rather than an ensemble: the N texts of one request must fan out as a batch of N to `clip_text` and the two
embeddings must meet in a scoring step. An ensemble would need two extra models (reshape and score) and a hop for
each; here the vision and text calls run concurrently and each still joins its own model's dynamic batcher.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np

from backends.errors import InvalidInput, is_client_error
from backends.triton_model import model_parameters


def similarity(image_embeds: np.ndarray, text_embeds: np.ndarray, logit_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """CLIP logits_per_image for one image (embeddings already L2-normalised) and their softmax over texts."""
    logits = logit_scale * (text_embeds @ image_embeds.reshape(-1))
    probs = np.exp(logits - logits.max())
    return logits.astype(np.float32), (probs / probs.sum()).astype(np.float32)


class ClipPipeline:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        params = model_parameters(json.loads(args["model_config"]))
        self.logit_scale = float(params["logit_scale"])
        self.text_batch = int(params.get("text_max_batch_size", 64))
        self.max_texts = int(params.get("max_texts", 1024))

    async def execute(self, requests: list) -> list:
        return list(await asyncio.gather(*(self.score(request) for request in requests)))

    async def score(self, request):
        pb = self.pb
        try:
            image = pb.get_input_tensor_by_name(request, "image").as_numpy().reshape(1, 1)
            texts = pb.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1, 1)
            if len(texts) == 0 or len(texts) > self.max_texts:
                raise InvalidInput(f"need 1 to {self.max_texts} texts, got {len(texts)}")
            calls = [self.call("clip_vision", "image", image, "image_embeds")]
            calls += [self.call("clip_text", "text", texts[i : i + self.text_batch], "text_embeds")
                      for i in range(0, len(texts), self.text_batch)]
            image_embeds, *text_chunks = await asyncio.gather(*calls)
        except InvalidInput as exc:
            return pb.InferenceResponse(error=pb.TritonError(str(exc), pb.TritonError.INVALID_ARG))
        except SubModelError as exc:
            return pb.InferenceResponse(error=pb.TritonError(str(exc), exc.code))
        scores, probs = similarity(image_embeds, np.concatenate(text_chunks), self.logit_scale)
        return pb.InferenceResponse([pb.Tensor("scores", scores), pb.Tensor("probs", probs)])

    async def call(self, model: str, input_name: str, data: np.ndarray, output_name: str) -> np.ndarray:
        pb = self.pb
        request = pb.InferenceRequest(model_name=model, requested_output_names=[output_name],
                                      inputs=[pb.Tensor(input_name, data)])
        response = await request.async_exec()
        if response.has_error():
            message = response.error().message()
            code = pb.TritonError.INVALID_ARG if is_client_error(message) else pb.TritonError.INTERNAL
            raise SubModelError(f"{model}: {message}", code)
        return pb.get_output_tensor_by_name(response, output_name).as_numpy()


class SubModelError(Exception):
    """A composing model's error, passed on with its code (INVALID_ARG stays INVALID_ARG)."""

    def __init__(self, message: str, code):
        super().__init__(message)
        self.code = code
