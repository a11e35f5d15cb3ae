"""`mm_anyres`: Triton backend for `anyres`, an encoded image in, its AnyRes tiles, visual-token count and size
(height, width) out; also the first step of the `vlm` ensemble (`build_engines vlm --ensemble`).

Requests differ in tile count, so they are not batched together; decoding and tiling run on the instance's thread
pool, so the requests of one `execute` are prepared in parallel.
"""
from __future__ import annotations

import numpy as np

from backends.core.adapter import BatchedBackend
from backends.core.inputs import Inputs
from backends.media.images import ImagePreprocessor
from backends.vision.anyres import AnyResParams, AnyResPlan, image_processor_config, tiler_from_checkpoint


class TritonPythonModel(BatchedBackend[AnyResParams]):
    Params = AnyResParams

    def load(self) -> None:
        self.tiler = tiler_from_checkpoint(self.folder)
        self.preprocess = ImagePreprocessor.from_dict(image_processor_config(self.folder))

    def read(self, inputs: Inputs) -> list[bytes]:
        return [inputs.blob("image", "encoded image")]

    def prepare(self, data: bytes) -> tuple[np.ndarray, AnyResPlan]:
        return self.tiler.tiles_of_file(data, self.preprocess, self.params.decode_reduced)

    def infer(self, batch: list[list[tuple[np.ndarray, AnyResPlan]]]) -> list[tuple[np.ndarray, AnyResPlan]]:
        return [tiled for tiled, in batch]  # the work was the preparation

    def respond(self, output: tuple[np.ndarray, AnyResPlan]):
        tiles, plan = output
        return self.pb.InferenceResponse([
            self.pb.Tensor("pixel_values", tiles),
            self.pb.Tensor("num_image_tokens", np.array([plan.num_image_tokens], np.int32)),
            self.pb.Tensor("image_size", np.array(plan.image_size, np.int32))])
