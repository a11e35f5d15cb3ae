"""`mm_clip`: Triton backend for `clip`, one image scored against N texts.

BLS rather than an ensemble: the N texts of one request must fan out as a batch of N to `clip_text` and the two
embeddings must meet in a scoring step. An ensemble would need two extra models (reshape and score) and a hop for
each; here the vision and text calls run concurrently and each still joins its own model's dynamic batcher.
"""
from __future__ import annotations

import asyncio

import numpy as np

from backends.core.adapter import TritonBackend, inject
from backends.core.errors import InvalidInput, is_client_error
from backends.vision.clip import ClipParams, similarity


class SubModelError(Exception):
    """A composing model's error, passed on with its code (INVALID_ARG stays INVALID_ARG)."""

    def __init__(self, message: str, code):
        super().__init__(message)
        self.code = code


class TritonPythonModel(TritonBackend[ClipParams]):
    Params = ClipParams

    async def execute(self, requests: list) -> list:
        return list(await asyncio.gather(*(self.guarded_score(request) for request in requests)))

    async def guarded_score(self, request):
        try:
            return await self.score(request)
        except SubModelError as e:
            return self.pb.InferenceResponse(error=self.pb.TritonError(str(e), e.code))
        except Exception as e:
            return self.error_response(e)

    async def score(self, request):
        fault = self.check_parameters(request)
        inject(fault, "read")
        inputs = self.inputs(request)
        image = np.array([[inputs.blob("image", "encoded image")]], dtype=np.object_)
        texts = inputs.items("text")
        if not 0 < len(texts) <= self.params.max_texts:
            raise InvalidInput(f"need 1 to {self.params.max_texts} texts, got {len(texts)}")
        texts = np.array(texts, dtype=np.object_).reshape(-1, 1)
        step = self.params.text_max_batch_size
        calls = [self.call("clip_vision", "image", image, "image_embeds")]
        calls += [self.call("clip_text", "text", texts[i:i + step], "text_embeds") for i in range(0, len(texts), step)]
        image_embeds, *text_chunks = await asyncio.gather(*calls)
        inject(fault, "infer")
        scores, probs = similarity(image_embeds, np.concatenate(text_chunks), self.params.logit_scale)
        return self.pb.InferenceResponse([self.pb.Tensor("scores", scores), self.pb.Tensor("probs", probs)])

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
