"""The SAM engines (image encoder + prompt/mask decoder, built by build_engines) against SamModel + SamProcessor on
the same tiny checkpoint (points, a box, both, a previous mask as input, single and multimask output; ONNX and
torch.export builds), the embedding cache (a second prompt on the same image runs no encoder; LRU by bytes), and
bad prompts refused with the reason."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from backends.core.errors import InvalidInput
from backends.media.images import decode_image
from backends.sam.engine import Embedded, EmbeddingCache, Prompt, SamEngine, pack_bits
from tests.conftest import build_engines, encode, random_image


@pytest.fixture(scope="module")
def engines(repository, sam_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The sam version folder as `make engines` builds it (ONNX) and built for --runtime torch (the GPU path's
    torch.export programs, here on the CPU)."""
    torch_repository = tmp_path_factory.mktemp("torch")
    assert build_engines(["sam", "--checkpoint", str(sam_checkpoint), "--runtime", "torch", "--device", "cpu",
                          "--repository", str(torch_repository)]) == 0
    return {"onnxruntime": repository / "sam" / "1", "torch": torch_repository / "sam" / "1"}


@pytest.fixture(scope="module")
def engine(engines) -> SamEngine:
    return SamEngine(engines["onnxruntime"], device="cpu")


def reference(checkpoint, data, points=None, labels=None, box=None, multimask=True, mask_input=None):
    from transformers import SamModel, SamProcessor

    model, processor = SamModel.from_pretrained(checkpoint).eval(), SamProcessor.from_pretrained(checkpoint)
    inputs = processor(images=decode_image(data), input_points=None if points is None else [[points.tolist()]],
                       input_labels=None if labels is None else [[labels.tolist()]],
                       input_boxes=None if box is None else [[box.tolist()]], return_tensors="pt")
    masks = None if mask_input is None else torch.as_tensor(mask_input)[None]
    with torch.inference_mode():
        out = model(**inputs, input_masks=masks, multimask_output=multimask)
    masks = processor.post_process_masks(out.pred_masks, inputs["original_sizes"], inputs["reshaped_input_sizes"])
    return masks[0][0].numpy(), out.iou_scores[0, 0].numpy(), out.pred_masks[0, 0].numpy()


def assert_same(ours, expected) -> None:
    masks, scores, low_res = expected
    assert ours.masks.shape == masks.shape and ours.masks.dtype == bool
    for got, want in zip(ours.masks, masks):
        assert (got & want).sum() / max((got | want).sum(), 1) >= 0.99
        assert 0.05 < want.mean() < 0.95  # a real mask: neither empty nor everything
    np.testing.assert_allclose(ours.iou_scores, scores, atol=1e-3)
    np.testing.assert_allclose(ours.low_res_logits, low_res, atol=1e-3)


PROMPTS = {
    "one point": (np.array([[320.0, 240.0]]), np.array([1]), None, True),
    "fg + bg points": (np.array([[100.0, 80.0], [500.5, 400.0]]), np.array([1, 0]), None, True),
    "box": (None, None, np.array([[50.0, 60.0, 400.0, 300.0]]), False),
    "points + box": (np.array([[200.0, 150.0]]), np.array([1]), np.array([[50.0, 60.0, 400.0, 300.0]]), True),
}


@pytest.mark.parametrize("name", PROMPTS)
def test_masks_and_scores_equal_sam_model_and_processor(engine, sam_checkpoint, name):
    points, labels, box, multimask = PROMPTS[name]
    data = encode(random_image(640, 480, seed=4), "JPEG")
    ours = engine.segment(data, points, labels, box, multimask)
    assert ours.masks.shape == ((3 if multimask else 1), 480, 640)
    assert_same(ours, reference(sam_checkpoint, data, points, labels, box[0] if box is not None else None, multimask))


def test_a_previous_mask_refines_the_next_click(engine, sam_checkpoint):
    """The second click of an interactive session passes the first answer's low-res logits back (mask_input)."""
    data = encode(random_image(517, 333, seed=6), "PNG")  # odd sides: the crop rounds as SamProcessor's resize
    points, labels = np.array([[200.0, 100.0]]), np.array([1])
    first = engine.segment(data, points, labels, multimask=False)
    assert_same(first, reference(sam_checkpoint, data, points, labels, multimask=False))
    points, labels = np.array([[200.0, 100.0], [400.5, 300.0]]), np.array([1, 0])
    refined = engine.segment(data, points, labels, multimask=False, mask_input=first.low_res_logits)
    assert_same(refined, reference(sam_checkpoint, data, points, labels, multimask=False,
                                   mask_input=first.low_res_logits))
    unrefined = engine.segment(data, points, labels, multimask=False)
    assert np.abs(refined.low_res_logits - unrefined.low_res_logits).max() > 0.1  # the mask input was used


def test_torch_programs_equal_the_onnx_engines(engines, engine):
    torch_engine = SamEngine(engines["torch"], device="cpu")
    assert (torch_engine.encoder.name, engine.encoder.name) == ("torch", "onnxruntime")
    data = encode(random_image(640, 480, seed=4), "JPEG")
    for points, labels, box, multimask in PROMPTS.values():
        ours, theirs = (e.segment(data, points, labels, box, multimask) for e in (torch_engine, engine))
        assert (ours.masks != theirs.masks).mean() < 1e-3
        np.testing.assert_allclose(ours.iou_scores, theirs.iou_scores, atol=1e-4)


def test_integer_crop_size_equals_the_processors_resize():
    """The engine crops the padded masks with integer arithmetic; SamProcessor resizes with floats."""
    from transformers import SamImageProcessorPil

    from backends.sam.engine import resized_side

    processor = SamImageProcessorPil()
    rng = np.random.default_rng(0)
    sizes = [(h, w) for h in (1, 2, 3, 333, 517, 1024, 1025) for w in (1, 7, 480, 640, 1023, 4000)]
    sizes += [tuple(s) for s in rng.integers(1, 40_000, (3000, 2)).tolist()]
    for height, width in sizes:
        assert (resized_side(height, height, width, 1024), resized_side(width, height, width, 1024)) == \
            processor._get_preprocess_shape((height, width), 1024), (height, width)


def test_second_prompt_on_the_same_image_skips_the_encoder(engines):
    engine = SamEngine(engines["onnxruntime"], device="cpu")
    image, other = encode(random_image(300, 200, seed=1)), encode(random_image(300, 200, seed=2))
    engine.segment(image, np.array([[10.0, 10.0]]), np.array([1]))
    engine.segment(image, np.array([[150.0, 100.0]]), np.array([0]))
    assert (engine.encoder_runs, engine.cache.hits, engine.cache.misses) == (1, 1, 1)
    engine.segment(other, np.array([[10.0, 10.0]]), np.array([1]))
    assert engine.encoder_runs == 2


def test_cache_evicts_least_recently_used_by_bytes():
    def entry() -> Embedded:
        return Embedded(np.zeros((1, 4, 8, 8), np.float32), (8, 8), (8, 8))  # 1 KiB
    cache = EmbeddingCache(max_bytes=2 * 1024)
    cache.put("a", entry())
    cache.put("b", entry())
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", entry())
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    assert (cache.evictions, cache.bytes) == (1, 2 * 1024)
    cache.put("huge", Embedded(np.zeros((1, 4, 32, 32), np.float32), (8, 8), (8, 8)))  # larger than the whole cache
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
def test_bad_prompts_are_refused_with_the_reason(engine, name):
    points, labels, boxes, reason = BAD[name]
    with pytest.raises(InvalidInput, match=reason):
        engine.segment(encode(random_image(640, 480, seed=4)), points, labels, boxes)


def test_bad_mask_input_and_corrupt_image_are_refused(engine):
    point, label = np.array([[1.0, 1.0]]), np.array([1])
    with pytest.raises(InvalidInput, match="mask_input must be one finite low-res mask"):
        engine.segment(encode(random_image(64, 64)), point, label, mask_input=np.zeros((1, 64, 64), np.float32))
    with pytest.raises(InvalidInput, match="not a known image format"):
        engine.segment(b"corrupt", point, label)
    with pytest.raises(InvalidInput, match="20000x1 .* an empty image"):  # was a ValueError "height=0": INTERNAL
        engine.segment(encode(Image.new("RGB", (20000, 1))), point, label)


def test_prompts_of_several_requests_share_engine_calls_and_equal_each_alone(engines, engine):
    """Issue 24: the batch's new images through the encoder in one call; one decoder call per number of prompt
    tokens (rows of different images and sizes, with and without a mask input, single and multimask output, in one
    call); a bad image or prompt fails alone; each answer is what the prompt gets alone."""
    a, b = (encode(random_image(640, 480, seed=s), "JPEG") for s in (40, 41))
    c = encode(random_image(300, 500, seed=42), "JPEG")
    earlier = engine.segment(a, np.array([[100.0, 80.0]]), np.array([1]), multimask=False).low_res_logits
    one, fg_bg = np.array([1]), np.array([1, 0])
    prompts = [
        Prompt(a, np.array([[320.0, 240.0]]), one),
        Prompt(b, np.array([[10.0, 20.0]]), np.array([0])),  # another image of the same size: the same call
        Prompt(a, np.array([[50.0, 50.0]]), one, mask_input=earlier),  # a mask input in that call too
        Prompt(a, np.array([[100.0, 80.0], [500.5, 400.0]]), fg_bg),  # one more token: a call of its own
        Prompt(c, boxes=np.array([[5.0, 5.0, 200.0, 300.0]]), multimask=False),  # another size, two tokens
        Prompt(a, np.array([[100.0, 80.0]]), one, mask_input=earlier, multimask=False),  # single mask output
        Prompt(b, np.array([[9999.0, 1.0]]), one),  # outside its image: refused alone
        Prompt(b"corrupt", np.array([[1.0, 1.0]]), one),
        Prompt(b, np.array([[30.0, 40.0]]), one),
    ]
    calls: dict[str, list[int]] = {"encoder": [], "decoder": []}
    runs = {name: getattr(engine, name).run for name in calls}

    def counted(name: str, rows: str):
        return lambda feeds, **options: calls[name].append(len(feeds[rows])) or runs[name](feeds, **options)
    engine.encoder.run, engine.decoder.run = counted("encoder", "pixel_values"), counted("decoder", "point_coords")
    try:
        batched = engine.segment_batch(prompts)
    finally:
        engine.encoder.run, engine.decoder.run = runs["encoder"], runs["decoder"]
    assert calls["encoder"] == [2] and sorted(calls["decoder"]) == [1, 6]  # b and c once each, a cached
    fresh = SamEngine(engines["onnxruntime"], device="cpu")  # each image through the encoder alone
    for prompt, got in zip(prompts, batched):
        try:
            alone = fresh.segment(prompt.image, prompt.points, prompt.labels, prompt.boxes, prompt.multimask,
                                  prompt.mask_input)
        except InvalidInput as e:
            assert isinstance(got, InvalidInput) and str(got) == str(e)
            continue
        assert got.masks.shape == alone.masks.shape and (got.masks == alone.masks).mean() > 0.9999
        np.testing.assert_allclose(got.iou_scores, alone.iou_scores, atol=1e-5)
        np.testing.assert_allclose(got.low_res_logits, alone.low_res_logits, atol=1e-4)


def test_a_prompt_gets_only_the_outputs_it_asks_for_and_masks_nobody_asked_for_are_not_upscaled(engine, monkeypatch):
    """Rows of one decoder call asking for different outputs: each gets those it named, equal to a prompt asking for
    all; a call in which no prompt asks for masks upscales none."""
    from backends.sam import engine as sam_engine

    image, one = encode(random_image(640, 480, seed=60), "JPEG"), np.array([1])
    asks = [None, frozenset({"iou_scores"}), frozenset({"masks", "iou_scores"}),
            frozenset({"low_res_logits", "iou_scores"})]
    full = engine.segment_batch([Prompt(image, np.array([[40.0 + 30 * i, 50.0]]), one) for i in range(len(asks))])
    upscaled = []
    monkeypatch.setattr(sam_engine, "upscale_masks",
                        lambda *args, run=sam_engine.upscale_masks: upscaled.append(len(args[0])) or run(*args))
    got = engine.segment_batch([Prompt(image, np.array([[40.0 + 30 * i, 50.0]]), one, outputs=ask)
                                for i, ask in enumerate(asks)])
    assert upscaled == [4]  # one call, its masks upscaled once (two of its prompts asked for them)
    for ask, answer, want in zip(asks, got, full):
        np.testing.assert_array_equal(answer.iou_scores, want.iou_scores)
        for name in ("masks", "low_res_logits"):
            value = getattr(answer, name)
            if ask is None or name in ask:
                np.testing.assert_array_equal(value, getattr(want, name))
            else:
                assert value is None
    upscaled.clear()
    scores_only = engine.segment_batch([Prompt(image, np.array([[70.0, 50.0]]), one, outputs=asks[1])])[0]
    assert upscaled == [] and scores_only.masks is None and scores_only.low_res_logits is None
    np.testing.assert_array_equal(scores_only.iou_scores, full[1].iou_scores)


def test_masks_as_rle_decode_with_pycocotools_to_the_binary_masks(engine):
    """`mask_format` rle: each mask as COCO's compressed RLE, which pycocotools decodes to the bool masks of the same
    prompt (rows and columns in their places: a non-square image), also where several prompts of one decoder call
    ask for RLE (their masks are scanned together)."""
    from pycocotools import mask as coco

    image = encode(random_image(300, 500, seed=61), "JPEG")
    clicks, one = [np.array([[120.0, 200.0]]), np.array([[30.0, 400.0]])], np.array([1])
    binary = engine.segment_batch([Prompt(image, points, one) for points in clicks])
    as_rle = engine.segment_batch([Prompt(image, points, one, mask_format="rle") for points in clicks])
    for got, want in zip(as_rle, binary):
        assert want.masks_rle is None and got.masks is None and len(got.masks_rle) == 3
        np.testing.assert_array_equal(got.iou_scores, want.iou_scores)
        for rle, mask in zip(got.masks_rle, want.masks):
            assert rle["size"] == [500, 300] and isinstance(rle["counts"], str)
            np.testing.assert_array_equal(coco.decode(rle).astype(bool), mask)
    assert any((a != b).any() for a, b in zip(binary[0].masks, binary[1].masks))  # two clicks, two answers


def test_packed_masks_unpack_to_the_binary_masks(engine):
    """`mask_format` packed: eight pixels a byte, np.packbits' order (a width of 300 leaves the last byte half used),
    beside a prompt of the same decoder call that asks for bool pixels."""
    image = encode(random_image(300, 500, seed=61), "JPEG")
    one = np.array([1])
    binary, packed = engine.segment_batch([Prompt(image, np.array([[120.0, 200.0]]), one),
                                           Prompt(image, np.array([[120.0, 200.0]]), one, mask_format="packed")])
    assert packed.masks is None and binary.masks_packed is None
    assert packed.masks_packed.shape == (3, 500, 38) and packed.masks_packed.dtype == np.uint8
    np.testing.assert_array_equal(packed.masks_packed, np.packbits(binary.masks, axis=-1))
    np.testing.assert_array_equal(packed.iou_scores, binary.iou_scores)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_pack_bits_is_numpys_packbits(device):
    masks = torch.rand(2, 5, 29, generator=torch.Generator().manual_seed(0)) > 0.5
    np.testing.assert_array_equal(pack_bits(masks.to(device)).cpu().numpy(), np.packbits(masks.numpy(), axis=-1))



@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_run_lengths_found_where_the_masks_are_compress_as_pycocotools_encodes(device):
    """`run_lengths` (the scan a GPU's masks get) gives the runs pycocotools' own scan finds: empty and full masks, a
    first pixel set (counts begin with an empty run of zeros), speckle, a block in a non-square mask; `coco_rle`
    gives the same strings from a device tensor and from pixels."""
    from pycocotools import mask as coco

    from backends.sam.engine import coco_rle, run_lengths

    block = np.zeros((1, 6, 9), bool)
    block[0, 2:4, 1:5] = True
    speckle = np.random.default_rng(3).random((3, 17, 11)) > 0.5
    for masks in (np.zeros((2, 5, 7), bool), np.ones((1, 4, 3), bool), speckle, block):
        want = [rle["counts"] for rle in coco.encode(np.asfortranarray(masks.transpose(1, 2, 0), dtype=np.uint8))]
        runs = run_lengths(torch.from_numpy(masks).to(device))
        assert [rle["counts"] for rle in coco.frPyObjects(runs, *masks.shape[1:])] == want
        assert [rle["counts"].encode() for rle in coco_rle(torch.from_numpy(masks).to(device))] == want
    assert run_lengths(torch.ones(1, 2, 2, dtype=torch.bool, device=device))[0]["counts"].tolist() == [0, 4]

@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_of_the_decoder_equal_op_by_op(sam_checkpoint, tmp_path, monkeypatch):
    """Prompts of 2 and 3 tokens replay graphs (a batch of 5 in graphs of 4 and 1 rows), 5 tokens run op by op;
    every answer equals the engine without graphs."""
    # fp32 without TF32, so the builder's 1e-4 check against PyTorch on the CPU holds (the tiny random model is too
    # ill-conditioned for bf16: 0.75 of its largest logit apart from fp32)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert build_engines(["sam", "--checkpoint", str(sam_checkpoint), "--runtime", "torch", "--device", "cuda",
                          "--repository", str(tmp_path)]) == 0
    folder = tmp_path / "sam" / "1"
    eager = SamEngine(folder, "torch", "cuda", graph_tokens=0)
    graphed = SamEngine(folder, "torch", "cuda", max_prompts=4, graph_tokens=3)
    assert eager.decoder.graphs == {} and len(graphed.decoder.graphs) == 3
    a, c = encode(random_image(640, 480, seed=50), "JPEG"), encode(random_image(300, 500, seed=51), "JPEG")
    one = np.array([1])
    prompts = [Prompt(image, np.array([[10.0 + 20 * i, 30.0]]), one, multimask=i % 2 == 0)
               for i, image in enumerate([a, c, a, c, a])]
    prompts += [Prompt(a, np.array([[100.0, 80.0], [200.0, 90.0]]), np.array([1, 0])),
                Prompt(c, np.array([[5.0, 5.0], [9.0, 9.0], [20.0, 30.0]]), np.array([1, 1, 0]),
                       np.array([[1.0, 1.0, 250.0, 400.0]]))]
    replays = []  # rows of each graph replay
    for graphs in graphed.decoder.graphs.values():
        graphs.run_chunk = lambda args, run=graphs.run_chunk: replays.append(len(args[0])) or run(args)
    for got, want in zip(graphed.segment_batch(prompts), eager.segment_batch(prompts)):
        assert got.masks.shape == want.masks.shape and (got.masks == want.masks).mean() > 0.9999
        np.testing.assert_allclose(got.iou_scores, want.iou_scores, atol=1e-5)
        np.testing.assert_allclose(got.low_res_logits, want.low_res_logits, atol=1e-4)
    assert sorted(replays) == [1, 1, 4]  # 2 tokens: 4 rows + 1; 3 tokens: 1 row; the 5-token prompt op by op
