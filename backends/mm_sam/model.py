"""`mm_sam`: Triton backend for `sam`, image + one prompt (points with labels, and/or one box, optionally the low-res
logits of an earlier mask) -> masks at the image's size, IoU scores and the low-res logits.

The engine caches image embeddings by content hash; cache hits, misses and evictions are exported as counters
(sam_embedding_cache_*), so a client can see a second click skip the encoder.
"""
from __future__ import annotations

from backends.core.adapter import TritonBackend, inject
from backends.core.metrics import CustomMetrics
from backends.sam.engine import SamEngine, SamParams

COUNTERS = {"hits": "image embeddings served from the cache", "misses": "images that ran the encoder",
            "evictions": "embeddings dropped from the cache to stay within its memory bound"}


class TritonPythonModel(TritonBackend[SamParams]):
    Params = SamParams

    def setup(self) -> None:
        self.engine = SamEngine(self.folder, self.params.runtime, self.device, self.params.embedding_cache_mb,
                                self.params.max_points)
        self.metrics = CustomMetrics(self.pb, self.labels, {}, {f"sam_embedding_cache_{k}_total": doc
                                                                 for k, doc in COUNTERS.items()})

    def segment(self, request):
        fault = self.check_parameters(request)
        inject(fault, "read")
        inputs = self.inputs(request)
        image = inputs.blob("image", "encoded image")
        multimask = inputs.scalar("multimask_output", bool, True)
        points, labels, boxes, mask_input = (inputs.array(name) for name in (
            "point_coords", "point_labels", "boxes", "mask_input"))
        inject(fault, "infer")
        result = self.engine.segment(image, points, labels, boxes, multimask, mask_input)
        return self.pb.InferenceResponse([self.pb.Tensor("masks", result.masks),
                                          self.pb.Tensor("iou_scores", result.iou_scores),
                                          self.pb.Tensor("low_res_logits", result.low_res_logits)])

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:  # one at a time: the embedding cache belongs to this thread
            try:
                responses.append(self.segment(request))
            except Exception as e:
                responses.append(self.error_response(e))
        cache = self.engine.cache
        self.metrics.update(totals={f"sam_embedding_cache_{k}_total": getattr(cache, k) for k in COUNTERS})
        return responses

    def finalize(self) -> None:
        self.metrics.close()
