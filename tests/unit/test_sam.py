"""The SAM engine against SamModel + SamProcessor on the same tiny checkpoint (points, a box, both, single and
multimask output), the embedding cache (a second prompt on the same image runs no encoder; LRU by bytes), and
bad prompts refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.errors import InvalidInput
from backends.images import decode_image
from backends.sam.engine import EmbeddingCache, Embedded, SamEngine
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT, encode, random_image


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint("sam", ROOT / ".checkpoints")


def reference(checkpoint, data, points=None, labels=None, box=None, multimask=True):
    from transformers import SamModel, SamProcessor

    model, processor = SamModel.from_pretrained(checkpoint).eval(), SamProcessor.from_pretrained(checkpoint)
    inputs = processor(images=decode_image(data), input_points=None if points is None else [[points.tolist()]],
                       input_labels=None if labels is None else [[labels.tolist()]],
                       input_boxes=None if box is None else [[box.tolist()]], return_tensors="pt")
    with torch.inference_mode():
        out = model(**inputs, multimask_output=multimask)
    masks = processor.post_process_masks(out.pred_masks, inputs["original_sizes"], inputs["reshaped_input_sizes"])
    return masks[0][0].numpy(), out.iou_scores[0, 0].numpy()


PROMPTS = {
    "one point": (np.array([[320.0, 240.0]]), np.array([1]), None, True),
    "fg + bg points": (np.array([[100.0, 80.0], [500.5, 400.0]]), np.array([1, 0]), None, True),
    "box": (None, None, np.array([[50.0, 60.0, 400.0, 300.0]]), False),
    "points + box": (np.array([[200.0, 150.0]]), np.array([1]), np.array([[50.0, 60.0, 400.0, 300.0]]), True),
}


@pytest.mark.parametrize("name", PROMPTS)
def test_masks_and_scores_equal_sam_model_and_processor(checkpoint, name):
    points, labels, box, multimask = PROMPTS[name]
    data = encode(random_image(640, 480, seed=4), "JPEG")
    ours = SamEngine(checkpoint, device="cpu").segment(data, points, labels, box, multimask)
    masks, scores = reference(checkpoint, data, points, labels, box[0] if box is not None else None, multimask)
    assert ours.masks.shape == masks.shape == ((3 if multimask else 1), 480, 640) and ours.masks.dtype == bool
    for got, want in zip(ours.masks, masks):
        assert (got & want).sum() / max((got | want).sum(), 1) >= 0.99
    np.testing.assert_allclose(ours.iou_scores, scores, atol=1e-3)
    assert ours.low_res_logits.shape == ((3 if multimask else 1), 256, 256)


def test_second_prompt_on_the_same_image_skips_the_encoder(checkpoint):
    engine = SamEngine(checkpoint, device="cpu")
    image, other = encode(random_image(300, 200, seed=1)), encode(random_image(300, 200, seed=2))
    engine.segment(image, np.array([[10.0, 10.0]]), np.array([1]))
    engine.segment(image, np.array([[150.0, 100.0]]), np.array([0]))
    assert (engine.encoder_runs, engine.cache.hits, engine.cache.misses) == (1, 1, 1)
    engine.segment(other, np.array([[10.0, 10.0]]), np.array([1]))
    assert engine.encoder_runs == 2


def test_cache_evicts_least_recently_used_by_bytes():
    def entry() -> Embedded:
        return Embedded(torch.zeros(1, 4, 8, 8), (8, 8), (8, 8))  # 1 KiB
    cache = EmbeddingCache(max_bytes=2 * 1024)
    cache.put("a", entry())
    cache.put("b", entry())
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", entry())
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert (cache.evictions, cache.bytes) == (1, 2 * 1024)
    cache.put("huge", Embedded(torch.zeros(1, 4, 32, 32), (8, 8), (8, 8)))  # larger than the whole cache
    assert "huge" not in cache.entries and cache.bytes == 2 * 1024


BAD = {
    "no prompt": (None, None, None, "at least one point"),
    "outside": (np.array([[700.0, 10.0]]), np.array([1]), None, "outside the 640x480 image"),
    "negative": (np.array([[-1.0, 10.0]]), np.array([1]), None, "outside"),
    "10000 points": (np.full((10000, 2), 5.0), np.ones(10000, dtype=int), None, "between 1 and 64"),
    "label 2": (np.array([[5.0, 5.0]]), np.array([2]), None, "0 \\(background\\) or 1"),
    "lengths differ": (np.array([[5.0, 5.0], [6.0, 6.0]]), np.array([1]), None, "point_labels \\[N\\]"),
    "bad box": (None, None, np.array([[50.0, 60.0, 40.0, 300.0]]), "each box needs"),
    "two boxes": (None, None, np.zeros((2, 4)), "one box"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_prompts_are_refused_with_the_reason(checkpoint, name):
    points, labels, boxes, reason = BAD[name]
    engine = SamEngine(checkpoint, device="cpu")
    with pytest.raises(InvalidInput, match=reason):
        engine.segment(encode(random_image(640, 480, seed=4)), points, labels, boxes)
    with pytest.raises(InvalidInput, match="not a known image format"):
        engine.segment(b"corrupt", np.array([[1.0, 1.0]]), np.array([1]))
