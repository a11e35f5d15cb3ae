"""Served outputs equal the transformers reference on the same checkpoint, over HTTP and gRPC, one by one, batched
in one request and under concurrency (where Triton's dynamic batcher must merge requests)."""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as http

from client.sdk import Client
from tests.conftest import encode, random_image
from tests.integration import reference
from tests.integration.reference import ATOL

IMAGES = [encode(random_image(w, h, seed=i), fmt) for i, (w, h, fmt) in
          enumerate([(224, 224, "PNG"), (640, 480, "JPEG"), (300, 500, "WEBP"), (50, 1200, "PNG")])]
TEXTS = ["a photo of a cat", "dog", "a red car on the grass near a tree", ""]


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    url = server.http_url if request.param == "http" else server.grpc_url
    return Client(url, request.param)


def test_vit_single_and_batched_equal_reference(client, vit_checkpoint):
    expected = reference.vit_logits(vit_checkpoint, IMAGES)
    for i, image in enumerate(IMAGES):
        got = client.infer("vit", {"image": np.array([[image]], dtype=object)}, ["logits"])["logits"]
        assert got.shape == (1, expected.shape[1]) and got.nbytes > 0  # numpy-2 stub regression: 0-byte outputs
        np.testing.assert_allclose(got[0], expected[i], atol=ATOL)
    batched = client.infer("vit", {"image": np.array([[b] for b in IMAGES], dtype=object)}, ["logits"])["logits"]
    np.testing.assert_allclose(batched, expected, atol=ATOL)


def test_vit_classification_extension_matches_logits(client, vit_checkpoint):
    expected = reference.vit_logits(vit_checkpoint, IMAGES[:2])
    for labels, logits in zip(client.classify(IMAGES[:2], top_k=3), expected):
        top = np.argsort(-logits)[:3]
        assert [x.index for x in labels] == list(top)
        assert [x.label for x in labels] == [f"class_{i}" for i in top]
        np.testing.assert_allclose([x.score for x in labels], logits[top], atol=ATOL)


def test_clip_embeddings_and_similarity_equal_reference(client, clip_checkpoint):
    image_embeds, text_embeds, logits = reference.clip_outputs(clip_checkpoint, IMAGES[1], TEXTS)
    np.testing.assert_allclose(client.embed_images([IMAGES[1]]), image_embeds, atol=ATOL)
    np.testing.assert_allclose(client.embed_texts(TEXTS), text_embeds, atol=ATOL)  # batched, padded server-side
    scores, probs = client.similarity(IMAGES[1], TEXTS)
    np.testing.assert_allclose(scores, logits, atol=10 * ATOL)  # logit_scale (~14) multiplies the error
    np.testing.assert_allclose(probs, np.exp(logits) / np.exp(logits).sum(), atol=ATOL)


def test_concurrent_requests_are_dynamically_batched_and_correct(server, vit_checkpoint):
    triton = http.InferenceServerClient(server.http_url, concurrency=4)
    before = _stats(triton, "vit")
    expected = reference.vit_logits(vit_checkpoint, IMAGES)
    jobs = [i % len(IMAGES) for i in range(64)]

    def one(i):
        return i, Client(server.http_url).infer("vit", {"image": np.array([[IMAGES[i]]], dtype=object)},
                                                ["logits"])["logits"][0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs))
    for i, logits in results:
        np.testing.assert_allclose(logits, expected[i], atol=ATOL)
    deadline = time.monotonic() + 10  # the server records a batch's statistics after it has sent the responses
    while (after := _stats(triton, "vit"))["inference_count"] - before["inference_count"] < len(jobs):
        assert time.monotonic() < deadline, "statistics never reached the requests sent"
        time.sleep(0.05)
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == len(jobs)
    assert executions < inferences, f"no dynamic batching: {executions} executions for {inferences} inferences"


def test_many_concurrent_pipeline_requests(server, clip_checkpoint):
    _, _, logits = reference.clip_outputs(clip_checkpoint, IMAGES[0], TEXTS[:2])
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: Client(server.grpc_url, "grpc").similarity(IMAGES[0], TEXTS[:2]),
                                range(24)))
    for scores, _ in results:
        np.testing.assert_allclose(scores, logits, atol=10 * ATOL)


def _stats(triton, model: str) -> dict[str, int]:
    stats = triton.get_inference_statistics(model)["model_stats"][0]
    return {"inference_count": int(stats["inference_count"]), "execution_count": int(stats["execution_count"])}
