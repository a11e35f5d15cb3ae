"""python -m perf.token_budget: visual tokens per image for LLaVA-NeXT-style serving (CLIP ViT-L/14-336 tiles),
and what pruning does to the answer.

Table 1, per image size: (a) one squashed tile; (b) native-resolution tiling (every 336 px tile of the full-size
image, a newline per tile row); (c) AnyRes with LLaVA-1.6's pinpoints (thumbnail + best-fit grid, padding removed);
(d) the same with 50% of the tiles' tokens pruned by feature norm; (e) AnyRes with the anyres_max_9 grid list.
Table 2: the tiny LLaVA-NeXT checkpoint on a fixed image set, greedy answers with and without pruning (how many
leading answer tokens stay the same). A random-init model says nothing about answer quality; the table shows the
mechanics and the token savings.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

from backends.vision.anyres import (
    LLAVA_1_6_PINPOINTS,
    AnyResTiler,
    grid_pinpoints,
    image_processor_config,
    tiler_from_checkpoint,
)
from perf.report import write_table

SIZES = [(336, 336), (1024, 1024), (1920, 1080), (3840, 2160), (4000, 500), (500, 4000), (2048, 300)]  # (w, h)


def native_tiles_tokens(width: int, height: int, tile: int = 336, patch: int = 14) -> int:
    side = tile // patch
    rows, cols = math.ceil(height / tile), math.ceil(width / tile)
    return rows * cols * side * side + rows * side


def budget_rows() -> list[list]:
    llava, max9 = AnyResTiler(LLAVA_1_6_PINPOINTS), AnyResTiler(grid_pinpoints(9, 336))
    pruned = dataclasses.replace(llava, keep_ratio=0.5)
    rows = []
    for width, height in SIZES:
        a, b = llava.plan(height, width), max9.plan(height, width)
        rows.append([f"{width}x{height}", 24 * 24, native_tiles_tokens(width, height),
                     f"{a.num_image_tokens} ({a.grid[0]}x{a.grid[1]})", pruned.plan(height, width).num_image_tokens,
                     f"{b.num_image_tokens} ({b.grid[0]}x{b.grid[1]})"])
    return rows


def pruning_rows(keep_ratio: float = 0.5, max_tokens: int = 16) -> list[list]:
    """Greedy answers of the tiny LLaVA-NeXT with all visual tokens and with `keep_ratio` of the tiles' tokens."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from backends.media.images import ImagePreprocessor
    from backends.vision.llava_vision import LlavaVision
    from build_engines.checkpoints import tiny_checkpoint
    from perf.inputs import IMAGE_SET, photo_like

    checkpoint = tiny_checkpoint("llava_next")
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=64))
    preprocess = ImagePreprocessor.from_dict(image_processor_config(checkpoint))
    placeholder = engine.tokenizer.convert_tokens_to_ids("<image>")
    full_tiler = tiler_from_checkpoint(checkpoint)
    towers = [LlavaVision(checkpoint, t) for t in (full_tiler, dataclasses.replace(full_tiler, keep_ratio=keep_ratio))]
    rows = []
    for seed, (width, height, _) in enumerate(IMAGE_SET):
        image = photo_like(width, height, seed)
        answers = []
        for vision in towers:
            tiles, plan = vision.tiler.tiles(image, preprocess)
            (embeds,) = vision(torch.from_numpy(tiles), [plan])
            ids = engine.tokenizer("<image>\na photo of the cat")["input_ids"]
            at = ids.index(placeholder)
            ids = ids[:at] + [placeholder] * plan.num_image_tokens + ids[at + 1:]
            seq = engine.add(ids, SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens), embeds=embeds,
                             placeholder_id=placeholder)
            while engine.has_work:
                engine.step()
            answers.append((plan.num_image_tokens, seq.output_ids))
        (full_n, full_ids), (pruned_n, pruned_ids) = answers
        same = next((i for i, (x, y) in enumerate(zip(full_ids, pruned_ids)) if x != y), len(full_ids))
        rows.append([f"{width}x{height}", full_n, pruned_n, f"{1 - pruned_n / full_n:.0%}", f"{same}/{max_tokens}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.token_budget", description=__doc__)
    parser.add_argument("--results", type=Path, default=Path("perf/results/any"))
    args = parser.parse_args(argv)
    notes = [__doc__.split("\n\n", 1)[1].strip()]
    first = write_table(args.results, "token-budget", ["image (w x h)", "(a) one tile", "(b) native tiling",
                                                       "(c) AnyRes, LLaVA-1.6 grid", "(d) (c) + 50% pruning",
                                                       "(e) AnyRes, max 9 tiles"], budget_rows(),
                        "n/a (arithmetic)", notes)
    second = write_table(args.results, "token-pruning-answers", ["image (w x h)", "visual tokens", "after pruning",
                                                                 "reduction", "answer tokens unchanged"],
                         pruning_rows(), "CPU, tiny LLaVA-NeXT (random init), fp32", notes)
    print(first.read_text(), second.read_text(), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
