"""Triton adapter for `anyres`: encoded image in, AnyRes tiles and the visual-token count out, one request at a time
(requests differ in tile count, so they do not batch); decoding and tiling run on the model's thread pool."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends.anyres import AnyResTiler, image_processor_config, tiler_from_checkpoint
from backends.errors import InvalidInput
from backends.images import ImagePreprocessor, decode_image
from backends.triton_model import model_parameters


class AnyResModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        folder = Path(args["model_repository"]) / args["model_version"]
        self.tiler: AnyResTiler = tiler_from_checkpoint(folder)
        self.preprocess = ImagePreprocessor.from_dict(image_processor_config(folder))
        params = model_parameters(json.loads(args["model_config"]))
        self.pool = ThreadPoolExecutor(int(params.get("prepare_threads") or 4))

    def tile(self, data: bytes) -> tuple[np.ndarray, int]:
        tiles, plan = self.tiler.tiles(decode_image(data), self.preprocess)
        return tiles, plan.num_image_tokens

    def execute(self, requests: list) -> list:
        images = [self.pb.get_input_tensor_by_name(r, "image").as_numpy().reshape(-1) for r in requests]
        futures = [self.pool.submit(self.tile, bytes(i[0])) if i.size == 1 else None for i in images]
        responses = []
        for future, image in zip(futures, images):
            try:
                if future is None:
                    raise InvalidInput(f"image must hold exactly one encoded image, got {image.size}")
                tiles, tokens = future.result()
            except InvalidInput as e:
                responses.append(self.pb.InferenceResponse(error=self.pb.TritonError(str(e),
                                                                                     self.pb.TritonError.INVALID_ARG)))
                continue
            responses.append(self.pb.InferenceResponse([
                self.pb.Tensor("pixel_values", tiles), self.pb.Tensor("num_image_tokens", np.array([tokens], np.int32))]))
        return responses

    def finalize(self) -> None:
        self.pool.shutdown()
