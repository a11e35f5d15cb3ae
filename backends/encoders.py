"""Pure (server-free) encoders behind the vit, clip_vision and clip_text models: inputs in, float32 arrays out.

Each has `prepare(items)` (per request: validates and turns client data into model inputs, raising InvalidInput)
and `infer(prepared)` (one engine call for all requests of a Triton batch, split back per request).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends.errors import InvalidInput
from backends.images import DEFAULT_MAX_PIXELS, ImagePreprocessor, decode_image
from backends.runtime import Runtime, runtime_from_params


def split_rows(array: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Undo the concatenation of per-request batches."""
    return np.split(array, np.cumsum(counts)[:-1])


class ImageEncoder:
    """Encoded images -> one output tensor (logits or embeddings), batched across requests."""

    def __init__(self, version_dir: str | Path, params: dict[str, str] | None = None):
        """`params`: the model config's parameters (runtime choice, `max_pixels`, `decode_threads`)."""
        params = params or {}
        version_dir = Path(version_dir)
        self.preprocess = ImagePreprocessor.from_json(version_dir / "preprocessor_config.json")
        self.engine: Runtime = runtime_from_params(version_dir, params)
        self.max_pixels = int(params.get("max_pixels", DEFAULT_MAX_PIXELS))
        # Pillow decodes and resizes without holding the GIL
        self.pool = ThreadPoolExecutor(int(params.get("decode_threads", 4)))

    def _one(self, data: bytes) -> np.ndarray:
        return self.preprocess(decode_image(data, self.max_pixels))

    def prepare(self, images: list[bytes]) -> np.ndarray:
        if not images:
            raise InvalidInput("no image in the request")
        return np.stack(list(self.pool.map(self._one, images)))

    def infer(self, batches: list[np.ndarray]) -> list[np.ndarray]:
        result = self.engine.run({"pixel_values": np.concatenate(batches)})
        (output,) = result.values()
        return split_rows(output, [len(b) for b in batches])


class TextEncoder:
    """Texts -> L2-normalised CLIP text embeddings. Texts over the tokenizer's limit are rejected, not truncated."""

    def __init__(self, version_dir: str | Path, params: dict[str, str] | None = None):
        from transformers import AutoTokenizer

        version_dir = Path(version_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(version_dir / "tokenizer")
        self.max_tokens = int(self.tokenizer.model_max_length)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.engine: Runtime = runtime_from_params(version_dir, params or {})

    def prepare(self, texts: list[bytes]) -> list[list[int]]:
        if not texts:
            raise InvalidInput("no text in the request")
        ids = []
        for raw in texts:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInput(f"text is not valid UTF-8: {exc}") from None
            tokens = self.tokenizer(text)["input_ids"]
            if len(tokens) > self.max_tokens:
                raise InvalidInput(f"text is {len(tokens)} tokens long, above the tokenizer limit of "
                                   f"{self.max_tokens} tokens")
            ids.append(tokens)
        return ids

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
