"""`mm_sam`: Triton backend for `sam`, image + one prompt (points with labels, and/or one box, optionally the low-res
logits of an earlier mask) -> masks at the image's size, IoU scores and the low-res logits (those the client asks
for: masks nobody asked for are not upscaled, and no logits are copied back for nobody). The input
`mask_format` picks how the masks come: "binary", `masks`, a byte a pixel; "packed", `masks_packed`, eight pixels a
byte (np.unpackbits(..., axis=-1, count=width) reads it); "rle", `masks_rle`, COCO's compressed RLE as JSON
(pycocotools.mask.decode reads it), about a byte a run.

The engine caches image embeddings by content hash; cache hits, misses and evictions are exported as counters
(sam_embedding_cache_*), so a client can see a second click skip the encoder. With `batch_window` adaptive (the
build's default) or fixed our batcher queues the requests in QoS order, a click on a cached image costing nothing
in the score and a new image a full image's tokens (it runs the encoder), and hands the engine up to `max_prompts`
at once: their prompts share decoder calls (SamEngine.segment_batch). With `batch_window` triton each request runs
alone (the model has no dynamic batcher: its inputs have no batch dimension).
"""
from __future__ import annotations

import json

import numpy as np

from backends.core.adapter import BatchedBackend
from backends.core.errors import InvalidInput
from backends.core.inputs import Inputs
from backends.core.metrics import CustomMetrics
from backends.sam.engine import MASK_OUTPUTS, Prompt, SamEngine, SamParams, Segmentation, image_key

COUNTERS = {"hits": "image embeddings served from the cache", "misses": "images that ran the encoder",
            "evictions": "embeddings dropped from the cache to stay within its memory bound"}
ENCODER_TOKENS = 64 * 64  # the image embedding's positions: the QoS size of an image that runs the encoder


class TritonPythonModel(BatchedBackend[SamParams]):
    Params = SamParams

    def setup(self) -> None:
        self.metrics = CustomMetrics(self.pb, self.labels, {}, {f"sam_embedding_cache_{k}_total": doc
                                                                 for k, doc in COUNTERS.items()})
        super().setup()

    def load(self) -> None:
        params = self.params
        self.engine = SamEngine(self.folder, params.runtime, self.device, params.embedding_cache_mb, params.max_points,
                                max_prompts=params.max_prompts, graph_tokens=params.graph_tokens)

    def batch_limit(self) -> int:
        return self.params.max_prompts

    def read(self, inputs: Inputs) -> list[Prompt]:
        arrays = (inputs.array(name) for name in ("point_coords", "point_labels", "boxes", "mask_input"))
        mask_format = inputs.text("mask_format", "binary")
        if mask_format not in MASK_OUTPUTS:
            raise InvalidInput("mask_format must be " + ", ".join(f"'{f}' ({o})" for f, o in MASK_OUTPUTS.items())
                               + f"; got {mask_format!r}")
        # copies: our batcher uses them after `execute` returns, when Triton may reuse the inputs' buffers
        return [Prompt(inputs.blob("image", "encoded image"), *(None if a is None else a.copy() for a in arrays),
                       inputs.scalar("multimask_output", bool, True), outputs=inputs.requested,
                       mask_format=mask_format)]

    def prepare(self, prompt: Prompt) -> Prompt:
        prompt.key = image_key(prompt.image)
        return prompt

    def sizes(self, prepared: list[Prompt]) -> dict[str, float]:
        cached = self.engine.cache.entries  # read only: the engine's thread owns the cache
        return {"image_tokens": sum(0 if p.key in cached else ENCODER_TOKENS for p in prepared)}

    def infer(self, batch: list[list[Prompt]]) -> list[Segmentation | Exception]:
        return self.engine.segment_batch([prompt for (prompt,) in batch])

    def respond(self, result: Segmentation):
        """The outputs the client asked for (the others were not computed)."""
        rle = None if result.masks_rle is None else np.array([json.dumps(r).encode() for r in result.masks_rle],
                                                             dtype=object)
        return self.pb.InferenceResponse([self.pb.Tensor(name, value) for name, value in (
            ("masks", result.masks), ("masks_packed", result.masks_packed), ("masks_rle", rle),
            ("iou_scores", result.iou_scores),
            ("low_res_logits", result.low_res_logits)) if value is not None])

    def after_batch(self) -> None:
        cache = self.engine.cache
        self.metrics.update(totals={f"sam_embedding_cache_{k}_total": getattr(cache, k) for k in COUNTERS})

    def finalize(self) -> None:
        super().finalize()
        self.metrics.close()
