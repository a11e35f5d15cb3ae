"""AnyRes tiling against transformers' LLaVA-NeXT processor: the grid, the resize inside it, the visual-token count
(200 random sizes from 32 to 8000 px), and the tiles' pixels (a spread of sizes and aspect ratios)."""
from __future__ import annotations

import types

import numpy as np
import pytest
from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor
from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
from transformers.image_utils import ChannelDimension

from backends.media.images import ImagePreprocessor
from backends.vision.anyres import LLAVA_1_6_PINPOINTS, AnyResTiler, grid_pinpoints
from tests.conftest import encode, random_image

RNG = np.random.default_rng(7)
SIZES = [tuple(int(v) for v in RNG.integers(32, 8001, 2)) for _ in range(200)]
PINPOINT_LISTS = {"llava-1.6": LLAVA_1_6_PINPOINTS, "anyres_max_9": grid_pinpoints(9, 336)}


def reference_tokens(height: int, width: int, pinpoints) -> int:
    """LlavaNextProcessor's count as LLaVA-1.6 checkpoints configure it: CLIP's CLS counted
    (num_additional_image_tokens 1), then dropped ("default" feature selection); 336 px tiles of 14 px patches."""
    processor = types.SimpleNamespace(image_processor=types.SimpleNamespace(image_grid_pinpoints=[list(p) for p in
                                                                                                   pinpoints]),
                                      patch_size=14, num_additional_image_tokens=1)
    processor._get_unpadded_features = lambda *a: LlavaNextProcessor._get_unpadded_features(processor, *a)
    return LlavaNextProcessor._get_number_of_features(processor, height, width, 336, 336) - 1


@pytest.mark.parametrize("name", PINPOINT_LISTS)
def test_grid_resize_and_token_count_equal_transformers_for_200_sizes(name):
    pinpoints = PINPOINT_LISTS[name]
    tiler = AnyResTiler(pinpoints)
    for height, width in SIZES:
        plan = tiler.plan(height, width)
        assert plan.canvas == tuple(select_best_resolution((height, width), [list(p) for p in pinpoints]))
        shape_only = np.broadcast_to(np.uint8(0), (3, height, width))
        assert plan.resized == get_patch_output_size(shape_only, plan.canvas, ChannelDimension.FIRST)
        assert plan.num_image_tokens == reference_tokens(height, width, pinpoints), (height, width)


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    reference = LlavaNextImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                           image_grid_pinpoints=[list(p) for p in LLAVA_1_6_PINPOINTS])
    folder = tmp_path_factory.mktemp("llava-processor")
    reference.save_pretrained(folder)
    return reference, ImagePreprocessor.from_json(folder / "preprocessor_config.json")


@pytest.mark.parametrize("height, width", [(32, 32), (336, 336), (480, 640), (1080, 1920), (2160, 3840), (337, 1009),
                                           (7999, 40), (40, 7000), (1500, 1499)])
def test_tiles_equal_transformers_pixels(processors, height, width):
    reference, preprocess = processors
    image = random_image(width, height, seed=height + width)
    expected = reference(image, return_tensors="np")
    tiles, plan = AnyResTiler(LLAVA_1_6_PINPOINTS).tiles(image, preprocess)
    assert tiles.shape == expected["pixel_values"][0].shape == (plan.num_tiles, 3, 336, 336)
    np.testing.assert_array_equal(tiles, expected["pixel_values"][0])
    assert list(expected["image_sizes"][0]) == [height, width]


@pytest.mark.parametrize("orientation", [1, 6])
def test_a_reduced_decode_keeps_the_plan_and_stays_close_to_the_exact_tiles(processors, orientation):
    """A 3840x2160 photo JPEG (as shown) decodes at 1/4 scale, no smaller than its 672x378 fit and the 336 px
    thumbnail; the tiles' plan comes from its full size, and their pixels stay within a few levels of the exact
    ones. Stored turned (EXIF 6), the reduction is asked for in the stored orientation."""
    from PIL import Image

    from backends.media.images import decode_reduced, open_image
    from perf.inputs import photo_like

    _, preprocess = processors
    shown = photo_like(3840, 2160, seed=3)
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = shown if orientation == 1 else shown.transpose(Image.Transpose.ROTATE_90)  # 6: shown turned clockwise
    data = encode(stored, "JPEG", quality=90, exif=exif.tobytes())
    tiler = AnyResTiler(LLAVA_1_6_PINPOINTS)
    assert tiler.source_size(2160, 3840, preprocess) == (378, 672)
    image = open_image(data)
    decode_reduced(image, 378, 672)
    image.load()
    assert image.size == ((960, 540) if orientation == 1 else (540, 960))  # stored orientation, 1/4 scale

    exact, exact_plan = tiler.tiles_of_file(data, preprocess)
    reduced, plan = tiler.tiles_of_file(data, preprocess, reduced=True)
    assert plan == exact_plan and plan.image_size == (2160, 3840)
    difference = np.abs(reduced - exact)  # normalised units: a pixel level is about 0.015
    assert difference.mean() < 0.01 and difference.max() < 0.15, (difference.mean(), difference.max())


def test_a_reduced_decode_leaves_small_jpegs_and_other_formats_as_they_are(processors):
    _, preprocess = processors
    tiler = AnyResTiler(LLAVA_1_6_PINPOINTS)
    for data in (encode(random_image(1024, 768, seed=5), "JPEG"), encode(random_image(3840, 2160, seed=5), "PNG")):
        exact, _ = tiler.tiles_of_file(data, preprocess)
        np.testing.assert_array_equal(tiler.tiles_of_file(data, preprocess, reduced=True)[0], exact)
