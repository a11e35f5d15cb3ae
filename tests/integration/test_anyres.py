"""The served `anyres` against transformers' LlavaNextProcessor on the same tiny LLaVA-NeXT checkpoint: tiles
pixel for pixel and the number of image tokens the processor expands `<image>` into; awkward images."""
from __future__ import annotations

import io

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image, ImageOps

from tests.conftest import encode, random_image


@pytest.fixture(scope="module")
def processor(llava_checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava_checkpoint)


def tile(server, data: bytes):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        image = httpclient.InferInput("image", [1], "BYTES")
        image.set_data_from_numpy(np.array([data], dtype=object))
        result = client.infer("anyres", [image])
        return result.as_numpy("pixel_values"), int(result.as_numpy("num_image_tokens")[0])
    finally:
        client.close()


def expected(processor, image: Image.Image):
    out = processor(images=image, text="<image>", return_tensors="np")
    tokens = int((out["input_ids"][0] == processor.tokenizer.convert_tokens_to_ids("<image>")).sum())
    return out["pixel_values"][0], tokens


def gif(frames: int = 3) -> bytes:
    images = [random_image(90, 60, seed=i).convert("P") for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:], duration=100, loop=0)
    return buf.getvalue()


def png16(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(3).integers(0, 65535, (height, width), dtype=np.uint16)
    return encode(Image.fromarray(pixels), "PNG")  # mode I;16


@pytest.mark.parametrize("make", [
    lambda: random_image(640, 480), lambda: random_image(300, 1100, seed=2), lambda: random_image(1, 1),
    lambda: random_image(10000, 1, seed=4), lambda: random_image(57, 200, seed=5, mode="RGBA"),
    lambda: random_image(120, 80, seed=6).convert("CMYK"),
], ids=["640x480", "tall", "1x1", "10000x1", "rgba", "cmyk"])
def test_tiles_and_token_count_equal_the_processor(server, processor, make):
    image = make()
    fmt = "JPEG" if image.mode == "CMYK" else "PNG"
    data = encode(image, fmt)
    pixels, tokens = tile(server, data)
    reference_pixels, reference_tokens = expected(processor, Image.open(io.BytesIO(data)).convert("RGB")
                                                  if image.mode != "RGBA" else image)
    np.testing.assert_array_equal(pixels, reference_pixels)
    assert tokens == reference_tokens


def test_animated_gif_uses_its_first_frame_and_16_bit_png_is_read(server, processor):
    for data in (gif(), png16(70, 50)):
        pixels, tokens = tile(server, data)
        reference_pixels, reference_tokens = expected(processor, Image.open(io.BytesIO(data)).convert("RGB"))
        np.testing.assert_array_equal(pixels, reference_pixels)
        assert tokens == reference_tokens


def test_exif_rotation_is_honoured(server, processor):
    image = random_image(200, 100, seed=9)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    data = encode(image, "JPEG", exif=exif.tobytes())
    pixels, tokens = tile(server, data)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert upright.size == (100, 200)
    reference_pixels, reference_tokens = expected(processor, upright)
    np.testing.assert_array_equal(pixels, reference_pixels)
    assert tokens == reference_tokens


def test_decompression_bomb_and_garbage_are_invalid_and_server_keeps_serving(server):
    bomb = io.BytesIO()
    Image.new("1", (50000, 50000)).save(bomb, "PNG")
    for data, message in ((bomb.getvalue(), "pixels"), (b"not an image", "not a known image")):
        with pytest.raises(Exception) as error:
            tile(server, data)
        assert message in str(error.value) and "400" in str(error.value)
    assert tile(server, encode(random_image(64, 64)))[1] > 0
