"""AnyRes preprocessing with torch (backends/device_images.py) against the Pillow path, which equals transformers:
same plan and layout, pixels within rounding; decoding falls back to Pillow with the same checks."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from backends.vision.anyres import LLAVA_1_6_PINPOINTS, AnyResTiler
from backends.media.device_images import anyres_tiles, decode_to_device
from backends.core.errors import InvalidInput
from backends.media.images import ImagePreprocessor, decode_image
from tests.conftest import random_image

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def preprocess(tmp_path_factory) -> ImagePreprocessor:
    from transformers import LlavaNextImageProcessorPil

    folder = tmp_path_factory.mktemp("llava-processor")
    LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                               image_grid_pinpoints=[list(p) for p in LLAVA_1_6_PINPOINTS]).save_pretrained(folder)
    return ImagePreprocessor.from_json(folder / "preprocessor_config.json")


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("height, width", [(1, 1), (32, 32), (480, 640), (2160, 3840), (7999, 40), (337, 1009)])
def test_tiles_match_the_pillow_path_within_rounding(preprocess, height, width):
    tiler = AnyResTiler(LLAVA_1_6_PINPOINTS)
    smooth = random_image(max(1, width // 8), max(1, height // 8), seed=height).resize((width, height))
    data = png(smooth)
    expected, expected_plan = tiler.tiles(decode_image(data), preprocess)
    tiles, plan = anyres_tiles(tiler, decode_to_device(data, CPU, nvjpeg=False), preprocess)
    assert plan == expected_plan and tiles.shape == expected.shape and tiles.dtype == torch.float32
    levels = (tiles.numpy() - expected) * np.asarray(preprocess.image_std, dtype=np.float32)[:, None, None] * 255
    assert np.abs(levels).max() < 6.5  # rounding only: a level or two, a few more where the pass order differs
    assert np.abs(levels).mean() < 0.25, "more than rounding: the mean difference is a quarter of a level"


@pytest.mark.parametrize("kind", ["cmyk-jpeg", "exif-rotated-jpeg", "png-16bit", "rgba-png", "gif"])
def test_decode_falls_back_to_pillow_with_the_same_pixels(kind):
    image = random_image(40, 24, seed=3)
    out = io.BytesIO()
    if kind == "cmyk-jpeg":
        image.convert("CMYK").save(out, "JPEG")
    elif kind == "exif-rotated-jpeg":
        exif = Image.Exif()
        exif[0x0112] = 6  # rotate 90 degrees clockwise to display
        image.save(out, "JPEG", exif=exif.tobytes())
    elif kind == "png-16bit":
        Image.fromarray(np.asarray(image.convert("L"), dtype=np.uint16) * 257).save(out, "PNG")
    elif kind == "rgba-png":
        random_image(40, 24, seed=4, mode="RGBA").save(out, "PNG")
    else:
        image.save(out, "GIF")
    data = out.getvalue()
    pixels = decode_to_device(data, CPU, nvjpeg=False)
    expected = np.asarray(decode_image(data)).transpose(2, 0, 1)
    np.testing.assert_array_equal(pixels.numpy(), expected)
    if kind == "exif-rotated-jpeg":
        assert tuple(pixels.shape[1:]) == (40, 24)


@pytest.mark.parametrize("data, reason", [(b"", "empty"), (b"not an image at all", "not a known image format")])
def test_bad_bytes_are_refused_with_the_reason(data, reason):
    with pytest.raises(InvalidInput, match=reason):
        decode_to_device(data, CPU, nvjpeg=False)
