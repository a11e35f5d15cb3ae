"""Decoding and preprocessing: equal to the checkpoint's Hugging Face image processor; bad images rejected."""
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor

from backends.core.errors import InvalidInput
from backends.media.images import ImagePreprocessor, check_resize, decode_image
from tests.conftest import encode, random_image

SIZES = [(224, 224), (640, 480), (480, 640), (97, 301), (1000, 37), (16, 16), (3000, 2000)]


@pytest.mark.parametrize("family", ["vit", "clip"])
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_preprocessing_equals_hf_processor(family, mode, request, tmp_path):
    checkpoint = request.getfixturevalue(f"{family}_checkpoint")
    processor = AutoImageProcessor.from_pretrained(checkpoint)
    processor.save_pretrained(tmp_path)  # the builder stores it the same way in the model folder
    ours = ImagePreprocessor.from_json(tmp_path / "preprocessor_config.json")
    for i, (w, h) in enumerate(SIZES):
        raw = random_image(w, h, seed=i, mode=mode)
        image = decode_image(encode(raw))
        expected = processor(images=image, return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape == (3, *ours.output_size)
        np.testing.assert_array_equal(got, expected)


def test_alpha_is_composited_on_white_like_hf(clip_checkpoint):
    processor = AutoImageProcessor.from_pretrained(clip_checkpoint)  # do_convert_rgb=True
    raw = random_image(300, 200, seed=3, mode="RGBA")
    expected = processor(images=raw, return_tensors="np")["pixel_values"][0]
    ours = ImagePreprocessor(**{k: getattr(processor, k) for k in (
        "do_resize", "size", "resample", "do_center_crop", "crop_size", "do_rescale", "rescale_factor",
        "do_normalize", "image_mean", "image_std")})
    np.testing.assert_array_equal(ours(decode_image(encode(raw))), expected)


def test_exif_orientation_is_honoured():
    raw = random_image(40, 20, seed=1)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    decoded = decode_image(encode(raw, "JPEG", exif=exif.tobytes()))
    assert decoded.size == (20, 40)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny IDAT: a decompression bomb's calling card."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data, message", [
    (b"", "empty"),
    (b"this is not an image", "not a known image format"),
    (png_header_only(20000, 20000), "decompression bomb"),
    (png_header_only(7000, 7000), "above the limit"),
    (encode(random_image(64, 64))[:200], "corrupt or truncated"),
    (b"P6\n1a 1\n255\n\x00\x00\x00", "header is corrupt: ValueError"),  # Pillow's PPM plugin: ValueError
])
def test_bad_images_are_invalid_input(data, message):
    with pytest.raises(InvalidInput, match=message):
        decode_image(data)


def test_an_extreme_aspect_ratio_is_refused_before_the_resize(clip_checkpoint):
    """A 143-byte 20000x1 PNG, resized shortest edge to 224, was 224 x 4,480,000 pixels (26-52 s, 9.8 GB)."""
    preprocess = ImagePreprocessor.from_json(Path(clip_checkpoint) / "preprocessor_config.json")
    with pytest.raises(InvalidInput, match=r"20000x1 \(aspect ratio 20000:1\).*above the limit"):
        preprocess(decode_image(encode(Image.new("RGB", (20000, 1)))))
    assert preprocess(decode_image(encode(Image.new("RGB", (2000, 100))))).shape[0] == 3  # 20:1 is fine
    with pytest.raises(InvalidInput, match="an empty image"):
        check_resize(20000, 1, (1024, 0))


def test_real_20000x20000_png_is_rejected_before_decoding():
    big = encode(Image.new("1", (20000, 20000)), optimize=True)  # 1-bit: small file, 400 Mpixel claim
    with pytest.raises(InvalidInput, match="decompression bomb|above the limit"):
        decode_image(big)
