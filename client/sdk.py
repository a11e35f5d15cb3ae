"""A small typed SDK over tritonclient: the same calls over HTTP or gRPC, errors as tritonclient raises them."""
from __future__ import annotations

import queue
import uuid
from dataclasses import dataclass
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class Label:
    label: str
    index: int
    score: float


class Client:
    """`Client("localhost:8000")` (HTTP) or `Client("localhost:8001", protocol="grpc")`."""

    def __init__(self, url: str = "localhost:8000", protocol: str = "http", timeout_s: float = 60.0):
        if protocol == "http":
            import tritonclient.http as api

            self.triton = api.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
        elif protocol == "grpc":
            import tritonclient.grpc as api

            self.triton = api.InferenceServerClient(url)
        else:
            raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
        self.api, self.protocol = api, protocol

    def infer(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str], class_count: int = 0) -> dict:
        """One request; `inputs` maps tensor names to arrays (object arrays of bytes become BYTES)."""
        tensors = infer_inputs(self.api, inputs)
        requested = [self.api.InferRequestedOutput(name, class_count=class_count) for name in outputs]
        result = self.triton.infer(model, tensors, outputs=requested)
        return {name: result.as_numpy(name) for name in outputs}

    def classify(self, images: list[bytes], top_k: int = 5) -> list[list[Label]]:
        """Top-k labels per image from `vit`, through Triton's classification extension."""
        out = self.infer("vit", {"image": _bytes_column(images)}, ["logits"], class_count=top_k)["logits"]
        results = []
        for row in out.reshape(len(images), -1):
            labels = []
            for entry in row:
                score, index, label = (entry.decode() if isinstance(entry, bytes) else entry).split(":", 2)
                labels.append(Label(label, int(index), float(score)))
            results.append(labels)
        return results

    def embed_images(self, images: list[bytes]) -> np.ndarray:
        """L2-normalised CLIP image embeddings [N, D]."""
        return self.infer("clip_vision", {"image": _bytes_column(images)}, ["image_embeds"])["image_embeds"]

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """L2-normalised CLIP text embeddings [N, D]."""
        column = _bytes_column([t.encode() for t in texts])
        return self.infer("clip_text", {"text": column}, ["text_embeds"])["text_embeds"]

    def similarity(self, image: bytes, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """CLIP logits of one image against each text, and their softmax over the texts."""
        out = self.infer("clip", {"image": np.array([image], dtype=object),
                                  "text": np.array([t.encode() for t in texts], dtype=object)}, ["scores", "probs"])
        return out["scores"], out["probs"]

    def transcribe(self, audio: bytes, language: str | None = None, task: str = "transcribe",
                   max_tokens: int | None = None) -> tuple[str, list[int]]:
        """(text, tokens) of one encoded audio file (WAV/FLAC/OGG/...) from `whisper`; language None: detected."""
        inputs = {"audio": _bytes_column([audio]), "task": _bytes_column([task.encode()])}
        if language:
            inputs["language"] = _bytes_column([language.encode()])
        if max_tokens is not None:
            inputs["max_tokens"] = np.array([[max_tokens]], dtype=np.int32)
        out = self.infer("whisper", inputs, ["text", "tokens"])
        return out["text"].reshape(-1)[0].decode(), out["tokens"].reshape(-1).tolist()

    def segment(self, image: bytes, points: list[tuple[float, float]] = (), labels: list[int] = (),
                box: tuple[float, float, float, float] | None = None, multimask: bool = True,
                mask_input: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(masks bool [K, H, W], iou_scores [K], low_res_logits [K, 256, 256]) from `sam` for one prompt: points
        (x, y) with labels (1 object, 0 background) and/or one box (x0, y0, x1, y1). To refine a mask with more
        clicks, pass its low_res_logits row back as `mask_input`."""
        inputs = {"image": np.array([image], dtype=object), "multimask_output": np.array([multimask])}
        if points:
            inputs["point_coords"] = np.array(points, dtype=np.float32).reshape(-1, 2)
            inputs["point_labels"] = np.array(labels, dtype=np.int32)
        if box is not None:
            inputs["boxes"] = np.array([box], dtype=np.float32)
        if mask_input is not None:
            inputs["mask_input"] = np.asarray(mask_input, dtype=np.float32).reshape(1, *np.shape(mask_input)[-2:])
        out = self.infer("sam", inputs, ["masks", "iou_scores", "low_res_logits"])
        return out["masks"], out["iou_scores"], out["low_res_logits"]

    def generate(self, prompt: str, max_tokens: int = 64, stream: bool = True, model: str = "llm",
                 timeout_s: float = 300.0, **optional) -> Iterator[str]:
        """Text from a decoupled generating model over gRPC streaming: deltas as they arrive (stream=True) or the
        whole answer once. `optional`: temperature, top_k, top_p, seed, stop, min_length. Errors raise."""
        if self.protocol != "grpc":
            raise ValueError("generation streams over gRPC only (decoupled models): use protocol='grpc'")
        responses: queue.Queue = queue.Queue()
        self.triton.start_stream(callback=lambda result, error: responses.put((result, error)))
        try:
            self.triton.async_stream_infer(model, generation_inputs(self.api, prompt, max_tokens, stream, **optional),
                                           request_id=uuid.uuid4().hex, enable_empty_final_response=True)
            while True:
                result, error = responses.get(timeout=timeout_s)
                if error is not None:
                    raise error
                text = result.as_numpy("text_output")
                if text is not None and text.size and text.reshape(-1)[0]:
                    yield text.reshape(-1)[0].decode()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        finally:
            self.triton.stop_stream(cancel_requests=True)

    def close(self) -> None:
        self.triton.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # an open keep-alive connection holds Triton's shutdown for its whole exit timeout


# optional generation inputs and their dtypes (tensorrtllm_backend names; see backends/generation.py)
GENERATION_OPTIONAL = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.int64,
                       "min_length": np.int32, "stop": object}


def generation_inputs(api, prompt: str, max_tokens: int, stream: bool = True, **optional) -> list:
    """`llm` request tensors for tritonclient `api` (grpc or grpc.aio); `optional`: temperature=0.7, stop=["."], ..."""
    arrays = {"text_input": np.array([prompt.encode()], dtype=object),
              "max_tokens": np.array([max_tokens], dtype=np.int32), "stream": np.array([stream])}
    for name, value in optional.items():
        if name not in GENERATION_OPTIONAL:
            raise ValueError(f"unknown generation input {name!r}; known: {sorted(GENERATION_OPTIONAL)}")
        values = [v.encode() for v in value] if name == "stop" else [value]
        arrays[name] = np.array(values, dtype=GENERATION_OPTIONAL[name])
    return infer_inputs(api, arrays)


def infer_inputs(api, arrays: dict[str, np.ndarray]) -> list:
    """tritonclient InferInputs from named arrays (object arrays of bytes become BYTES)."""
    tensors = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == object else _TRITON_DTYPES[array.dtype.str[1:]]
        tensor = api.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _bytes_column(items: list[bytes]) -> np.ndarray:
    """A batch of N single-element BYTES rows ([N, 1]), as batching models expect."""
    column = np.empty((len(items), 1), dtype=object)
    for i, item in enumerate(items):
        column[i, 0] = item
    return column


_TRITON_DTYPES = {"f4": "FP32", "f2": "FP16", "i4": "INT32", "i8": "INT64", "b1": "BOOL", "u1": "UINT8"}
