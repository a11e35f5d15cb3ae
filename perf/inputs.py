"""Real input data for perf_analyzer: encoded images of several sizes, aspect ratios and formats, and texts.

perf_analyzer's `--input-data` JSON takes a BYTES input as base64 of Triton's raw layout (a 4-byte little-endian
length before each element), which is what `bytes_entry` writes.
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from build_engines.repository import serialize_bytes_tensor

# (width, height, format): thumbnails to photos, portrait, panorama, a 12 MP phone shot
IMAGE_SET = [(224, 224, "JPEG"), (640, 480, "JPEG"), (1024, 768, "PNG"), (480, 800, "WEBP"), (1920, 1080, "JPEG"),
             (2000, 500, "JPEG"), (4000, 3000, "JPEG")]
# pre-sized thumbnails: decoding is cheap, so the model itself is what gets measured
THUMBNAIL_SET = [(224, 224, "JPEG")]
IMAGE_SETS = {"mixed": IMAGE_SET, "thumbnails": THUMBNAIL_SET}
TEXT_SET = ["a photo of a cat", "a red car parked on the street at night",
            "two dogs playing with a ball on the grass in a sunny park", "tree"]


def photo_like(width: int, height: int, seed: int) -> Image.Image:
    """Smooth gradients plus noise: compresses like a photo (random noise alone would not)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    noise = rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def encoded_images(image_set=IMAGE_SET) -> list[bytes]:
    out = []
    for seed, (width, height, fmt) in enumerate(image_set):
        buf = io.BytesIO()
        photo_like(width, height, seed).save(buf, fmt, quality=90) if fmt in ("JPEG", "WEBP") else \
            photo_like(width, height, seed).save(buf, fmt)
        out.append(buf.getvalue())
    return out


def with_comment(jpeg: bytes, text: str) -> bytes:
    """The same JPEG with a comment segment (COM) after its start marker: the same pixels and decoding work, another
    file, so caches keyed by the file's digest (the `vlm`'s image features, its prefix cache) do not know it."""
    if jpeg[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG file")
    payload = text.encode()
    return jpeg[:2] + b"\xff\xfe" + (len(payload) + 2).to_bytes(2, "big") + payload + jpeg[2:]


def bytes_entry(item: bytes) -> dict:
    return {"b64": base64.b64encode(serialize_bytes_tensor([item])).decode(), "shape": [1]}


def write_input_data(path: Path, input_name: str, items: list[bytes]) -> Path:
    """One perf_analyzer step per item; perf_analyzer cycles through them."""
    path.write_text(json.dumps({"data": [{input_name: bytes_entry(item)} for item in items]}))
    return path


def model_items(model: str, image_set: str = "mixed") -> list[bytes]:
    """The encoded inputs a model is benchmarked with."""
    if model in ("vit", "clip_vision"):
        return encoded_images(IMAGE_SETS[image_set])
    if model == "clip_text":
        return [t.encode() for t in TEXT_SET]
    raise ValueError(f"no input data generator for {model!r}")


def model_input_data(model: str, folder: Path, image_set: str = "mixed") -> Path:
    name = "text" if model == "clip_text" else "image"
    return write_input_data(folder / f"{model}-{image_set}.json", name, model_items(model, image_set))
