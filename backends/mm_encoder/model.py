"""`mm_encoder`: Triton backend for the batched encoders — `vit` (image -> logits), `clip_vision` (image -> embedding)
and `clip_text` (text -> embedding). Which one a model runs follows from its config: an input named `text` gets the
CLIP text encoder, an input holding images the image encoder; the output is the config's first output.

Every item of every request of a dynamic batch is decoded and preprocessed on the instance's thread pool, each
request validated on its own, then all good requests go through the engine as one batch. In an ensemble
(`build_engines --ensemble`) an image encoder runs as two models of this backend: one whose output is
`pixel_values` only prepares images, one whose input is `pixel_values` only runs the engine. With
`preprocess_on_device` the pixel tensors are torch tensors on the device: they leave the preprocessing step through
DLPack and reach the encoder step on the GPU (its config sets FORCE_CPU_ONLY_INPUT_TENSORS "no").
"""
from __future__ import annotations

from typing import Any

import numpy as np

from backends.core.adapter import BatchedBackend
from backends.core.inputs import Inputs
from backends.vision.encoders import EncoderParams, ImageEncoder, TextEncoder

PIXELS = "pixel_values"  # the tensor between an ensemble's two steps


class TritonPythonModel(BatchedBackend[EncoderParams]):
    Params = EncoderParams

    def load(self) -> None:
        self.input_name = self.model_config["input"][0]["name"]
        self.output_name = self.model_config["output"][0]["name"]
        if self.input_name == "text":
            self.encoder = TextEncoder(self.folder, self.params, self.device)
            return
        stage = "encode" if self.input_name == PIXELS else "preprocess" if self.output_name == PIXELS else "whole"
        self.encoder = ImageEncoder(self.folder, self.params, self.device, stage)

    def inputs(self, request) -> Inputs:
        return super().inputs(request, on_device=self.input_name == PIXELS)  # pixel tensors stay where they came

    def read(self, inputs: Inputs) -> list[bytes] | list[np.ndarray]:
        if self.input_name != PIXELS:
            return inputs.items(self.input_name)
        pixels = inputs.array(PIXELS)
        if self.batcher is not None:  # used after `execute` returns, when Triton may reuse the input's buffer
            pixels = pixels.clone() if not isinstance(pixels, np.ndarray) else pixels.copy()
        return list(pixels)

    def prepare(self, item: bytes) -> Any:
        return self.encoder.prepare_item(item)

    def infer(self, batch: list[list[Any]]) -> list[np.ndarray]:
        return self.encoder.infer(batch)

    def respond(self, output: Any):
        if isinstance(output, np.ndarray):
            return self.pb.InferenceResponse([self.pb.Tensor(self.output_name, output.astype(np.float32))])
        if output.device.type == "cpu":  # torch, preprocessed on the CPU
            return self.pb.InferenceResponse([self.pb.Tensor(self.output_name, output.numpy())])
        return self.pb.InferenceResponse([self.pb.Tensor.from_dlpack(self.output_name, output.contiguous())])
