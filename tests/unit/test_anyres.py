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
from tests.conftest import random_image

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
