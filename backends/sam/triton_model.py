"""Triton adapter for `sam`: image + one prompt (points with labels, and/or one box, optionally the low-res logits of
an earlier mask) -> masks at the image's size, IoU scores and the low-res logits. The engine caches image embeddings
by content hash; cache hits, misses and evictions are exported as counters (sam_embedding_cache_*), so a client can
see a second click skip the encoder."""
from __future__ import annotations

import json
from pathlib import Path

from backends.errors import InvalidInput
from backends.sam.engine import SamEngine
from backends.triton_model import instance_device, model_parameters, optional_input, route_logs_to_triton

COUNTERS = {"hits": "image embeddings served from the cache", "misses": "images that ran the encoder",
            "evictions": "embeddings dropped from the cache to stay within its memory bound"}


class SamTritonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        route_logs_to_triton(pb_utils)
        params = model_parameters(json.loads(args["model_config"]))
        device = instance_device(args, params.get("device", "auto"))
        self.engine = SamEngine(Path(args["model_repository"]) / args["model_version"], params.get("runtime", "auto"),
                                device, int(params.get("embedding_cache_mb") or 1024))
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.families = {k: pb_utils.MetricFamily(f"sam_embedding_cache_{k}_total", doc,
                                                  pb_utils.MetricFamily.COUNTER) for k, doc in COUNTERS.items()}
        self.counters = {k: family.Metric(labels=labels) for k, family in self.families.items()}
        self.reported = dict.fromkeys(COUNTERS, 0)

    def respond(self, request):
        pb = self.pb
        image = optional_input(pb, request, "image")
        if image is None or image.size != 1:
            raise InvalidInput("image must hold exactly one encoded image")
        points, labels, boxes, mask_input, multimask = (optional_input(pb, request, name) for name in (
            "point_coords", "point_labels", "boxes", "mask_input", "multimask_output"))
        result = self.engine.segment(bytes(image.reshape(-1)[0]), points, labels, boxes,
                                     True if multimask is None else bool(multimask.reshape(-1)[0]), mask_input)
        return pb.InferenceResponse([pb.Tensor("masks", result.masks), pb.Tensor("iou_scores", result.iou_scores),
                                     pb.Tensor("low_res_logits", result.low_res_logits)])

    def execute(self, requests: list) -> list:
        pb, responses = self.pb, []
        for request in requests:
            try:
                responses.append(self.respond(request))
            except InvalidInput as e:
                responses.append(pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG)))
            except Exception as e:  # a model failure fails this request, never the server
                responses.append(pb.InferenceResponse(error=pb.TritonError(
                    f"segmentation failed: {type(e).__name__}: {e}", pb.TritonError.INTERNAL)))
        cache = self.engine.cache
        for name, total in (("hits", cache.hits), ("misses", cache.misses), ("evictions", cache.evictions)):
            self.counters[name].increment(total - self.reported[name])
            self.reported[name] = total
        return responses

    def finalize(self) -> None:
        self.counters.clear()
        self.families.clear()
