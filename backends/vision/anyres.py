"""AnyRes tiling (LLaVA-NeXT): pick the tile grid that best fits the image, resize into it keeping the aspect ratio,
pad, cut tiles, add a global thumbnail; and count the visual tokens the language model will see after unpadding.

Pixel values equal transformers' LlavaNextImageProcessor(Pil) output; the token count equals LlavaNextProcessor's.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from backends.core.batcher import BatchingParams
from backends.core.params import bounded
from backends.media.images import ImagePreprocessor, decode_reduced, load_rgb, open_image, oriented_size

LLAVA_1_6_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))



@dataclass(frozen=True)
class AnyResParams(BatchingParams):
    """The `mm_anyres` backend's parameters."""

    prepare_threads: int = bounded(4, 1, 256)  # decode + tiling threads per instance
    decode_reduced: bool = False  # JPEGs decoded at the smallest DCT scale the resizes allow: faster, not
    # pixel-exact with transformers' processor (backends.media.images.decode_reduced)

def grid_pinpoints(max_tiles: int, tile: int) -> tuple[tuple[int, int], ...]:
    """An "anyres_max_N" style list: every grid of rows x cols tiles with rows * cols <= N, in pixels (h, w)."""
    return tuple((rows * tile, cols * tile) for rows in range(1, max_tiles + 1) for cols in range(1, max_tiles + 1)
                 if rows * cols <= max_tiles)


def select_best_resolution(height: int, width: int, pinpoints: np.ndarray) -> tuple[int, int]:
    """The (h, w) of `pinpoints` [K, 2] that keeps the most of the image's pixels after an aspect-preserving
    downscale, then wastes the least area; the first such in the list on a tie."""
    heights, widths = pinpoints[:, 0].astype(np.float64), pinpoints[:, 1].astype(np.float64)
    scale = np.minimum(widths / width, heights / height)
    kept = np.minimum(np.floor(width * scale) * np.floor(height * scale), width * height)
    wasted = heights * widths - kept
    best = np.lexsort((np.arange(len(pinpoints)), wasted, -kept))[0]
    return int(pinpoints[best, 0]), int(pinpoints[best, 1])


def fit_size(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """(h, w) of the image scaled to fit inside the target, aspect ratio kept (the long side fills it)."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


@dataclass(frozen=True)
class AnyResPlan:
    """What tiling an image of `image_size` (h, w) gives: the grid, the tiles, the visual tokens."""

    image_size: tuple[int, int]
    canvas: tuple[int, int]  # the chosen pinpoint (h, w)
    resized: tuple[int, int]  # the image inside the canvas before padding
    grid: tuple[int, int]  # rows, cols of tiles
    num_image_tokens: int

    @property
    def num_tiles(self) -> int:
        return 1 + self.grid[0] * self.grid[1]  # the thumbnail first


def image_processor_config(folder: Path) -> dict:
    """The image processor's settings of a checkpoint: preprocessor_config.json, or the `image_processor` part of
    processor_config.json (where transformers 5 saves it)."""
    if (folder / "preprocessor_config.json").exists():
        return json.loads((folder / "preprocessor_config.json").read_text())
    return json.loads((folder / "processor_config.json").read_text())["image_processor"]


def tiler_from_checkpoint(folder: Path) -> AnyResTiler:
    """The tiler a LLaVA-NeXT checkpoint (config.json, processor and image processor configs) describes."""
    config = json.loads((folder / "config.json").read_text())
    processor = folder / "processor_config.json"
    extra = json.loads(processor.read_text()).get("num_additional_image_tokens", 1) if processor.exists() else 1
    vision = config.get("vision_config", {})
    pinpoints = image_processor_config(folder).get("image_grid_pinpoints") or config.get("image_grid_pinpoints")
    return AnyResTiler(tuple(tuple(p) for p in pinpoints or LLAVA_1_6_PINPOINTS), vision.get("image_size", 336),
                       vision.get("patch_size", 14), extra,
                       config.get("vision_feature_select_strategy", "default") == "default")


@dataclass(frozen=True)
class AnyResTiler:
    """`tile` px tiles over `pinpoints`; `patch` px vision patches; `drop_cls` when the projector drops the CLS token
    ("default" feature selection). Defaults: LLaVA-1.6 with CLIP ViT-L/14-336."""

    pinpoints: tuple[tuple[int, int], ...] = LLAVA_1_6_PINPOINTS
    tile: int = 336
    patch: int = 14
    extra_tokens: int = 1  # tokens the vision tower adds per tile beyond its patches (CLIP's CLS)
    drop_cls: bool = True
    keep_ratio: float = 1.0  # visual-token pruning: the share of the tiles' tokens kept (highest feature norm)

    def plan(self, height: int, width: int) -> AnyResPlan:
        canvas = select_best_resolution(height, width, np.asarray(self.pinpoints))
        resized = fit_size(height, width, *canvas)
        return AnyResPlan((height, width), canvas, resized, (canvas[0] // self.tile, canvas[1] // self.tile),
                          self.count_tokens(height, width, canvas))

    def unpadded_window(self, height: int, width: int, canvas: tuple[int, int]) -> tuple[slice, slice]:
        """(rows, cols) of the tiles' patch grid that hold image, not padding."""
        side = self.tile // self.patch
        rows, cols = side * (canvas[0] // self.tile), side * (canvas[1] // self.tile)
        if width / height > cols / rows:  # wider than the grid: padding above and below
            padding = (rows - int(round(height * (cols / width), 7))) // 2
            return slice(padding, rows - padding), slice(0, cols)
        padding = (cols - int(round(width * (rows / height), 7))) // 2
        return slice(0, rows), slice(padding, cols - padding)

    def count_tokens(self, height: int, width: int, canvas: tuple[int, int]) -> int:
        """Thumbnail tokens + the tiles' tokens with padding rows/columns removed + one newline token per row."""
        side = self.tile // self.patch
        rows, cols = self.unpadded_window(height, width, canvas)
        kept_rows, kept_cols = rows.stop - rows.start, cols.stop - cols.start
        return (self.kept_grid_tokens(kept_rows * kept_cols) + kept_rows + side * side + self.extra_tokens
                - (1 if self.drop_cls else 0))

    def kept_grid_tokens(self, grid_tokens: int) -> int:
        return grid_tokens if self.keep_ratio >= 1 else max(1, math.ceil(self.keep_ratio * grid_tokens))

    def source_size(self, height: int, width: int, preprocess: ImagePreprocessor) -> tuple[int, int]:
        """(height, width) that the tiles and the thumbnail of a height x width image are resized from without
        upscaling: what a reduced decode must keep."""
        (fit_h, fit_w), (thumb_h, thumb_w) = self.plan(height, width).resized, thumbnail_size(preprocess)
        return min(height, max(fit_h, thumb_h)), min(width, max(fit_w, thumb_w))

    def tiles_of_file(self, data: bytes, preprocess: ImagePreprocessor,
                      reduced: bool = False) -> tuple[np.ndarray, AnyResPlan]:
        """An image file decoded, then tiled; `reduced`: a JPEG decoded at the smallest DCT scale that keeps the
        sizes its resizes need (decode_reduced)."""
        image = open_image(data)
        size = oriented_size(image)
        if reduced:
            decode_reduced(image, *self.source_size(*size, preprocess))
        return self.tiles(load_rgb(image), preprocess, size)

    def tiles(self, image: Image.Image, preprocess: ImagePreprocessor,
              size: tuple[int, int] | None = None) -> tuple[np.ndarray, AnyResPlan]:
        """float32 [1 + rows * cols, 3, tile, tile]: the thumbnail, then the tiles row by row. `size`: the image's
        (height, width) before a reduced decode (backends.media.images.decode_reduced), which the plan is made of."""
        plan = self.plan(*(size or (image.height, image.width)))
        resample = Image.Resampling(preprocess.resample)
        fitted = np.asarray(image.resize(plan.resized[::-1], resample=resample), dtype=np.uint8)
        (top, extra_y), (left, extra_x) = (divmod(c - r, 2) for c, r in zip(plan.canvas, plan.resized))
        canvas = np.zeros((*plan.canvas, 3), dtype=np.uint8)
        canvas[top:top + plan.resized[0], left:left + plan.resized[1]] = fitted
        rows, cols = plan.grid
        tiles = canvas.reshape(rows, self.tile, cols, self.tile, 3).transpose(0, 2, 1, 3, 4).reshape(-1, self.tile,
                                                                                                     self.tile, 3)
        thumbnail = image.resize(thumbnail_size(preprocess)[::-1], resample=resample)
        pieces = [thumbnail, *(Image.fromarray(t) for t in tiles)]
        return preprocess.batch(pieces), plan


def thumbnail_size(preprocess: ImagePreprocessor) -> tuple[int, int]:
    """(height, width) of the thumbnail: the whole image squashed to the processor's size."""
    size = preprocess.size
    return (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
