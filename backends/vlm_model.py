"""Triton adapter for `vlm` (decoupled): image + prompt -> streamed text, all in one model (no BLS hops).

`execute` decodes and tiles each image (AnyRes) on a thread pool and expands the prompt's image placeholder into
as many placeholder tokens as the image gives visual tokens; the engine loop runs the vision tower and projector
over all tiles of the requests it admits together, then hands the embeddings to the LLM engine, which puts them at
the placeholder positions during prefill. Streaming, cancellation and metrics are the `llm` model's.
"""
from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from backends.anyres import AnyResPlan, image_processor_config, tiler_from_checkpoint
from backends.errors import InvalidInput
from backends.generation import GenerationRequest
from backends.images import ImagePreprocessor, decode_image
from backends.llava_vision import LlavaVision
from backends.llm.triton_model import LLMTritonModel
from backends.triton_model import optional_input


class VLMTritonModel(LLMTritonModel):
    def initialize(self, args: dict) -> None:
        super().initialize(args)
        folder = Path(args["model_repository"]) / args["model_version"]
        keep = float(self.params.get("visual_keep_ratio") or 1)
        if not 0 < keep <= 1:
            raise ValueError(f"visual_keep_ratio must be in (0, 1], got {keep}")
        self.tiler = dataclasses.replace(tiler_from_checkpoint(folder), keep_ratio=keep)
        self.preprocess = ImagePreprocessor.from_dict(image_processor_config(folder))
        self.vision = LlavaVision(folder, self.tiler, self.engine.dtype, self.engine.device)
        processor = folder / "processor_config.json"
        self.placeholder = json.loads(processor.read_text()).get("image_token", "<image>") if processor.exists() \
            else "<image>"
        self.placeholder_id = self.engine.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.pool = ThreadPoolExecutor(4)
        self.tiling: dict[int, object] = {}  # request -> its tiling future, for one execute call

    def execute(self, requests: list) -> None:
        # decode and tile the images of this call in parallel; the base class then validates and queues
        images = [optional_input(self.pb, r, "image") for r in requests]
        self.tiling = {id(r): self.pool.submit(self.tile, i) for r, i in zip(requests, images)}
        try:
            return super().execute(requests)
        finally:
            self.tiling.clear()

    def tile(self, image: np.ndarray | None) -> tuple[np.ndarray, AnyResPlan]:
        if image is None or image.size != 1:
            raise InvalidInput("image must hold exactly one encoded image")
        return self.tiler.tiles(decode_image(bytes(image.reshape(-1)[0])), self.preprocess)

    def prepare(self, request, ask: GenerationRequest) -> tuple[list[int], np.ndarray, AnyResPlan]:
        count = ask.prompt.count(self.placeholder)
        if count > 1:
            raise InvalidInput(f"the prompt has {count} image placeholders {self.placeholder!r} for one image")
        prompt = ask.prompt if count else f"{self.placeholder}\n{ask.prompt}"  # no placeholder: image first
        tiles, plan = self.tiling.pop(id(request)).result()
        ids = self.engine.tokenizer(prompt)["input_ids"]
        at = ids.index(self.placeholder_id)
        return ids[:at] + [self.placeholder_id] * plan.num_image_tokens + ids[at + 1:], tiles, plan

    def engine_inputs(self, batch: list[tuple[GenerationRequest, object]]) -> list[dict]:
        tiles = torch.from_numpy(np.concatenate([tiles for _, (_, tiles, _) in batch]))
        embeds = self.vision(tiles.to(self.engine.device, self.engine.dtype), [plan for _, (_, _, plan) in batch])
        return [{"prompt": ids, "embeds": e, "placeholder_id": self.placeholder_id}
                for (_, (ids, _, _)), e in zip(batch, embeds)]

    def finalize(self) -> None:
        super().finalize()
        self.pool.shutdown()
