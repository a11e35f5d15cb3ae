"""The served `sam` against SamModel + SamProcessor on the same tiny checkpoint, its embedding cache seen through
the server's metrics (a second prompt on the same image is a hit and runs no encoder), the CLI's overlay, and bad
prompts refused with the reason while the server keeps serving."""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image
from tritonclient.utils import InferenceServerException

from client.sdk import Client
from tests.conftest import encode, random_image
from tests.integration.test_llm import metric
from tests.unit.test_sam import reference

IMAGE = encode(random_image(640, 480, seed=9), "JPEG")


def cache(server, name: str) -> float:
    return metric(server, f"sam_embedding_cache_{name}_total", model="sam")


def test_served_masks_equal_reference_and_second_click_hits_the_cache(server, sam_checkpoint):
    with Client(server.http_url) as client:
        hits, misses = cache(server, "hits"), cache(server, "misses")
        masks, scores, first_low_res = client.segment(IMAGE, [(320.0, 240.0)], [1])
        expected_masks, expected_scores, _ = reference(sam_checkpoint, IMAGE, np.array([[320.0, 240.0]]),
                                                       np.array([1]))
        assert masks.shape == expected_masks.shape == (3, 480, 640) and masks.dtype == bool
        for got, want in zip(masks, expected_masks):
            assert (got & want).sum() / max((got | want).sum(), 1) >= 0.99
        np.testing.assert_allclose(scores, expected_scores, atol=1e-3)
        assert (cache(server, "misses"), cache(server, "hits")) == (misses + 1, hits)
        points, labels = np.array([[100.0, 50.0], [600.0, 400.0]]), np.array([1, 0])
        masks, scores, low_res = client.segment(IMAGE, points.tolist(), labels.tolist(), multimask=False,
                                                mask_input=first_low_res[:1])  # refine it
        expected_masks, expected_scores, expected_low_res = reference(
            sam_checkpoint, IMAGE, points, labels, multimask=False, mask_input=first_low_res[:1])
        assert masks.shape == (1, 480, 640) and (masks[0] & expected_masks[0]).sum() >= 0.99 * (
            masks[0] | expected_masks[0]).sum()
        np.testing.assert_allclose(scores, expected_scores, atol=1e-3)
        np.testing.assert_allclose(low_res, expected_low_res, atol=1e-3)
        assert (cache(server, "misses"), cache(server, "hits")) == (misses + 1, hits + 1)


def test_a_request_gets_only_the_outputs_it_asks_for(server):
    """tritonclient's requested outputs: a request for the scores alone, and one for the scores and low-res logits,
    get those, equal to the answer with every output; with mask_format "rle" the masks come as COCO RLE, which
    pycocotools decodes to the same pixels, and with "packed" as bits that unpack to them."""
    from pycocotools import mask as coco

    with Client(server.http_url) as client:
        masks, scores, low_res = client.segment(IMAGE, [(200.0, 100.0)], [1])
        only = client.segment(IMAGE, [(200.0, 100.0)], [1], outputs=("iou_scores",))
        assert only[0] is None and only[2] is None
        np.testing.assert_allclose(only[1], scores, atol=1e-6)
        no_masks = client.segment(IMAGE, [(200.0, 100.0)], [1], outputs=("iou_scores", "low_res_logits"))
        assert no_masks[0] is None and masks.shape == (3, 480, 640)
        np.testing.assert_allclose(no_masks[1], scores, atol=1e-6)
        np.testing.assert_allclose(no_masks[2], low_res, atol=1e-5)
        rles, rle_scores, _ = client.segment(IMAGE, [(200.0, 100.0)], [1], mask_format="rle")
        np.testing.assert_allclose(rle_scores, scores, atol=1e-6)
        assert len(rles) == 3
        for rle, want in zip(rles, masks):
            np.testing.assert_array_equal(coco.decode(rle).astype(bool), want)
        unpacked, packed_scores, _ = client.segment(IMAGE, [(200.0, 100.0)], [1], mask_format="packed")
        np.testing.assert_allclose(packed_scores, scores, atol=1e-6)
        np.testing.assert_array_equal(unpacked, masks)
        with pytest.raises(InferenceServerException, match="mask_format must be 'binary'"):
            client.infer("sam", {"image": np.array([IMAGE], dtype=object),
                                 "point_coords": np.array([[5.0, 5.0]], np.float32),
                                 "point_labels": np.array([1], np.int32),
                                 "mask_format": np.array([b"png"], dtype=object)}, ["iou_scores"])


def test_cli_writes_an_overlay(server, tmp_path, capsys):
    from client.__main__ import main

    path = tmp_path / "photo.jpg"
    path.write_bytes(IMAGE)
    assert main(["--url", server.http_url, "segment", str(path), "--point", "320,240", "--box", "10,10,600,400"]) == 0
    overlay = Image.open(tmp_path / "photo.mask.png")
    assert overlay.size == (640, 480) and "IoU score" in capsys.readouterr().out
    assert np.asarray(overlay).astype(int).sum() != np.asarray(Image.open(io.BytesIO(IMAGE))).astype(int).sum()


BAD = {
    "no prompt": ({}, "at least one point"),
    "outside": ({"points": [(700.0, 10.0)], "labels": [1]}, "outside the 640x480 image"),
    "10000 points": ({"points": [(5.0, 5.0)] * 10000, "labels": [1] * 10000}, "between 1 and 64"),
    "label 2": ({"points": [(5.0, 5.0)], "labels": [2]}, "0 \\(background\\) or 1"),
    "lengths differ": ({"points": [(5.0, 5.0), (6.0, 6.0)], "labels": [1]}, "point_labels \\[N\\]"),
    "mask of another size": ({"points": [(5.0, 5.0)], "labels": [1], "mask_input": np.zeros((1, 64, 64))},
                             "unexpected shape|mask_input"),
}


def test_bad_prompts_are_invalid_arg_and_server_keeps_serving(server):
    with Client(server.http_url) as client:
        for name, (prompt, reason) in BAD.items():
            with pytest.raises(InferenceServerException, match=reason) as error:
                client.segment(IMAGE, **prompt)
            assert "400" in str(error.value.status()), name
        with pytest.raises(InferenceServerException, match="not a known image format"):
            client.segment(b"corrupt", [(1.0, 1.0)], [1])
        masks, _, _ = client.segment(IMAGE, [(10.0, 10.0)], [1])
    assert masks.shape[1:] == (480, 640)


def test_concurrent_clicks_share_decoder_calls_and_each_gets_its_own_answer(server):
    """Issue 24: prompts of concurrent requests run as one decoder call (our batcher hands the engine several), and
    each request's masks are what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    images = [IMAGE, encode(random_image(640, 480, seed=10), "JPEG")]
    clicks = [(images[i % 2], [(20.0 + 37 * i % 600, 15.0 + 29 * i % 450)], [1 - (i % 3 == 2)]) for i in range(24)]
    with Client(server.http_url) as client:
        alone = [client.segment(image, points, labels) for image, points, labels in clicks]
        batches, requests = metric(server, "batcher_batches_total", "sam"), metric(server, "batcher_requests_total",
                                                                                  "sam")

        def one(click):
            with Client(server.http_url) as own:
                return own.segment(*click)
        with ThreadPoolExecutor(12) as pool:
            together = list(pool.map(one, clicks))
    for (masks, scores, low_res), (want_masks, want_scores, want_low_res) in zip(together, alone):
        assert masks.shape == want_masks.shape and (masks == want_masks).mean() > 0.9999
        np.testing.assert_allclose(scores, want_scores, atol=1e-5)
        np.testing.assert_allclose(low_res, want_low_res, atol=1e-4)
    deadline = time.monotonic() + 5  # the batcher's metrics are set just after the responses
    while metric(server, "batcher_requests_total", "sam") - requests < len(clicks):
        assert time.monotonic() < deadline, "the batcher never counted the requests"
        time.sleep(0.05)
    assert metric(server, "batcher_batches_total", "sam") - batches < len(clicks)  # some ran together
