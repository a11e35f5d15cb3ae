"""`mm_vlm`: Triton backend for the decoupled `vlm` model, image + prompt -> streamed text, all in one model (no BLS
hops). Streaming, cancellation and metrics are `mm_llm`'s.

`execute` checks the prompt and hands the image to a thread pool, which decodes and tiles it (AnyRes) and expands
the prompt's image placeholder into as many placeholder tokens as the image gives visual tokens; `execute` does not
wait for it, so images of concurrent requests are prepared in parallel. The engine loop admits a request once its
image is ready, runs the vision tower and projector over all tiles of the requests it admits together, and hands
the embeddings to the LLM engine, which puts them at the placeholder positions during prefill.

An image is known by a digest of its file. The visual features of the last `image_cache` images stay on the device,
so the same image asked about again skips decoding, tiling and the vision tower; the digest also keys the engine's
prefix cache, so its prompt blocks up to the question are not computed again either.

Preprocessing runs on the CPU with Pillow (pixel-exact with transformers' processor) unless the model parameter
`preprocess_on_device` is true: then decode (nvJPEG on CUDA) and resize run on the model's device
(backends/media/device_images.py), which is what keeps a 4K photo's time to first token low on a GPU.

As a Triton ensemble (`build_engines vlm --ensemble`) the image is tiled by the `mm_anyres` step first, on CPU
instances of its own, and this model (`vlm_engine`) takes its tiles (`_pixel_values`) and the image's size
(`_image_size`, which gives the plan) instead of `image`; an image is then known by a digest of its tiles.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from backends.core.adapter import inject
from backends.core.errors import InvalidInput
from backends.core.inputs import Inputs
from backends.core.qos import QosPool, Ticket
from backends.media import device_images
from backends.media.images import ImagePreprocessor
from backends.mm_llm.model import EngineInput, Pending
from backends.mm_llm.model import TritonPythonModel as LLMBackend
from backends.vision.anyres import AnyResPlan, image_processor_config, tiler_from_checkpoint
from backends.vision.llava_vision import LlavaVision, VLMParams, expand_placeholder

log = logging.getLogger(__name__)


@dataclass
class PreparedImage:
    """One request's image, ready for the vision tower, and its prompt expanded for it."""

    prompt_ids: list[int]
    key: bytes  # digest of the image file
    tiles: np.ndarray | torch.Tensor | None = None  # None: `features` came from the image cache
    plan: AnyResPlan | None = None
    features: torch.Tensor | None = None


TILES, SIZE = "_pixel_values", "_image_size"  # an ensemble's tensors from its AnyRes step


class TritonPythonModel(LLMBackend):
    Params = VLMParams

    def load(self) -> None:
        super().load()
        self.takes_tiles = TILES in {t["name"] for t in self.model_config["input"]}
        params: VLMParams = self.params
        self.tiler = dataclasses.replace(tiler_from_checkpoint(self.folder), keep_ratio=params.visual_keep_ratio)
        self.preprocess = ImagePreprocessor.from_dict(image_processor_config(self.folder))
        self.vision = LlavaVision(self.folder, self.tiler, self.engine.dtype, self.engine.device)
        processor = self.folder / "processor_config.json"
        self.placeholder = json.loads(processor.read_text()).get("image_token", "<image>") if processor.exists() \
            else "<image>"
        self.placeholder_id = self.engine.tokenizer.convert_tokens_to_ids(self.placeholder)
        self.on_device = params.preprocess_on_device
        self.nvjpeg = self.on_device and device_images.nvjpeg_available(self.engine.device)
        log.info("images prepared %s", f"on {self.engine.device}, decoded by {'nvJPEG' if self.nvjpeg else 'Pillow'}"
                 if self.on_device else "on the CPU by Pillow, as transformers' processor")
        # images decoded in QoS order, at most a batch (and a round of the pool) ahead of the engine; with
        # qos_lower_prepare, lower classes' images within qos_lower_share while a higher class is in flight
        self.pool = QosPool(params.prepare_threads, "vlm-image", ahead=params.max_batch + params.prepare_threads,
                            lower_share=params.qos_lower_share if params.qos_lower_prepare else None)
        self.features: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # image key -> visual features, LRU
        self.features_lock = threading.Lock()  # read by the image threads, written by the engine loop

    def prepare(self, inputs: Inputs, pending: Pending) -> Future:
        prompt = pending.ask.prompt
        count = prompt.count(self.placeholder)
        if count > 1:
            raise InvalidInput(f"the prompt has {count} image placeholders {self.placeholder!r} for one image")
        image = self.tiled(inputs) if self.takes_tiles else inputs.blob("image", "encoded image")
        prompt = prompt if count else f"{self.placeholder}\n{prompt}"  # no placeholder: image first
        future = self.pool.submit(pending.ticket, self.tile, image, self.engine.tokenizer(prompt)["input_ids"],
                                  pending.fault)
        future.add_done_callback(lambda _: self.wake.set())
        return future

    def tiled(self, inputs: Inputs) -> tuple[np.ndarray, AnyResPlan]:
        """An ensemble's tiles and the plan their image's size gives, checked against each other."""
        tiles, size = inputs.array(TILES), inputs.array(SIZE)
        if tiles is None or size is None or size.size != 2 or (size <= 0).any() or tiles.ndim != 4:
            raise InvalidInput(f"{TILES} [tiles, 3, S, S] and {SIZE} [2] (height, width, both > 0) are needed")
        plan = self.tiler.plan(int(size[0]), int(size[1]))
        if tiles.shape[0] != plan.num_tiles or tiles.shape[2:] != (self.tiler.tile,) * 2:
            raise InvalidInput(f"{TILES} has shape {list(tiles.shape)}; an image of {plan.image_size} takes "
                               f"{plan.num_tiles} tiles of {self.tiler.tile} px")
        return np.array(tiles), plan  # a copy: the engine reads it after this call's input buffers may be reused

    def tile(self, image: bytes | tuple[np.ndarray, AnyResPlan], ids: list[int], fault: str | None) -> PreparedImage:
        """Decode and tile one image (unless an ensemble's step did) and expand its prompt; on a worker thread."""
        inject(fault, "prepare")
        key = hashlib.blake2b(image if isinstance(image, bytes) else image[0], digest_size=16).digest()
        with self.features_lock:
            features = self.features.get(key)
        if features is not None:
            return PreparedImage(expand_placeholder(ids, self.placeholder_id, len(features)), key, features=features)
        if not isinstance(image, bytes):
            tiles, plan = image
        elif self.on_device:
            pixels = device_images.decode_to_device(image, self.engine.device, self.nvjpeg)
            tiles, plan = device_images.anyres_tiles(self.tiler, pixels, self.preprocess)
        else:
            tiles, plan = self.tiler.tiles_of_file(image, self.preprocess, self.params.decode_reduced)
        return PreparedImage(expand_placeholder(ids, self.placeholder_id, plan.num_image_tokens), key, tiles, plan)

    def _admit(self) -> None:
        self.pool.kick()  # the last step may have started requests: room for more images ahead of the engine
        super()._admit()

    def admit_ahead(self) -> tuple[int, list[Ticket]]:
        """A new request is admitted while fewer than `encode_ahead` of its class or higher wait in the engine's
        queue: its image's visual features are computed on this loop (every running stream waits for them), so not
        for requests that would only wait there; a higher class arriving meanwhile is not held behind them."""
        return self.params.encode_ahead, [seq.ticket for seq in self.engine.scheduler.waiting if not seq.ticket.started]

    def engine_inputs(self, batch: list[Pending]) -> list[EngineInput | Exception]:
        prepared: list[PreparedImage | Exception] = []
        for pending in batch:
            try:
                prepared.append(pending.prepared.result())
            except Exception as e:
                prepared.append(e)
        images = [p for p in prepared if isinstance(p, PreparedImage) and p.features is None]
        for pending in batch:
            inject(pending.fault, "infer")
        if images:  # one vision-tower call for the tiles of every new image admitted together
            tiles = torch.cat([torch.as_tensor(p.tiles) for p in images])
            for image, features in zip(images, self.vision(tiles.to(self.engine.device, self.engine.dtype),
                                                           [p.plan for p in images])):
                image.features = features
                self._remember(image.key, features)
        return [p if isinstance(p, Exception) else EngineInput(p.prompt_ids, p.features, self.placeholder_id, p.key)
                for p in prepared]

    def _remember(self, key: bytes, features: torch.Tensor) -> None:
        with self.features_lock:
            self.features[key] = features
            self.features.move_to_end(key)
            while len(self.features) > self.params.image_cache:
                self.features.popitem(last=False)

    def finalize(self) -> None:
        super().finalize()
        self.pool.shutdown(wait=False, cancel_futures=True)  # an image still decoding must not hold the unload
