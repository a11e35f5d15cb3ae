"""SAM with the image embedding cached: the image encoder engine runs once per distinct image, each prompt only runs
the prompt encoder + mask decoder engine (both built by `build_engines sam`).

Preprocessing is transformers' SamProcessor (resize the longest side to 1024, normalise, pad). The decoder engine
returns the low-res logits of all four mask tokens and their IoU predictions; the engine then does SamProcessor's
post-processing on its device (choose the single mask or the three candidates, upscale to the padded frame, crop the
padding, resize to the original size, threshold at 0), so masks and scores equal SamModel + SamProcessor's and only
the masks the response holds are copied back. The cache is keyed by the SHA-256 of the encoded image, least recently
used first out, bounded by the bytes its embeddings hold.

Prompts of several requests run as one decoder call (`segment_batch`) when they have the same number of prompt tokens
(padding a prompt with more tokens would change its masks), whatever their images' sizes and output kinds; each row
has its own image embedding. On CUDA the torch decoder replays CUDA graphs, one per power-of-two batch and token count
up to `graph_tokens` (a click is ~170 small kernels: launched one by one, the host set the pace).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from backends.core.batcher import BatchingParams
from backends.core.devices import to_host
from backends.core.errors import InvalidInput
from backends.core.params import bounded, choice, device
from backends.core.runtime import RUNTIMES, load_runtime
from backends.media.images import DEFAULT_MAX_PIXELS, check_resize, decode_image

LOW_RES = 256  # side of the decoder's low-res masks (and of mask_input)
MASK_OUTPUTS = {"binary": "masks", "packed": "masks_packed", "rle": "masks_rle"}  # `mask_format` -> its output


@dataclass(frozen=True)
class SamParams(BatchingParams):
    """The `mm_sam` backend's parameters."""

    runtime: str = choice("auto", *RUNTIMES)
    device: str = device()
    embedding_cache_mb: int = bounded(1024, 0)  # memory for cached image embeddings (on the engine's device)
    max_points: int = bounded(64, 1)
    max_prompts: int = bounded(16, 1)  # requests in one decoder call (our batcher's batch: `batch_window`)
    graph_tokens: int = bounded(6, 0, 66)  # CUDA graphs for prompts of 1 to this many tokens (points, +2 for a box or
    # +1 padding point without one); longer prompts run op by op; 0: no graphs
    # threads that copy out and send the answers (a click's bool masks: about 2.3 MB): on an H100 at concurrency 16,
    # 630 clicks/s with 4 against 497 with 2 and 596 with 8 (perf/results/h100/2026-12-07d-sam-throughput.md)
    response_threads: int = bounded(4, 0)


def image_key(data: bytes) -> str:
    """The embedding cache's key for an encoded image."""
    return hashlib.sha256(data).hexdigest()


def concatenate(rows: list):
    """Rows of numpy arrays, or of torch tensors (where a torch or TensorRT engine keeps them), along the batch."""
    return np.concatenate(rows) if isinstance(rows[0], np.ndarray) else torch.cat(rows)


def resized_side(side, height, width, longest_edge: int):
    """A side after SamProcessor's resize, int(side * longest_edge / max(height, width) + 0.5), in integers (equal to
    the processor's float form: tests/unit/test_sam.py)."""
    longest = max(height, width)
    return (2 * side * longest_edge + longest) // (2 * longest)


def upscale_masks(low_res: torch.Tensor, size: tuple[int, int], pad_size: int) -> torch.Tensor:
    """SamProcessor.post_process_masks without the threshold, in float32: [B, K, 256, 256] logits to the padded
    frame, the padding cropped, then to the original (height, width)."""
    height, width = size
    masks = F.interpolate(low_res.float(), (pad_size, pad_size), mode="bilinear", align_corners=False)
    masks = masks[..., :resized_side(height, height, width, pad_size), :resized_side(width, height, width, pad_size)]
    return F.interpolate(masks, (height, width), mode="bilinear", align_corners=False)


def pack_bits(masks: torch.Tensor) -> torch.Tensor:
    """Bool masks [..., W] as uint8 [..., ceil(W / 8)], eight pixels a byte, the first in the highest bit: what
    `np.packbits(masks, axis=-1)` gives and `np.unpackbits(packed, axis=-1, count=W)` reads back. Packed where the
    masks are, so a GPU copies an eighth of the bytes back."""
    padded = F.pad(masks.to(torch.uint8), (0, -masks.shape[-1] % 8))
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=masks.device)  # made there: no copy from the host
    return (padded.unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.uint8)


def coco_rle(masks: torch.Tensor | np.ndarray) -> list[dict]:
    """Each bool mask [K, H, W] as COCO's compressed RLE, {"size": [H, W], "counts": str} (what
    `pycocotools.mask.decode` takes back): about a byte a run where the pixels take a byte each. Masks on a GPU are
    scanned there (`run_lengths`: only the runs come back, not the pixels), others by pycocotools' C scan."""
    from pycocotools import mask as coco

    if isinstance(masks, torch.Tensor) and masks.is_cuda:
        encoded = coco.frPyObjects(run_lengths(masks), *masks.shape[1:])
    else:
        encoded = coco.encode(np.asfortranarray(np.asarray(masks).transpose(1, 2, 0), dtype=np.uint8))
    return [{"size": [int(side) for side in rle["size"]], "counts": rle["counts"].decode()} for rle in encoded]


def run_lengths(masks: torch.Tensor) -> list[dict]:
    """COCO's uncompressed RLE of each bool mask [K, H, W] ({"size", "counts"}: alternating runs of 0s and 1s down
    the columns, 0s first), found where the masks are; one sync, and the runs' ends copied back."""
    k, h, w = masks.shape
    flat = masks.transpose(1, 2).reshape(k, h * w)
    ends = torch.ones(k, h * w + 1, dtype=torch.bool, device=masks.device)  # where a run starts, and the end
    ends[:, 1:-1] = flat[:, 1:] != flat[:, :-1]
    at = ends.nonzero()[:, 1].int()  # row-major: each mask's positions in order
    per_mask, first = ends.sum(1), flat[:, 0]
    at, per_mask, first = at.cpu().numpy(), per_mask.cpu().numpy(), first.cpu().numpy()
    encoded = []
    for positions, ones_first in zip(np.split(at, np.cumsum(per_mask)[:-1]), first):
        counts = np.diff(positions).astype(np.uint32)
        if ones_first:  # the counts begin with the run of 0s, empty here
            counts = np.concatenate([np.zeros(1, np.uint32), counts])
        encoded.append({"size": [h, w], "counts": counts})
    return encoded


@dataclass
class Embedded:
    # [1, C, 64, 64] where the encoder made it: a torch tensor on its device (torch and TensorRT engines; a click
    # then sends only its prompt to the GPU), else float32 in host memory
    embeddings: Any
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
class Prompt:
    """One request: the encoded image and its prompt (all its points, at most one box, an earlier mask's logits)."""

    image: bytes
    points: np.ndarray | None = None
    labels: np.ndarray | None = None
    boxes: np.ndarray | None = None
    mask_input: np.ndarray | None = None
    multimask: bool = True
    key: str = ""  # the embedding cache's key (`image_key`), when the caller has it already
    outputs: frozenset[str] | None = None  # the outputs asked for (None: all): a client that asks for no masks
    # saves their upscaling and their copy to the host
    mask_format: str = "binary"  # the masks as bool pixels (`masks`), packed bits or COCO run lengths (MASK_OUTPUTS)

    def wants(self, name: str) -> bool:
        """Whether to compute output `name` (a Segmentation field): asked for, and the masks in the format asked."""
        if name in MASK_OUTPUTS.values() and name != MASK_OUTPUTS[self.mask_format]:
            return False
        return self.outputs is None or name in self.outputs


@dataclass
class Segmentation:
    masks: np.ndarray | None  # bool [K, H, W] at the original image size (K = 3 with multimask output, else 1)
    iou_scores: np.ndarray  # float32 [K]
    low_res_logits: np.ndarray | None  # float32 [K, 256, 256]
    masks_rle: list[dict] | None = None  # the masks as COCO's compressed RLE (`coco_rle`)
    masks_packed: np.ndarray | None = None  # uint8 [K, H, ceil(W / 8)]: the masks' bits (`pack_bits`)
    # (each is None where the prompt does not want it: Prompt.wants)


class SamEngine:
    def __init__(self, version_dir: Path, runtime: str = "auto", device: str = "auto", cache_mb: int = 1024,
                 max_points: int = 64, max_pixels: int = DEFAULT_MAX_PIXELS, max_prompts: int = 16,
                 graph_tokens: int = 0):
        """`max_prompts`, `graph_tokens`: the CUDA graphs of the torch decoder (SamParams)."""
        from transformers import SamProcessor

        self.processor = SamProcessor.from_pretrained(version_dir)
        self.pad_size = self.processor.image_processor.pad_size["height"]
        self.encoder = load_runtime(Path(version_dir) / "image_encoder", runtime, device)
        self.decoder = load_runtime(Path(version_dir) / "mask_decoder", runtime, device,
                                    graph_batch=max_prompts if graph_tokens else 0,
                                    graph_extents=range(1, graph_tokens + 1))
        self.cache = EmbeddingCache(cache_mb * 2**20)
        self.max_points, self.max_pixels = max_points, max_pixels
        self.encoder_runs = 0

    def embed_batch(self, images: list[tuple[bytes, str | None]]) -> list[Embedded | Exception]:
        """Each (encoded image, its key or None)'s embedding, or its own error: from the cache when these exact
        bytes were seen, else (each distinct image once) preprocessed one by one and run through the encoder
        together."""
        results: list[Embedded | Exception | None] = [None] * len(images)
        new: dict[str, list[int]] = {}  # key -> the items that wait for it
        pixels: dict[str, dict[str, np.ndarray]] = {}
        for i, (data, key) in enumerate(images):
            key = key or image_key(data)
            if key in new:
                new[key].append(i)
            elif (entry := self.cache.get(key)) is not None:
                results[i] = entry
            else:
                try:
                    pixels[key] = self._preprocess(data)
                    new[key] = [i]
                except Exception as e:  # noqa: BLE001  (this image's own failure)
                    results[i] = e
        if pixels:
            batch = np.concatenate([inputs["pixel_values"] for inputs in pixels.values()])
            embeddings = self.encoder.run({"pixel_values": batch}, keep=("image_embeddings",))["image_embeddings"]
            for row, (key, inputs) in enumerate(pixels.items()):
                own = embeddings[row:row + 1]  # its own memory: the cache counts each entry's bytes
                entry = Embedded(own.clone() if hasattr(own, "clone") else own.copy(),
                                 tuple(inputs["original_sizes"][0].tolist()),
                                 tuple(inputs["reshaped_input_sizes"][0].tolist()))
                self.encoder_runs += 1
                self.cache.put(key, entry)
                for i in new[key]:
                    results[i] = entry
        return results

    def _preprocess(self, data: bytes) -> dict[str, np.ndarray]:
        """SamProcessor's pixel values and sizes of an encoded image (resized so its longest side is 1024)."""
        image = decode_image(data, self.max_pixels)
        scale = self.processor.image_processor.size["longest_edge"] / max(image.size)
        check_resize(*image.size, (int(image.height * scale + 0.5), int(image.width * scale + 0.5)))
        return self.processor(images=image, return_tensors="np")

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
        result = self.segment_batch([Prompt(data, points, labels, boxes, mask_input, multimask, key or "")])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def segment_batch(self, prompts: list[Prompt]) -> list[Segmentation | Exception]:
        """Each prompt's masks, or its own error (its image, its prompt): the new images through the encoder
        together, then one decoder call per number of prompt tokens (see the module's docstring)."""
        results: list[Segmentation | Exception | None] = [None] * len(prompts)
        groups: dict[int, list[tuple[int, Embedded, np.ndarray, np.ndarray]]] = defaultdict(list)
        entries = self.embed_batch([(prompt.image, prompt.key or None) for prompt in prompts])
        for i, (prompt, entry) in enumerate(zip(prompts, entries)):
            try:
                if isinstance(entry, Exception):
                    raise entry
                self.check_prompt(prompt.points, prompt.labels, prompt.boxes, prompt.mask_input, entry.original_size)
            except Exception as e:  # noqa: BLE001  (this request's own failure)
                results[i] = e
                continue
            coords, codes = self._tokens(prompt, entry)
            groups[len(codes)].append((i, entry, coords, codes))
        for rows in groups.values():
            masks = [prompts[i].mask_input for i, *_ in rows]
            out = self.decoder.run({
                "image_embeddings": concatenate([entry.embeddings for _, entry, _, _ in rows]),
                "point_coords": np.stack([coords for _, _, coords, _ in rows]).astype(np.float32),
                "point_labels": np.stack([codes for _, _, _, codes in rows]).astype(np.float32),
                "mask_input": np.stack([np.zeros((1, LOW_RES, LOW_RES), np.float32) if m is None else m
                                        for m in masks]).astype(np.float32),
                "has_mask_input": np.array([0.0 if m is None else 1.0 for m in masks], np.float32)},
                keep=("low_res_masks", "iou_predictions"))
            low_res, iou = (torch.as_tensor(out[name]) for name in ("low_res_masks", "iou_predictions"))
            kinds: dict[tuple, list[int]] = defaultdict(list)  # rows that share an upscale: same size and output
            for row, (i, entry, _, _) in enumerate(rows):
                kinds[entry.original_size, prompts[i].multimask].append(row)
            for (size, multimask), members in kinds.items():
                index = torch.tensor(members, device=low_res.device)
                chosen = slice(1, 4) if multimask else slice(0, 1)  # SamMaskDecoder's choice of mask tokens
                kept = low_res[index, chosen]
                asked = [prompts[rows[row][0]] for row in members]
                wanted = {name for name in (*MASK_OUTPUTS.values(), "low_res_logits")
                          if any(prompt.wants(name) for prompt in asked)}
                upscaled = upscale_masks(kept, size, self.pad_size) > 0 if wanted & {*MASK_OUTPUTS.values()} else None
                pixels = to_host(upscaled) if "masks" in wanted else None
                packed = to_host(pack_bits(upscaled)) if "masks_packed" in wanted else None
                logits = to_host(kept.float()) if "low_res_logits" in wanted else None
                scores = to_host(iou[index, chosen].float())
                # every RLE of the group in one scan (on a GPU one sync for all, not one a prompt)
                encoded = [k for k, prompt in enumerate(asked) if prompt.wants("masks_rle")]
                runs = coco_rle(upscaled[encoded].flatten(0, 1)) if encoded else []
                per = kept.shape[1]
                rles = {k: runs[j * per:(j + 1) * per] for j, k in enumerate(encoded)}
                for k, (row, prompt) in enumerate(zip(members, asked)):
                    results[rows[row][0]] = Segmentation(
                        pixels[k] if prompt.wants("masks") else None, scores[k],
                        logits[k] if prompt.wants("low_res_logits") else None, rles.get(k),
                        packed[k] if prompt.wants("masks_packed") else None)
        return results

    @staticmethod
    def _tokens(prompt: Prompt, entry: Embedded) -> tuple[np.ndarray, np.ndarray]:
        """The prompt's points in the 1024-px frame and their label codes (SamProcessor's scaling; a box's corners
        are points labelled 2 and 3; without a box, SAM appends one padding point labelled -1)."""
        (height, width), (new_height, new_width) = entry.original_size, entry.reshaped_size
        scale = np.array([new_width / width, new_height / height])
        coords, codes = [], []
        if prompt.points is not None:
            coords.append(prompt.points * scale)
            codes.append(prompt.labels)
        if prompt.boxes is not None:
            coords.append(prompt.boxes.reshape(2, 2) * scale)
            codes.append(np.array([2, 3]))
        else:
            coords.append(np.zeros((1, 2)))
            codes.append(np.array([-1]))
        return np.concatenate(coords), np.concatenate(codes)
