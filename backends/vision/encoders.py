"""Pure (server-free) encoders behind the vit, clip_vision and clip_text models: inputs in, float32 arrays out.

Each has `prepare_item(bytes)` (validates one client item and turns it into model input, raising InvalidInput) and
`infer(per_request_items)` (one engine call for all requests of a Triton batch, split back per request).
"""
from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from backends.core.errors import InvalidInput
from backends.core.inputs import utf8
from backends.core.batcher import BatchingParams
from backends.core.params import bounded, choice, device
from backends.core.runtime import RUNTIMES, Runtime, load_runtime
from backends.media.images import DEFAULT_MAX_PIXELS, ImagePreprocessor, decode_image


@dataclass(frozen=True)
class EncoderParams(BatchingParams):
    """The `mm_encoder` backend's parameters (vit, clip_vision, clip_text)."""

    runtime: str = choice("auto", *RUNTIMES)  # auto: the artefact present in the version folder
    device: str = device()
    torch_compile: bool = False
    # on CUDA, batches up to this size replay CUDA graphs (image encoders; a text's length varies); 0: op by op
    cuda_graph_batch: int = bounded(64, 0, 1024)
    prepare_threads: int = bounded(4, 1, 256)  # decode/preprocess threads per instance
    max_pixels: int = bounded(DEFAULT_MAX_PIXELS, 1)  # larger images are refused before decoding
    # image models: decode (nvJPEG on CUDA) and resize on the model's device, as torch tensors (pixels within
    # rounding of the CPU path, which equals transformers)
    preprocess_on_device: bool = False


def split_rows(array: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Undo the concatenation of per-request batches."""
    return np.split(array, np.cumsum(counts)[:-1])


def prepare_requests(encoder, pool: Executor, requests: list[list[bytes]]) -> list[list | InvalidInput]:
    """Prepare every item of every request of one Triton batch in parallel (Pillow and the tokenizer release the
    GIL); a request whose item is bad becomes its InvalidInput, the others are unaffected."""
    futures = [[pool.submit(encoder.prepare_item, item) for item in items] for items in requests]
    prepared: list[list | InvalidInput] = []
    for items, pending in zip(requests, futures):
        try:
            if not items:
                raise InvalidInput("the request holds no item")
            prepared.append([f.result() for f in pending])
        except InvalidInput as exc:
            prepared.append(exc)
    return prepared


def load_engine(version_dir: Path, params: EncoderParams, device: str | None) -> Runtime:
    return load_runtime(version_dir, params.runtime, device or params.device, params.torch_compile,
                        params.cuda_graph_batch)


class ImageEncoder:
    """Encoded images -> one output tensor (logits or embeddings), batched across requests; or one stage of that
    (`preprocess`: the normalised pixel tensors themselves; `encode`: pixel tensors in). Pixel tensors are numpy
    arrays, or torch tensors on the device with `preprocess_on_device` (they stay there into a torch engine)."""

    def __init__(self, version_dir: str | Path, params: EncoderParams = EncoderParams(), device: str | None = None,
                 stage: str = "whole", preprocessor_dir: Path | None = None):
        """`device`: the instance's device when Triton placed it (else `params.device`); `preprocessor_dir`: where
        preprocessor_config.json is, when not beside the engine (an ensemble's steps, called in one process)."""
        version_dir = Path(version_dir)
        self.preprocess = ImagePreprocessor.from_json((preprocessor_dir or version_dir) / "preprocessor_config.json") \
            if stage != "encode" else None
        self.engine = load_engine(version_dir, params, device) if stage != "preprocess" else None
        self.max_pixels = params.max_pixels
        self.pixel_device = None  # where images are preprocessed with torch; None: the CPU with Pillow
        if self.preprocess is not None and params.preprocess_on_device:
            from backends.core.devices import resolve_device
            from backends.media.device_images import nvjpeg_available

            self.pixel_device = resolve_device(device or params.device)
            self.nvjpeg = nvjpeg_available(self.pixel_device)

    def prepare_item(self, data: bytes | np.ndarray) -> Any:
        """On a pool thread: the CPU's share of one item."""
        if self.preprocess is None:  # `encode`: a pixel tensor (FP32, shaped by the model's config) as it came
            return data
        if self.pixel_device is not None:  # checked, and decoded unless nvJPEG takes it in `infer`
            from backends.media.device_images import Jpeg, read_on_host

            item = read_on_host(data, self.nvjpeg, self.max_pixels)
            width, height = item.size if isinstance(item, Jpeg) else (item.shape[2], item.shape[1])
            if self.preprocess.do_resize:  # an extreme aspect ratio is refused here, this image alone
                self.preprocess.resized_size(height, width)
            return item
        return self.preprocess(decode_image(data, self.max_pixels))

    def infer(self, batches: list[list[Any]]) -> list[Any]:
        """One call for a Triton batch: pixel tensors per request (`preprocess`), or the engine's outputs."""
        counts = [len(b) for b in batches]
        items = [x for batch in batches for x in batch]
        if self.pixel_device is not None:
            from backends.media.device_images import decode_on_device, pixel_values

            pixels = pixel_values(decode_on_device(items, self.pixel_device), self.preprocess)
        else:
            pixels = stack(items)
        if self.engine is None:
            if self.pixel_device is not None and self.pixel_device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.pixel_device)  # written before another process reads them
            return list(pixels.split(counts)) if not isinstance(pixels, np.ndarray) else split_rows(pixels, counts)
        if self.engine.name == "onnxruntime" and not isinstance(pixels, np.ndarray):
            pixels = pixels.cpu().numpy()
        (output,) = self.engine.run({"pixel_values": pixels}).values()
        return split_rows(output, counts)


def stack(items: list) -> Any:
    """Pixel tensors stacked: numpy arrays, or torch tensors (numpy ones among them, which an ensemble step can
    receive when Triton moved a GPU tensor to the CPU, join them on their device)."""
    if all(isinstance(x, np.ndarray) for x in items):
        return np.stack(items)
    import torch

    device = next(x.device for x in items if isinstance(x, torch.Tensor))
    return torch.stack([torch.as_tensor(x, device=device) for x in items])


class TextEncoder:
    """Texts -> L2-normalised CLIP text embeddings. Texts over the tokenizer's limit are rejected, not truncated."""

    def __init__(self, version_dir: str | Path, params: EncoderParams = EncoderParams(), device: str | None = None):
        from transformers import AutoTokenizer

        version_dir = Path(version_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(version_dir / "tokenizer")
        self.max_tokens = int(self.tokenizer.model_max_length)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.engine = load_engine(version_dir, params, device)

    def prepare_item(self, raw: bytes) -> list[int]:
        tokens = self.tokenizer(utf8(raw, "text"))["input_ids"]
        if len(tokens) > self.max_tokens:
            raise InvalidInput(f"text is {len(tokens)} tokens long, above the tokenizer limit of "
                               f"{self.max_tokens} tokens")
        return tokens

    def infer(self, batches: list[list[list[int]]]) -> list[np.ndarray]:
        rows = [ids for batch in batches for ids in batch]
        width = max(len(ids) for ids in rows)
        input_ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
        (output,) = self.engine.run({"input_ids": input_ids, "attention_mask": attention_mask}).values()
        return split_rows(output, [len(b) for b in batches])
