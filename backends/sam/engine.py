"""SAM with the image embedding cached: the image encoder engine runs once per distinct image, each prompt only runs
the prompt encoder + mask decoder engine (both built by `build_engines sam`, segment-anything's ONNX interface).

Preprocessing is transformers' SamProcessor (resize the longest side to 1024, normalise, pad); the decoder engine
does its post-processing (upscale the low-res masks, crop the padding, resize to the original size) and the masks are
its logits > 0, so masks and scores equal SamModel + SamProcessor's. The cache is keyed by the SHA-256 of the encoded
image, least recently used first out, bounded by the bytes its embeddings hold.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.core.batcher import BatchingParams
from backends.core.errors import InvalidInput
from backends.core.params import bounded, choice, device
from backends.core.runtime import RUNTIMES, load_runtime
from backends.media.images import DEFAULT_MAX_PIXELS, check_resize, decode_image

LOW_RES = 256  # side of the decoder's low-res masks (and of mask_input)


@dataclass(frozen=True)
class SamParams(BatchingParams):
    """The `mm_sam` backend's parameters."""

    runtime: str = choice("auto", *RUNTIMES)
    device: str = device()
    embedding_cache_mb: int = bounded(1024, 0)  # host memory for cached image embeddings
    max_points: int = bounded(64, 1)


def image_key(data: bytes) -> str:
    """The embedding cache's key for an encoded image."""
    return hashlib.sha256(data).hexdigest()


@dataclass
class Embedded:
    embeddings: np.ndarray  # float32 [1, C, 64, 64], in host memory: the GPU keeps only what is running
    original_size: tuple[int, int]  # (height, width) of the decoded image
    reshaped_size: tuple[int, int]  # (height, width) after the longest side went to 1024

    @property
    def nbytes(self) -> int:
        return self.embeddings.nbytes


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
    def __init__(self, version_dir: Path, runtime: str = "auto", device: str = "auto", cache_mb: int = 1024,
                 max_points: int = 64, max_pixels: int = DEFAULT_MAX_PIXELS):
        from transformers import SamProcessor

        self.processor = SamProcessor.from_pretrained(version_dir)
        self.encoder = load_runtime(Path(version_dir) / "image_encoder", runtime, device)
        self.decoder = load_runtime(Path(version_dir) / "mask_decoder", runtime, device)
        self.cache = EmbeddingCache(cache_mb * 2**20)
        self.max_points, self.max_pixels = max_points, max_pixels
        self.encoder_runs = 0

    def embed(self, data: bytes, key: str | None = None) -> Embedded:
        """The image's embedding, from the cache when these exact bytes were seen (`key`: their `image_key`, when
        the caller has it already)."""
        key = key or image_key(data)
        entry = self.cache.get(key)
        if entry is None:
            image = decode_image(data, self.max_pixels)
            # SamProcessor's resize: the longest side to its longest_edge (1024)
            scale = self.processor.image_processor.size["longest_edge"] / max(image.size)
            check_resize(*image.size, (int(image.height * scale + 0.5), int(image.width * scale + 0.5)))
            inputs = self.processor(images=image, return_tensors="np")
            entry = Embedded(self.encoder.run({"pixel_values": inputs["pixel_values"]})["image_embeddings"],
                             tuple(inputs["original_sizes"][0].tolist()),
                             tuple(inputs["reshaped_input_sizes"][0].tolist()))
            self.encoder_runs += 1
            self.cache.put(key, entry)
        return entry

    def check_prompt(self, points: np.ndarray | None, labels: np.ndarray | None, boxes: np.ndarray | None,
                     mask_input: np.ndarray | None, size: tuple[int, int]) -> None:
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
        if mask_input is not None and (mask_input.shape != (1, LOW_RES, LOW_RES) or not np.isfinite(mask_input).all()):
            raise InvalidInput(f"mask_input must be one finite low-res mask [1, {LOW_RES}, {LOW_RES}] (a "
                               f"low_res_logits row of an earlier answer); got {list(mask_input.shape)}")

    def segment(self, data: bytes, points: np.ndarray | None = None, labels: np.ndarray | None = None,
                boxes: np.ndarray | None = None, multimask: bool = True,
                mask_input: np.ndarray | None = None, key: str | None = None) -> Segmentation:
        """One prompt (all points together, optionally one box and the low-res logits of an earlier mask) on one
        image."""
        entry = self.embed(data, key)
        self.check_prompt(points, labels, boxes, mask_input, entry.original_size)
        (height, width), (new_height, new_width) = entry.original_size, entry.reshaped_size
        scale = np.array([new_width / width, new_height / height])  # SamProcessor's coordinate scaling
        coords, codes = [], []
        if points is not None:
            coords.append(points * scale)
            codes.append(labels)
        if boxes is not None:  # box corners are points labelled 2 and 3
            coords.append(boxes.reshape(2, 2) * scale)
            codes.append(np.array([2, 3]))
        else:  # without a box, SAM appends one padding point
            coords.append(np.zeros((1, 2)))
            codes.append(np.array([-1]))
        out = self.decoder.run({
            "image_embeddings": entry.embeddings, "point_coords": np.concatenate(coords)[None].astype(np.float32),
            "point_labels": np.concatenate(codes)[None].astype(np.float32),
            "mask_input": np.zeros((1, 1, LOW_RES, LOW_RES), np.float32) if mask_input is None else mask_input[None],
            "has_mask_input": np.array([0.0 if mask_input is None else 1.0], np.float32),
            "orig_im_size": np.array(entry.original_size, np.int64), "multimask_output": np.array([int(multimask)])})
        return Segmentation(out["masks"][0] > 0, out["iou_predictions"][0], out["low_res_masks"][0])
