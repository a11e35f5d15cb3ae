"""SAM with the image embedding cached: the heavy ViT runs once per distinct image, each prompt only runs the
prompt encoder and mask decoder.

Preprocessing and postprocessing are transformers' SamProcessor (resize the longest side to 1024, normalise, pad;
upscale the low-res masks, crop the padding, resize to the original size, threshold), so masks and scores equal
SamModel + SamProcessor's. The cache is keyed by the SHA-256 of the encoded image, least recently used first out,
bounded by the bytes its embeddings hold.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backends.devices import DTYPES, resolve_device
from backends.errors import InvalidInput
from backends.images import DEFAULT_MAX_PIXELS, decode_image


@dataclass
class Embedded:
    embeddings: torch.Tensor  # [1, C, 64, 64] on the model's device
    original_size: tuple[int, int]  # (height, width) of the decoded image
    reshaped_size: tuple[int, int]  # (height, width) after the longest side went to 1024

    @property
    def nbytes(self) -> int:
        return self.embeddings.numel() * self.embeddings.element_size()


class EmbeddingCache:
    """LRU map image hash -> Embedded, at most `max_bytes` of embeddings; counts hits, misses and evictions."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[str, Embedded] = OrderedDict()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: str) -> Embedded | None:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: Embedded) -> None:
        if entry.nbytes > self.max_bytes:
            return  # never cached: it would evict everything and still not fit
        self.entries[key] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.bytes -= evicted.nbytes
            self.evictions += 1


@dataclass
class Segmentation:
    masks: np.ndarray  # bool [K, H, W] at the original image size (K = 3 with multimask output, else 1)
    iou_scores: np.ndarray  # float32 [K]
    low_res_logits: np.ndarray  # float32 [K, 256, 256]


class SamEngine:
    def __init__(self, checkpoint: Path, dtype: str = "fp32", device: str = "auto", cache_mb: int = 1024,
                 max_points: int = 64, max_pixels: int = DEFAULT_MAX_PIXELS):
        from transformers import SamModel, SamProcessor

        self.device, self.dtype = resolve_device(device), DTYPES[dtype]
        self.model = SamModel.from_pretrained(checkpoint, dtype=self.dtype).to(self.device).eval()
        self.processor = SamProcessor.from_pretrained(checkpoint)
        self.cache = EmbeddingCache(cache_mb * 2**20)
        self.max_points, self.max_pixels = max_points, max_pixels
        self.encoder_runs = 0

    @torch.inference_mode()
    def embed(self, data: bytes) -> Embedded:
        """The image's embedding, from the cache when these exact bytes were seen."""
        key = hashlib.sha256(data).hexdigest()
        entry = self.cache.get(key)
        if entry is None:
            inputs = self.processor(images=decode_image(data, self.max_pixels), return_tensors="pt")
            pixels = inputs["pixel_values"].to(self.device, self.dtype)
            entry = Embedded(self.model.get_image_embeddings(pixels), tuple(inputs["original_sizes"][0].tolist()),
                             tuple(inputs["reshaped_input_sizes"][0].tolist()))
            self.encoder_runs += 1
            self.cache.put(key, entry)
        return entry

    def check_prompt(self, points: np.ndarray | None, labels: np.ndarray | None, boxes: np.ndarray | None,
                     size: tuple[int, int]) -> None:
        height, width = size
        if points is None and boxes is None:
            raise InvalidInput("give at least one point (point_coords + point_labels) or one box")
        if points is not None:
            if labels is None or points.ndim != 2 or points.shape[1] != 2 or labels.shape != (points.shape[0],):
                raise InvalidInput(f"point_coords must be [N, 2] with point_labels [N]; got {list(points.shape)} and "
                                   f"{None if labels is None else list(labels.shape)}")
            if not 0 < len(points) <= self.max_points:
                raise InvalidInput(f"{len(points)} points; between 1 and {self.max_points} are accepted")
            if not np.isin(labels, (0, 1)).all():
                raise InvalidInput(f"point_labels must be 0 (background) or 1 (foreground); got "
                                   f"{sorted(set(labels.tolist()) - {0, 1})}")
            outside = ~((points >= 0) & (points < [width, height])).all(axis=1) | ~np.isfinite(points).all(axis=1)
            if outside.any():
                raise InvalidInput(f"point {points[outside][0].tolist()} is outside the {width}x{height} image")
        if boxes is not None:
            if boxes.shape != (1, 4):  # one prompt per request: its points and at most one box
                raise InvalidInput(f"boxes must be one box [1, 4] (x0, y0, x1, y1); got {list(boxes.shape)}")
            inside = (boxes[:, :2] >= 0).all() and (boxes[:, [2]] <= width).all() and (boxes[:, [3]] <= height).all()
            if not inside or not (boxes[:, 2:] > boxes[:, :2]).all():
                raise InvalidInput(f"each box needs 0 <= x0 < x1 <= {width} and 0 <= y0 < y1 <= {height}")

    @torch.inference_mode()
    def segment(self, data: bytes, points: np.ndarray | None = None, labels: np.ndarray | None = None,
                boxes: np.ndarray | None = None, multimask: bool = True) -> Segmentation:
        """One prompt (all points together, and optionally one box) on one image."""
        entry = self.embed(data)
        self.check_prompt(points, labels, boxes, entry.original_size)
        scale = torch.tensor([entry.reshaped_size[1] / entry.original_size[1],
                              entry.reshaped_size[0] / entry.original_size[0]])  # SamProcessor's coordinate scaling
        prompt = {}
        if points is not None:
            prompt["input_points"] = (torch.as_tensor(points, dtype=torch.float32) * scale)[None, None]
            prompt["input_labels"] = torch.as_tensor(labels, dtype=torch.long)[None, None]
        if boxes is not None:
            prompt["input_boxes"] = (torch.as_tensor(boxes, dtype=torch.float32).view(2, 2) * scale).view(1, 1, 4)
        prompt = {k: v.to(self.device) for k, v in prompt.items()}
        out = self.model(image_embeddings=entry.embeddings, multimask_output=multimask, **prompt)
        masks = self.processor.post_process_masks(out.pred_masks.float().cpu(), [list(entry.original_size)],
                                                  [list(entry.reshaped_size)])[0][0]
        return Segmentation(masks.numpy(), out.iou_scores[0, 0].float().cpu().numpy(),
                            out.pred_masks[0, 0].float().cpu().numpy())
