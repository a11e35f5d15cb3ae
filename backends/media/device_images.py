"""Image preprocessing on the model's device: decode (nvJPEG on CUDA), resize, crop or pad and tile, normalise with
torch; AnyRes tiles for `vlm`, one pixel tensor for the image encoders (`vit`, `clip_vision`).

Why: for a 4K photo the CPU path (Pillow decode, then two antialiased bicubic resizes from 8 million pixels) costs
more than the vision tower and the prefill together. On a GPU, torchvision's nvJPEG decode and torch's antialiased
bicubic (the same filter as Pillow's, computed in float instead of Pillow's 8-bit fixed point) take milliseconds.
Pixels differ from the CPU path by rounding (a level or two of 255 on some pixels), so the CPU path stays the
default where exact parity with transformers matters; the plan and the token count are the same.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from backends.media.images import DEFAULT_MAX_PIXELS, ImagePreprocessor, decode_image, load_rgb, open_image
from backends.vision.anyres import AnyResPlan, AnyResTiler

TORCH_MODES = {Image.Resampling.BICUBIC: "bicubic", Image.Resampling.BILINEAR: "bilinear"}
EXIF_ORIENTATION = 0x0112
log = logging.getLogger(__name__)


def nvjpeg_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import torchvision.io  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


@dataclass(frozen=True)
class Jpeg:
    """A plain RGB/greyscale JPEG for nvJPEG: its bytes, its header already checked by Pillow."""

    data: bytes
    size: tuple[int, int]  # (width, height)
    max_pixels: int  # the model's limit, for Pillow should nvJPEG refuse it


def read_on_host(data: bytes, nvjpeg: bool, max_pixels: int = DEFAULT_MAX_PIXELS) -> Jpeg | torch.Tensor:
    """The host's share of decoding (a pool thread's work): the header checked, then a plain JPEG kept for nvJPEG
    when `nvjpeg`, and anything else (other formats, CMYK, EXIF-rotated) decoded by Pillow to uint8 [3, H, W]."""
    image = open_image(data, max_pixels)
    if nvjpeg and image.format == "JPEG" and image.mode in ("RGB", "L") \
            and image.getexif().get(EXIF_ORIENTATION, 1) == 1:
        return Jpeg(data, image.size, max_pixels)
    return torch.from_numpy(np.array(load_rgb(image), dtype=np.uint8)).permute(2, 0, 1)


def decode_on_device(items: list[Jpeg | torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`read_on_host`'s results -> uint8 [3, H, W] each on `device`: the JPEGs in one batched nvJPEG call (one by
    one if that fails, and by Pillow, which decodes it or says what is wrong with it, where nvJPEG refuses one)."""
    jpegs = [i for i, item in enumerate(items) if isinstance(item, Jpeg)]
    out = [None if isinstance(item, Jpeg) else item.to(device) for item in items]
    if jpegs:
        try:
            decoded = nvjpeg_decode([file_bytes(items[i]) for i in jpegs], device)
        except RuntimeError:
            decoded = [decode_one(items[i], device) for i in jpegs]
        for i, pixels in zip(jpegs, decoded):
            out[i] = pixels
    return out


def file_bytes(jpeg: Jpeg) -> torch.Tensor:
    return torch.frombuffer(bytearray(jpeg.data), dtype=torch.uint8)


@functools.cache
def _decode_stream(device: torch.device) -> tuple[torch.cuda.Stream, threading.Lock]:
    return torch.cuda.Stream(device), threading.Lock()


def nvjpeg_decode(data: torch.Tensor | list[torch.Tensor], device: torch.device) -> torch.Tensor | list[torch.Tensor]:
    """torchvision's `decode_jpeg` (one file or a batch), kept from writing into memory that queued kernels still read.

    Why: the decoder allocates its outputs on the caller's stream, where the caching allocator hands out a block as
    soon as it is freed, and nvJPEG's hardware engine writes them without waiting for the kernels queued before
    (pytorch/vision#9606). On the H200 that overwrote the LLM engine's KV slot indices mid-step (a device-side
    assert in `index_copy_`; perf/results/h200/2026-12-03-qos-vlm-failure-log.txt). Here the outputs come from a
    stream of their own, used by one decode at a time and drained after it; they are recorded on the caller's
    stream, so their blocks are not handed out again before its kernels have read them."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if device.type != "cuda":  # no nvJPEG, no hazard
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    stream, lock = _decode_stream(device)
    caller = torch.cuda.current_stream(device)
    with lock, torch.cuda.stream(stream):
        decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        stream.synchronize()
    for pixels in decoded if isinstance(decoded, list) else [decoded]:
        pixels.record_stream(caller)
    return decoded


def decode_one(jpeg: Jpeg, device: torch.device) -> torch.Tensor:
    try:
        return nvjpeg_decode(file_bytes(jpeg), device)
    except RuntimeError as e:  # a JPEG nvJPEG cannot take
        log.warning("nvJPEG refused a %dx%d JPEG (%s); decoding it with Pillow", *jpeg.size, e)
        pixels = np.array(decode_image(jpeg.data, jpeg.max_pixels), dtype=np.uint8)
        return torch.from_numpy(pixels).to(device).permute(2, 0, 1)


def decode_to_device(data: bytes, device: torch.device, nvjpeg: bool,
                     max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """One image, uint8 [3, H, W] on `device` (nvJPEG for plain JPEGs when `nvjpeg`, else Pillow)."""
    (pixels,) = decode_on_device([read_on_host(data, nvjpeg, max_pixels)], device)
    return pixels


def resize(pixels: torch.Tensor, size: tuple[int, int], resample: int) -> torch.Tensor:
    """float [N, 3, H, W] holding 0..255 -> [N, 3, *size], antialiased as Pillow, rounded to whole levels."""
    mode = TORCH_MODES[Image.Resampling(resample)]
    height, width = pixels.shape[2:]
    # One axis at a time, rounded to whole levels between the passes as Pillow does. Pillow 13 picks which axis goes
    # first by a rule not reproduced here; the smaller intermediate image agrees with it for ~85% of random sizes,
    # and the other order leaves 10-20% of the pixels one or two levels off (measured; tests bound it).
    first = (size[0], width) if width * size[0] < size[1] * height else (height, size[1])
    for step in (first, size):
        if tuple(pixels.shape[2:]) != step:
            pixels = F.interpolate(pixels, size=step, mode=mode, antialias=True, align_corners=False).round_().clamp_(0, 255)
    return pixels


def anyres_tiles(tiler: AnyResTiler, pixels: torch.Tensor, preprocess: ImagePreprocessor) \
        -> tuple[torch.Tensor, AnyResPlan]:
    """uint8 [3, H, W] -> float32 [1 + rows * cols, 3, tile, tile] on its device (thumbnail first), as
    AnyResTiler.tiles lays them out."""
    if preprocess.resample not in TORCH_MODES:
        raise ValueError(f"resample {preprocess.resample} has no torch equivalent; use the CPU path")
    plan = tiler.plan(pixels.shape[1], pixels.shape[2])
    image = pixels[None].float()
    fitted = resize(image, plan.resized, preprocess.resample)
    (top, _), (left, _) = (divmod(c - r, 2) for c, r in zip(plan.canvas, plan.resized))
    canvas = image.new_zeros(1, 3, *plan.canvas)
    canvas[..., top:top + plan.resized[0], left:left + plan.resized[1]] = fitted
    rows, cols, t = *plan.grid, tiler.tile
    tiles = canvas.reshape(3, rows, t, cols, t).permute(1, 3, 0, 2, 4).reshape(-1, 3, t, t)
    size = preprocess.size
    thumb = (size["height"], size["width"]) if "height" in size else (size["shortest_edge"],) * 2
    return normalise(torch.cat([resize(image, thumb, preprocess.resample), tiles]), preprocess), plan


def pixel_values(images: list[torch.Tensor], preprocess: ImagePreprocessor) -> torch.Tensor:
    """uint8 [3, H, W] each -> float32 [N, 3, h, w] on their device: ImagePreprocessor's resize, center crop,
    rescale and normalise, in torch; images of one size are resized together (a batch of thumbnails is one call)."""
    if preprocess.resample not in TORCH_MODES:
        raise ValueError(f"resample {preprocess.resample} has no torch equivalent; use the CPU path")
    by_size: dict[tuple, list[int]] = {}
    for i, pixels in enumerate(images):
        by_size.setdefault(tuple(pixels.shape[1:]), []).append(i)
    out = [None] * len(images)
    for (height, width), indices in by_size.items():
        group = torch.stack([images[i] for i in indices]).float()
        if preprocess.do_resize:
            group = resize(group, preprocess.resized_size(height, width), preprocess.resample)
        if preprocess.do_center_crop and preprocess.crop_size:
            group = center_crop(group, preprocess.crop_size["height"], preprocess.crop_size["width"])
        for i, pixels in zip(indices, group):
            out[i] = pixels
    return normalise(torch.stack(out), preprocess)


def center_crop(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, C, H, W] cropped around the center; zero-padded first where it is smaller (as transformers' center_crop
    and backends.media.images.center_crop)."""
    h, w = image.shape[2:]
    if h < height or w < width:
        padded = image.new_zeros(*image.shape[:2], max(h, height), max(w, width))
        top, left = -(-(padded.shape[2] - h) // 2), -(-(padded.shape[3] - w) // 2)  # rounded up
        padded[..., top:top + h, left:left + w] = image
        image, h, w = padded, *padded.shape[2:]
    top, left = (h - height) // 2, (w - width) // 2
    return image[..., top:top + height, left:left + width]


def normalise(out: torch.Tensor, preprocess: ImagePreprocessor) -> torch.Tensor:
    """Float pixels holding 0..255 -> rescaled and normalised as the processor says."""
    if preprocess.do_rescale:
        out = out * preprocess.rescale_factor
    if preprocess.do_normalize:
        mean = torch.tensor(preprocess.image_mean, device=out.device)[:, None, None]
        std = torch.tensor(preprocess.image_std, device=out.device)[:, None, None]
        out = (out - mean) / std
    return out
