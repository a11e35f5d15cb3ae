"""Preprocessing with torch (backends/media/device_images.py) against the Pillow path, which equals transformers:
AnyRes tiles with the same plan and layout, the image encoders' pixel tensors, pixels within rounding; decoding
falls back to Pillow with the same checks."""
from __future__ import annotations

import io
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from backends.core.errors import InvalidInput
from backends.media.device_images import (anyres_tiles, center_crop, decode_on_device, decode_to_device, nvjpeg_decode,
                                          pixel_values, read_on_host)
from backends.media.images import ImagePreprocessor, decode_image
from backends.media.images import center_crop as numpy_center_crop
from backends.vision.anyres import LLAVA_1_6_PINPOINTS, AnyResTiler
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
    assert plan == expected_plan
    rounding_only(tiles, expected, preprocess)


def rounding_only(pixels: torch.Tensor, expected: np.ndarray, preprocess: ImagePreprocessor) -> None:
    assert pixels.shape == expected.shape and pixels.dtype == torch.float32
    levels = (pixels.numpy() - expected) * np.asarray(preprocess.image_std, dtype=np.float32)[:, None, None] * 255
    assert np.abs(levels).max() < 6.5  # rounding only: a level or two, a few more where the pass order differs
    assert np.abs(levels).mean() < 0.25, "more than rounding: the mean difference is a quarter of a level"


@pytest.mark.parametrize("processor", ["vit", "clip"])
@pytest.mark.parametrize("height, width", [(1, 1), (224, 224), (480, 640), (2160, 3840), (3000, 50), (337, 1009)])
def test_encoder_pixels_match_the_pillow_path_within_rounding(tmp_path, processor, height, width):
    from transformers import CLIPImageProcessorPil, ViTImageProcessorPil

    (ViTImageProcessorPil() if processor == "vit" else CLIPImageProcessorPil()).save_pretrained(tmp_path)
    preprocess = ImagePreprocessor.from_json(tmp_path / "preprocessor_config.json")
    data = png(random_image(max(1, width // 8), max(1, height // 8), seed=width).resize((width, height)))
    rounding_only(pixel_values([decode_to_device(data, CPU, nvjpeg=False)], preprocess)[0],
                  preprocess(decode_image(data)), preprocess)


def test_a_batch_of_mixed_sizes_gives_each_image_its_own_pixels(tmp_path):
    from transformers import CLIPImageProcessorPil

    CLIPImageProcessorPil().save_pretrained(tmp_path)
    preprocess = ImagePreprocessor.from_json(tmp_path / "preprocessor_config.json")
    images = [torch.from_numpy(np.array(random_image(w, h, seed=i))).permute(2, 0, 1)
              for i, (w, h) in enumerate([(300, 200), (64, 64), (300, 200), (50, 400)])]
    batched = pixel_values(images, preprocess)
    assert batched.shape == (4, 3, 224, 224)
    for image, got in zip(images, batched):
        torch.testing.assert_close(got, pixel_values([image], preprocess)[0], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, 7, 9), (3, 2, 2), (3, 6, 1), (3, 1, 12)])
def test_center_crop_pads_and_crops_as_the_numpy_path(shape):
    pixels = np.random.default_rng(0).integers(1, 256, shape, dtype=np.uint8)
    np.testing.assert_array_equal(center_crop(torch.from_numpy(pixels)[None], 4, 5)[0].numpy(),
                                  numpy_center_crop(pixels, 4, 5))


def encoded(kind: str) -> bytes:
    image, out = random_image(40, 24, seed=3), io.BytesIO()
    if kind == "rgb-jpeg":
        image.save(out, "JPEG")
    elif kind == "cmyk-jpeg":
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
    return out.getvalue()


@pytest.fixture
def nvjpeg(monkeypatch):
    """A stand-in for torchvision's nvJPEG decoder (absent on CPU machines): it records what it was asked to decode,
    returns a marker, or fails as nvJPEG does on a JPEG it cannot take."""
    calls, behaviour = [], {"fail": False}

    def decode_jpeg(data, mode, device):
        if isinstance(data, list):  # a batch: one call, failing as a whole
            if behaviour["fail"]:
                raise RuntimeError("nvjpegDecodeBatched failed")
            calls.append([d.numpy().tobytes() for d in data])
            return [torch.full((3, 1, 1), 7, dtype=torch.uint8) for _ in data]
        calls.append(data.numpy().tobytes())
        if behaviour["fail"]:
            raise RuntimeError("nvjpegDecode failed")
        return torch.full((3, 1, 1), 7, dtype=torch.uint8)
    io_module = types.SimpleNamespace(decode_jpeg=decode_jpeg, ImageReadMode=types.SimpleNamespace(RGB="RGB"))
    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(io=io_module))
    monkeypatch.setitem(sys.modules, "torchvision.io", io_module)
    return calls, behaviour


def test_plain_jpegs_go_to_nvjpeg_in_one_batch_and_the_rest_to_pillow(nvjpeg):
    calls, _ = nvjpeg
    jpeg, png_data = encoded("rgb-jpeg"), encoded("rgba-png")
    decoded = decode_on_device([read_on_host(x, nvjpeg=True) for x in (jpeg, png_data, jpeg)], CPU)
    assert calls == [[jpeg, jpeg]]
    assert decoded[0].unique().tolist() == decoded[2].unique().tolist() == [7]
    np.testing.assert_array_equal(decoded[1].numpy(), np.asarray(decode_image(png_data)).transpose(2, 0, 1))


@pytest.mark.parametrize("kind", ["cmyk-jpeg", "exif-rotated-jpeg", "png-16bit", "rgba-png", "gif"])
def test_what_nvjpeg_cannot_decode_goes_to_pillow_with_the_same_pixels(nvjpeg, kind):
    calls, _ = nvjpeg
    data = encoded(kind)
    pixels = decode_to_device(data, CPU, nvjpeg=True)
    assert calls == []  # routed around nvJPEG, not through it
    np.testing.assert_array_equal(pixels.numpy(), np.asarray(decode_image(data)).transpose(2, 0, 1))
    if kind == "exif-rotated-jpeg":
        assert tuple(pixels.shape[1:]) == (40, 24)


def test_a_jpeg_nvjpeg_refuses_is_decoded_by_pillow(nvjpeg):
    calls, behaviour = nvjpeg
    behaviour["fail"] = True
    data = encoded("rgb-jpeg")
    pixels = decode_on_device([read_on_host(data, nvjpeg=True)] * 2, CPU)
    assert calls == [data, data]  # the batch failed: each one alone, then Pillow
    for one in pixels:
        np.testing.assert_array_equal(one.numpy(), np.asarray(decode_image(data)).transpose(2, 0, 1))


@pytest.mark.parametrize("data, reason", [(b"", "empty"), (b"not an image at all", "not a known image format")])
def test_bad_bytes_are_refused_with_the_reason(data, reason):
    with pytest.raises(InvalidInput, match=reason):
        decode_to_device(data, CPU, nvjpeg=False)


def blocks_overwritten_by_decodes(decode, rounds: int = 20) -> int:
    """pytorch/vision#9606's trap, on the default stream: tensors of known values are summed behind a long kernel and
    freed while the sums still wait; a decode of the same size follows at once. Returns how many sums changed (the
    decoder was handed their blocks and wrote them before the sums ran)."""
    device, (height, width) = torch.device("cuda"), (1080, 1920)
    image, out = random_image(width, height, seed=5), io.BytesIO()
    image.save(out, "JPEG")
    files = [torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)] * 4
    changed = 0
    for _ in range(rounds):
        tensors = [torch.ones(3, height, width, dtype=torch.uint8, device=device) for _ in range(8)]
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~30 ms of one thread spinning: the sums below wait for it
        sums = [t.sum(dtype=torch.int64) for t in tensors]
        del tensors
        decode(files, device)
        changed += sum(int(s) != 3 * height * width for s in sums)
    return changed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG decodes on CUDA")
def test_nvjpeg_decode_never_writes_memory_that_queued_kernels_read():
    assert blocks_overwritten_by_decodes(nvjpeg_decode) == 0
