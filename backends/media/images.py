"""Image decoding and preprocessing that match a checkpoint's Hugging Face image processor.

Decoding is defensive (size limits before pixels are decoded, EXIF orientation honoured, alpha composited on
white as transformers' `convert_to_rgb` does); preprocessing reproduces the processor's resize / center crop /
rescale / normalise steps with the same Pillow calls and float arithmetic, so outputs are bit-identical.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from backends.core.errors import InvalidInput

DEFAULT_MAX_PIXELS = 40_000_000  # ~6300x6300; larger inputs are rejected before their pixels are decoded


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Encoded bytes (JPEG/PNG/WebP/...) -> RGB PIL image, or InvalidInput saying what is wrong."""
    return load_rgb(open_image(data, max_pixels))


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Read only the header: format, size and mode, checked against `max_pixels` before any pixel is decoded."""
    if not data:
        raise InvalidInput("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise InvalidInput(f"image rejected as a decompression bomb: {exc}") from None
    except UnidentifiedImageError:
        raise InvalidInput(f"image bytes ({len(data)} bytes, starting {data[:8]!r}) are not a known image "
                           "format (JPEG, PNG, WebP, GIF, BMP, TIFF, ...)") from None
    except MemoryError:
        raise
    except Exception as exc:  # Pillow's format plugins raise OSError, ValueError, SyntaxError, struct.error, ...
        raise InvalidInput(f"image header is corrupt: {type(exc).__name__}: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidInput(f"image is {width}x{height} = {width * height} pixels, above the limit of {max_pixels}")
    if width < 1 or height < 1:
        raise InvalidInput(f"image has an empty size {width}x{height}")
    return image


def load_rgb(image: Image.Image) -> Image.Image:
    """Decode the pixels of an opened image, turned as its EXIF orientation says, as RGB."""
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
        return to_rgb(image)
    except MemoryError:
        raise
    except Exception as exc:  # as in open_image: whatever a plugin raises on bad data
        raise InvalidInput(f"image data is corrupt or truncated: {type(exc).__name__}: {exc}") from None


def turned(image: Image.Image) -> bool:
    """Whether the file stores the image a quarter turn from how its EXIF orientation says to show it."""
    return image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8)


def oriented_size(image: Image.Image) -> tuple[int, int]:
    """(height, width) of an opened image as shown (EXIF orientation honoured), read from the header alone."""
    width, height = image.size
    return (width, height) if turned(image) else (height, width)


def decode_reduced(image: Image.Image, height: int, width: int) -> None:
    """Let an opened JPEG decode at the smallest of its DCT scales (1/2, 1/4, 1/8) that keeps at least height x
    width (oriented): a 4K photo bound for 672 px tiles decodes at 1/4, about 3x faster, and leaves 1/16 of the
    pixels to resize. Not pixel-exact with a full decode then resize (transformers' processor); other formats and
    JPEGs too small to reduce decode as they are."""
    if image.format != "JPEG":
        return
    image.draft(None, (height, width) if turned(image) else (width, height))


def check_resize(width: int, height: int, target: tuple[int, int], max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """A model's resize of a width x height image to `target` (height, width) must keep a pixel on each side and
    stay within `max_pixels`: an extreme aspect ratio (a 20000x1 PNG is 143 bytes) is refused, not resized to
    gigapixels or to nothing."""
    new_height, new_width = target
    if new_height < 1 or new_width < 1 or new_height * new_width > max_pixels:
        ratio = max(width, height) / min(width, height)
        raise InvalidInput(f"image is {width}x{height} (aspect ratio {ratio:.0f}:1): this model would resize it to "
                           f"{new_width}x{new_height}, " + ("an empty image" if min(target) < 1 else
                                                            f"above the limit of {max_pixels} pixels"))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white (what transformers' convert_to_rgb does)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImagePreprocessor:
    """The subset of a Hugging Face image processor config that ViT and CLIP processors use."""

    do_resize: bool
    size: dict[str, int]
    resample: int
    do_center_crop: bool
    crop_size: dict[str, int] | None
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_json(cls, path: str | Path) -> ImagePreprocessor:
        """Read a preprocessor_config.json written by the processor's save_pretrained (all fields explicit)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> ImagePreprocessor:
        return cls(
            do_resize=bool(cfg.get("do_resize", True)),
            size=dict(cfg["size"]),
            resample=int(cfg.get("resample", Image.Resampling.BILINEAR)),
            do_center_crop=bool(cfg.get("do_center_crop", False)),
            crop_size=dict(cfg["crop_size"]) if cfg.get("crop_size") else None,
            do_rescale=bool(cfg.get("do_rescale", True)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
            do_normalize=bool(cfg.get("do_normalize", True)),
            image_mean=tuple(cfg["image_mean"]),
            image_std=tuple(cfg["image_std"]),
        )

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the tensor fed to the model."""
        if self.do_center_crop and self.crop_size:
            return self.crop_size["height"], self.crop_size["width"]
        if "height" in self.size:
            return self.size["height"], self.size["width"]
        raise ValueError("a shortest_edge resize without center crop gives variable sizes; not supported")

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """Target (height, width) of the resize step, as transformers computes it."""
        if "shortest_edge" in self.size:
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.size["shortest_edge"], int(self.size["shortest_edge"] * long / short)
            target = (new_long, new_short) if width <= height else (new_short, new_long)
            check_resize(width, height, target)
            return target
        return self.size["height"], self.size["width"]

    def __call__(self, image: Image.Image) -> np.ndarray:
        """RGB PIL image -> float32 [3, H, W]."""
        if self.do_resize:
            height, width = self.resized_size(image.height, image.width)
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
        if self.do_center_crop and self.crop_size:
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:  # float64 then float32, as transformers' rescale
            out = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            out = pixels.astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[:, None, None]
            out = (out - mean) / std
        return out

    def batch(self, images: list[Image.Image]) -> np.ndarray:
        """Several images -> float32 [N, 3, H, W]."""
        return np.stack([self(image) for image in images])


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """Channels-first center crop; zero-pads first when the image is smaller (as transformers' center_crop)."""
    _, h, w = pixels.shape
    if h < height or w < width:
        new_h, new_w = max(h, height), max(w, width)
        padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
        top, left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
        padded[:, top : top + h, left : left + w] = pixels
        pixels, h, w = padded, new_h, new_w
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top : top + height, left : left + width]
