"""Triton adapter for `vlm` (decoupled): image + prompt -> streamed text, all in one model (no BLS hops).

`execute` checks the prompt and hands the image to a thread pool, which decodes and tiles it (AnyRes) and expands
the prompt's image placeholder into as many placeholder tokens as the image gives visual tokens; `execute` does not
wait for it, so images of concurrent requests are prepared in parallel. The engine loop admits a request once its
image is ready, runs the vision tower and projector over all tiles of the requests it admits together, and hands
the embeddings to the LLM engine, which puts them at the placeholder positions during prefill. Streaming,
cancellation and metrics are the `llm` model's.

Preprocessing runs on the CPU with Pillow (pixel-exact with transformers' processor) unless the model parameter
`preprocess_on_device` is true: then decode (nvJPEG on CUDA) and resize run on the model's device
(backends/device_images.py), which is what keeps a 4K photo's time to first token low on a GPU.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from backends import device_images
from backends.anyres import AnyResPlan, image_processor_config, tiler_from_checkpoint
from backends.errors import InvalidInput
from backends.generation import GenerationRequest
from backends.images import ImagePreprocessor, decode_image
from backends.llava_vision import LlavaVision
from backends.llm.triton_model import LLMTritonModel
from backends.triton_model import optional_input

log = logging.getLogger(__name__)


def expand_placeholder(ids: list[int], placeholder_id: int, count: int) -> list[int]:
    """The prompt with its one image placeholder token repeated once per visual token."""
    at = ids.index(placeholder_id)
    return ids[:at] + [placeholder_id] * count + ids[at + 1:]


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
        self.on_device = self.params.get("preprocess_on_device", "false").lower() in ("1", "true", "yes")
        self.nvjpeg = self.on_device and device_images.nvjpeg_available(self.engine.device)
        log.info("images prepared %s", f"on {self.engine.device}, decoded by {'nvJPEG' if self.nvjpeg else 'Pillow'}"
                 if self.on_device else "on the CPU by Pillow, as transformers' processor")
        self.pool = ThreadPoolExecutor(int(self.params.get("prepare_threads") or 4), thread_name_prefix="vlm-image")

    def prepare(self, request, ask: GenerationRequest) -> Future:
        count = ask.prompt.count(self.placeholder)
        if count > 1:
            raise InvalidInput(f"the prompt has {count} image placeholders {self.placeholder!r} for one image")
        image = optional_input(self.pb, request, "image")
        if image is None or image.size != 1:
            raise InvalidInput("image must hold exactly one encoded image")
        prompt = ask.prompt if count else f"{self.placeholder}\n{ask.prompt}"  # no placeholder: image first
        future = self.pool.submit(self.tile, bytes(image.reshape(-1)[0]), self.engine.tokenizer(prompt)["input_ids"])
        future.add_done_callback(lambda _: self.wake.set())
        return future

    def tile(self, data: bytes, ids: list[int]) -> tuple[list[int], np.ndarray | torch.Tensor, AnyResPlan]:
        """(prompt ids with the placeholder expanded to the image's token count, tiles, plan); on a worker thread."""
        if self.on_device:
            pixels = device_images.decode_to_device(data, self.engine.device, self.nvjpeg)
            tiles, plan = device_images.anyres_tiles(self.tiler, pixels, self.preprocess)
        else:
            tiles, plan = self.tiler.tiles(decode_image(data), self.preprocess)
        return expand_placeholder(ids, self.placeholder_id, plan.num_image_tokens), tiles, plan

    def engine_inputs(self, batch: list[tuple[GenerationRequest, Future]]) -> list[dict | InvalidInput]:
        prepared = []
        for _, future in batch:
            try:
                prepared.append(future.result())
            except InvalidInput as e:
                prepared.append(e)
        images = [p for p in prepared if not isinstance(p, InvalidInput)]
        if images:
            tiles = torch.cat([torch.as_tensor(tiles) for _, tiles, _ in images])
            embeds = iter(self.vision(tiles.to(self.engine.device, self.engine.dtype), [plan for *_, plan in images]))
        return [p if isinstance(p, InvalidInput) else {"prompt": p[0], "embeds": next(embeds),
                                                       "placeholder_id": self.placeholder_id} for p in prepared]

    def finalize(self) -> None:
        super().finalize()
        self.pool.shutdown(wait=False, cancel_futures=True)  # an image still decoding must not hold the unload
