"""Image embeddings for the language model equal LlavaNextModel.get_image_features on the same tiny checkpoint,
for several images batched together (all tiles through the tower at once)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.media.images import ImagePreprocessor
from backends.vision.anyres import image_processor_config, tiler_from_checkpoint
from backends.vision.llava_vision import LlavaVision
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT, random_image

SIZES = [(64, 48), (300, 90), (56, 56), (90, 400), (1, 1), (700, 20)]  # (w, h)


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint("llava_next", ROOT / ".checkpoints")


def test_image_embeddings_equal_transformers(checkpoint):
    from transformers import LlavaNextForConditionalGeneration

    tiler = tiler_from_checkpoint(checkpoint)
    preprocess = ImagePreprocessor.from_dict(image_processor_config(checkpoint))
    tiled = [tiler.tiles(random_image(w, h, seed=i), preprocess) for i, (w, h) in enumerate(SIZES)]
    pixel_values = torch.from_numpy(np.concatenate([t for t, _ in tiled]))
    ours = LlavaVision(checkpoint, tiler)(pixel_values, [plan for _, plan in tiled])

    reference = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    image_sizes = torch.tensor([plan.image_size for _, plan in tiled])
    with torch.inference_mode():
        expected = reference.model.get_image_features(pixel_values, image_sizes).pooler_output
    assert [e.shape[0] for e in expected] == [plan.num_image_tokens for _, plan in tiled]
    for got, want in zip(ours, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tiling", ["pillow", "torch", "pillow-chunked", "pillow-padded"])
def test_engine_with_image_embeddings_generates_like_llava_next(checkpoint, tiling, monkeypatch):
    """`torch` is the on-device preprocessing path (run on the CPU here): pixels within rounding of Pillow's, and
    still the same greedy tokens as the reference. `chunked`: the image prompts arrive while another sequence
    decodes, so they prefill in chunks of a few tokens (cut inside the image) beside it. `padded`: the prompts
    prefill as a prefill graph would, padded, from the static inputs (the image features put in first)."""
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.runner import ModelRunner
    from backends.llm.sampling import SamplingParams
    from backends.media.device_images import anyres_tiles

    processor = AutoProcessor.from_pretrained(checkpoint)
    reference = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tiler = tiler_from_checkpoint(checkpoint)
    preprocess = ImagePreprocessor.from_dict(image_processor_config(checkpoint))
    vision = LlavaVision(checkpoint, tiler)
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8, chunk_tokens=24))
    padded = []
    if tiling.endswith("padded"):
        engine.runner = ModelRunner(engine.model, engine.kv_cache, engine.blocks, engine.decode_rows, 4096,
                                    capture=False, prefill_graph_tokens=engine.config.max_prefill_tokens)
        monkeypatch.setattr(engine.runner, "prefill_static", lambda size, real=engine.runner.prefill_static:
                            padded.append(size) or real(size))
    if tiling.endswith("chunked"):
        engine.add("red car", SamplingParams(max_tokens=200, min_tokens=200))
        engine.step()  # it decodes from now on
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    expected, seqs = [], []
    for i, (width, height) in enumerate(SIZES[:4]):  # run together: one batch of mixed images and prompts
        image = random_image(width, height, seed=i)
        inputs = processor(images=image, text="<image> a photo of the cat" + " red" * i, return_tensors="pt")
        with torch.inference_mode():
            out = reference.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs.input_ids.shape[1]:]
        expected.append([t for t in out.tolist() if t != processor.tokenizer.eos_token_id])
        if tiling.startswith("pillow"):
            tiles, plan = tiler.tiles(image, preprocess)
            tiles = torch.from_numpy(tiles)
        else:
            tiles, plan = anyres_tiles(tiler, torch.from_numpy(np.array(image)).permute(2, 0, 1), preprocess)
        (embeds,) = vision(tiles, [plan])
        seqs.append(engine.add(inputs.input_ids[0].tolist(), SamplingParams(max_tokens=12), embeds=embeds,
                               placeholder_id=image_token))
    blind = [engine.add(s.prompt_ids, SamplingParams(max_tokens=12)) for s in seqs]  # placeholders as text
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == expected and all(len(e) == 12 for e in expected)
    assert [s.output_ids for s in blind] != expected  # the image embeddings changed the answer
    assert bool(padded) == tiling.endswith("padded")
    prompts = len(seqs + blind)  # whole, they prefill in a step or two; in chunks, over many more
    assert (engine.stats.prefill_steps > prompts + 1) == tiling.endswith("chunked")


def test_pruning_keeps_the_highest_norm_tokens_in_order_with_every_newline(checkpoint):
    import dataclasses

    tiler = tiler_from_checkpoint(checkpoint)
    pruned_tiler = dataclasses.replace(tiler, keep_ratio=0.5)
    preprocess = ImagePreprocessor.from_dict(image_processor_config(checkpoint))
    image = random_image(300, 90, seed=1)
    tiles, plan = tiler.tiles(image, preprocess)
    pruned_plan = pruned_tiler.plan(image.height, image.width)
    full = LlavaVision(checkpoint, tiler)(torch.from_numpy(tiles), [plan])[0]
    pruned = LlavaVision(checkpoint, pruned_tiler)(torch.from_numpy(tiles), [pruned_plan])[0]
    assert pruned.shape[0] == pruned_plan.num_image_tokens < plan.num_image_tokens
    newline = LlavaVision(checkpoint, tiler).image_newline
    assert int((pruned == newline).all(-1).sum()) == int((full == newline).all(-1).sum())
    # the kept feature tokens appear in the full sequence in the same order (a subsequence) ...
    kept = pruned[~(pruned == newline).all(-1)]
    positions = [int(torch.nonzero((full == row).all(-1))[0]) for row in kept]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    # ... and no dropped grid token has a larger feature norm than a kept one
    thumbnail = (tiler.tile // tiler.patch) ** 2
    grid = [i for i in range(thumbnail, full.shape[0]) if not bool((full[i] == newline).all())]
    dropped = [i for i in grid if i not in set(positions)]
    assert full[dropped].norm(dim=-1).max() <= full[[i for i in positions if i >= thumbnail]].norm(dim=-1).min()


def test_image_requests_with_lora_adapters_generate_like_llava_next_with_peft(checkpoint, tmp_path):
    """`vlm` with lora_id: an adapter trained on the LLaVA checkpoint's language model (peft saves its keys under
    language_model) applies to image prompts; base and adapter rows in one batch, each as transformers + peft."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams

    torch.manual_seed(3)
    targets = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    get_peft_model(LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32),
                   LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
                   ).save_pretrained(tmp_path / "style")
    processor = AutoProcessor.from_pretrained(checkpoint)
    reference = PeftModel.from_pretrained(
        LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32), tmp_path / "style").eval()
    tiler = tiler_from_checkpoint(checkpoint)
    preprocess = ImagePreprocessor.from_dict(image_processor_config(checkpoint))
    vision = LlavaVision(checkpoint, tiler)
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8, max_loras=1,
                                                max_lora_rank=4, lora_root=str(tmp_path)))
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    image = random_image(*SIZES[1], seed=5)
    inputs = processor(images=image, text="<image> a photo of the cat", return_tensors="pt")
    expected = {}
    for lora_id in ("", "style"):
        with torch.inference_mode():
            if lora_id:
                out = reference.generate(**inputs, max_new_tokens=12, do_sample=False)
            else:
                with reference.disable_adapter():
                    out = reference.generate(**inputs, max_new_tokens=12, do_sample=False)
        expected[lora_id] = [t for t in out[0, inputs.input_ids.shape[1]:].tolist()
                             if t != processor.tokenizer.eos_token_id]
    tiles, plan = tiler.tiles(image, preprocess)
    (embeds,) = vision(torch.from_numpy(tiles), [plan])
    ids = inputs.input_ids[0].tolist()
    seqs = {lora_id: engine.add(ids, SamplingParams(max_tokens=12), embeds=embeds, placeholder_id=image_token,
                                lora=engine.choose_adapters(lora_id, ids) if lora_id else ()) for lora_id in expected}
    while engine.has_work:
        engine.step()
    assert {k: s.output_ids for k, s in seqs.items()} == expected and expected[""] != expected["style"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh's vlm scenario runs it)"))])
def test_the_same_image_asked_again_runs_the_rest_of_its_prompt_as_decode_rows(checkpoint, monkeypatch, device):
    """The second question about an image finds the blocks up to it cached (image included); the rest, the image's
    last partly filled block and the question, runs as rows of a decode step (on a GPU from its CUDA graph), the
    image positions' rows taking their features from the static buffer: the same tokens as LLaVA-NeXT."""
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    from backends.llm import runner
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams

    processor = AutoProcessor.from_pretrained(checkpoint)
    reference = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tiler = tiler_from_checkpoint(checkpoint)
    image = random_image(*SIZES[1], seed=5)
    tiles, plan = tiler.tiles(image, ImagePreprocessor.from_dict(image_processor_config(checkpoint)))
    (embeds,) = LlavaVision(checkpoint, tiler)(torch.from_numpy(tiles), [plan])
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device=device, kv_cache_memory_mb=8))
    assert engine.runner.image_rows is not None and engine.runner.capture == (device == "cuda")
    image_rows, prefills = [], []

    def features(rows, real=runner.image_features):
        found = real(rows)
        image_rows.append(0 if found is None else len(found[0]))
        return found

    monkeypatch.setattr(runner, "image_features", features)
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs, real=engine.runner.prefill: prefills.append(
        [s.num_cached for s in seqs]) or real(seqs))
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    for question in ("<image> a photo of the cat", "<image> the red car by the tree"):
        inputs = processor(images=image, text=question, return_tensors="pt")
        with torch.inference_mode():
            out = reference.generate(**inputs, max_new_tokens=12, do_sample=False)[0, inputs.input_ids.shape[1]:]
        seq = engine.add(inputs.input_ids[0].tolist(), SamplingParams(max_tokens=12), embeds=embeds,
                         placeholder_id=image_token, embeds_key=b"this image")
        while engine.has_work:
            engine.step()
        assert seq.output_ids == [t for t in out.tolist() if t != processor.tokenizer.eos_token_id]
    assert prefills == [[0]]  # only the first prompt prefilled; the second's uncached tokens ran as decode rows
    assert engine.blocks.hit_tokens >= 16 and max(image_rows) > 0  # its image's last positions among them
