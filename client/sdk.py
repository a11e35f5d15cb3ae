"""A small typed SDK over tritonclient: the same calls over HTTP or gRPC, errors as tritonclient raises them.

Without a URL the client talks to localhost on the port `make serve` uses: $HTTP_PORT (default 8000) for HTTP,
$GRPC_PORT (default 8001) for gRPC.
"""
from __future__ import annotations

import http.client
import io
import json
import os
import queue
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
from tritonclient.utils import InferenceServerException

# protocol -> (environment variable `make serve` reads, Triton's default port)
DEFAULT_PORTS = {"http": ("HTTP_PORT", 8000), "grpc": ("GRPC_PORT", 8001)}


def default_url(protocol: str = "http") -> str:
    """localhost on the port `make serve` listens on for `protocol`, so `HTTP_PORT=18000 make serve` needs no --url."""
    if protocol not in DEFAULT_PORTS:
        raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
    variable, port = DEFAULT_PORTS[protocol]
    return f"localhost:{os.environ.get(variable) or port}"


@dataclass(frozen=True)
class Label:
    label: str
    index: int
    score: float


class Client:
    """`Client("localhost:8000")` (HTTP) or `Client("localhost:8001", protocol="grpc")`; no URL: `default_url`."""

    def __init__(self, url: str | None = None, protocol: str = "http", timeout_s: float = 60.0):
        url = url or default_url(protocol)
        if protocol == "http":
            import tritonclient.http as api

            self.triton = api.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)
        elif protocol == "grpc":
            import tritonclient.grpc as api

            self.triton = api.InferenceServerClient(url)
        else:
            raise ValueError(f"protocol must be http or grpc, not {protocol!r}")
        self.api, self.protocol, self.url = api, protocol, url

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
                mask_input: np.ndarray | None = None, mask_format: str = "binary",
                outputs: tuple[str, ...] = ("masks", "iou_scores", "low_res_logits")) -> tuple:
        """(masks bool [K, H, W], iou_scores [K], low_res_logits [K, 256, 256]) from `sam` for one prompt: points
        (x, y) with labels (1 object, 0 background) and/or one box (x0, y0, x1, y1). To refine a mask with more
        clicks, pass its low_res_logits row back as `mask_input`. `mask_format`: how the masks travel, "binary" (a
        byte a pixel), "packed" (eight pixels a byte, unpacked here to the same bool masks) or "rle" (returned as K
        COCO compressed RLE dicts: `pycocotools.mask.decode(rle)` gives the pixels). `outputs`: those to ask for
        (the others are None; the server computes no masks nobody asked for)."""
        inputs = {"image": np.array([image], dtype=object), "multimask_output": np.array([multimask])}
        names = {"binary": "masks", "packed": "masks_packed", "rle": "masks_rle"}
        if mask_format != "binary":
            inputs["mask_format"] = np.array([mask_format.encode()], dtype=object)
            outputs = tuple(names.get(mask_format, "masks") if name == "masks" else name for name in outputs)
        if points:
            inputs["point_coords"] = np.array(points, dtype=np.float32).reshape(-1, 2)
            inputs["point_labels"] = np.array(labels, dtype=np.int32)
        if box is not None:
            inputs["boxes"] = np.array([box], dtype=np.float32)
        if mask_input is not None:
            inputs["mask_input"] = np.asarray(mask_input, dtype=np.float32).reshape(1, *np.shape(mask_input)[-2:])
        out = self.infer("sam", inputs, list(outputs))
        masks = out.get("masks")
        if mask_format == "rle" and out.get("masks_rle") is not None:
            masks = [json.loads(item) for item in out["masks_rle"]]
        elif mask_format == "packed" and out.get("masks_packed") is not None:
            from PIL import Image  # the width the last byte's padding hides: from the image's header

            width = Image.open(io.BytesIO(image)).width
            masks = np.unpackbits(out["masks_packed"], axis=-1, count=width).astype(bool)
        return masks, out.get("iou_scores"), out.get("low_res_logits")

    def tile(self, image: bytes) -> tuple[np.ndarray, int]:
        """(pixel_values [T, 3, S, S], num_image_tokens) of one encoded image from `anyres`: the LLaVA-NeXT tiles
        and how many visual tokens `<image>` expands into for it."""
        out = self.infer("anyres", {"image": np.array([image], dtype=object)}, ["pixel_values", "num_image_tokens"])
        return out["pixel_values"], int(out["num_image_tokens"].reshape(-1)[0])

    def generate(self, prompt: str, max_tokens: int = 64, stream: bool = True, model: str | None = None,
                 timeout_s: float = 300.0, image: bytes | None = None, qos_class: str | None = None,
                 **optional) -> Iterator[str]:
        """Text from a decoupled generating model: deltas as they arrive (stream=True) or the whole answer once.
        The model is `llm`, or `vlm` when `image` (an encoded file) is given, unless `model` names another. gRPC
        streams bidirectionally; HTTP uses Triton's generate_stream endpoint (no images: JSON carries no bytes).
        `optional`: temperature, top_k, top_p, seed, stop, min_length, lora_id (a LoRA adapter's name, or "auto").
        `qos_class`: high, normal or low (the request parameter of the same name; default: the model's, normal).
        Bad arguments raise here, errors from the server while iterating; `timeout_s` bounds the wait for each
        response."""
        model = model or ("vlm" if image is not None else "llm")
        arrays = generation_arrays(prompt, max_tokens, stream, image, **optional)
        parameters = {"qos_class": qos_class} if qos_class else None
        if self.protocol == "http":
            body = generate_request_body(arrays) | ({"parameters": parameters} if parameters else {})
            return http_generate_stream(self.url, model, body, timeout_s)
        return self._stream_grpc(model, infer_inputs(self.api, arrays), timeout_s, parameters)

    def adapters(self, action: str = "list", name: str = "", model: str = "llm", timeout_s: float = 300.0) -> dict:
        """Load, unload (answered once no request uses it) or list a generating model's LoRA adapters."""
        arrays = {"lora_action": np.array([action.encode()], dtype=object)}
        if name:
            arrays["lora_id"] = np.array([name.encode()], dtype=object)
        if self.protocol == "http":
            texts = http_generate_stream(self.url, model, generate_request_body(arrays), timeout_s,
                                         until_finished=False)  # an answer, not a generation
        else:
            texts = self._stream_grpc(model, infer_inputs(self.api, arrays), timeout_s)
        return json.loads("".join(texts))

    def _stream_grpc(self, model: str, inputs: list, timeout_s: float, parameters: dict | None = None) -> Iterator[str]:
        """Non-empty `text_output`s of one request on a gRPC stream, until Triton flags the final response."""
        responses: queue.Queue = queue.Queue()
        self.triton.start_stream(callback=lambda result, error: responses.put((result, error)))
        answered = False  # the request is complete: the stream is closed, not cancelled
        try:
            try:
                self.triton.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex,
                                               enable_empty_final_response=True, parameters=parameters)
            except InferenceServerException as error:
                raise _reported_error(responses, error) from None
            while not answered:
                try:
                    result, error = responses.get(timeout=timeout_s)
                except queue.Empty:
                    raise TimeoutError(f"no response from {model} within {timeout_s:g} s") from None
                answered = error is not None or result.get_response().parameters["triton_final_response"].bool_param
                if error is not None:
                    raise error
                text = result.as_numpy("text_output")
                if text is not None and text.size and text.reshape(-1)[0]:
                    yield text.reshape(-1)[0].decode()
        finally:
            # Cancelling a stream whose request already completed can leave Triton 2.51 holding the model (an
            # unload then waits forever): only a request still running (the caller stopped reading) is cancelled.
            self.triton.stop_stream(cancel_requests=not answered)

    def close(self) -> None:
        self.triton.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # an open keep-alive connection holds Triton's shutdown for its whole exit timeout


# optional generation inputs and their dtypes (tensorrtllm_backend names; see backends/llm/requests.py)
GENERATION_OPTIONAL = {"temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "seed": np.int64,
                       "min_length": np.int32, "stop": object, "lora_id": object}


def generation_inputs(api, prompt: str, max_tokens: int, stream: bool = True, **optional) -> list:
    """`llm` request tensors for tritonclient `api` (grpc or grpc.aio); `optional`: temperature=0.7, stop=["."], ..."""
    return infer_inputs(api, generation_arrays(prompt, max_tokens, stream, **optional))


def generation_arrays(prompt: str, max_tokens: int, stream: bool = True, image: bytes | None = None,
                      **optional) -> dict[str, np.ndarray]:
    """Named [1]-shaped arrays (no batch dimension: generating models have max_batch_size 0) of one generation
    request; with `image` (an encoded file) they are `vlm`'s inputs."""
    arrays = {"text_input": np.array([prompt.encode()], dtype=object),
              "max_tokens": np.array([max_tokens], dtype=np.int32), "stream": np.array([stream])}
    if image is not None:
        arrays["image"] = np.array([image], dtype=object)
    for name, value in optional.items():
        if name not in GENERATION_OPTIONAL:
            raise ValueError(f"unknown generation input {name!r}; known: {sorted(GENERATION_OPTIONAL)}")
        values = [v.encode() for v in value] if name == "stop" else [value.encode() if isinstance(value, str) else value]
        arrays[name] = np.array(values, dtype=GENERATION_OPTIONAL[name])
    return arrays


def generate_request_body(arrays: dict[str, np.ndarray]) -> dict:
    """The JSON body Triton's generate endpoints take: one key per input, a scalar for [1] inputs, a list for stop.
    Raw image bytes have no JSON form the server would decode, hence the refusal."""
    if "image" in arrays:
        raise ValueError("generate with an image needs protocol='grpc' (Triton's HTTP generate endpoint takes JSON "
                         "strings and numbers, not image bytes); use Client(url, protocol='grpc') or --protocol grpc")
    body = {}
    for name, array in arrays.items():
        values = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        body[name] = values if name == "stop" else values[0]
    return body


def http_generate_stream(url: str, model: str, body: dict, timeout_s: float = 300.0,
                         until_finished: bool = True) -> Iterator[str]:
    """Deltas from POST /v2/models/<model>/generate_stream at `url` (host:port), read event by event so each token
    is yielded as it arrives; errors raise InferenceServerException with the server's message, as does a stream
    that ends without a `finish_reason` when `until_finished` (a generation's last event carries one)."""
    connection = http.client.HTTPConnection(url, timeout=timeout_s)
    try:
        connection.request("POST", f"/v2/models/{urllib.parse.quote(model, safe='')}/generate_stream",
                           body=json.dumps(body).encode(),
                           headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = connection.getresponse()
        if response.status != 200:
            raise InferenceServerException(http_error_message(response.status, response.reason, response.read()),
                                           status=str(response.status))
        yield from generated_texts(server_sent_events(response), until_finished)
    finally:
        connection.close()


def http_error_message(status: int, reason: str, body: bytes) -> str:
    """The server's {"error": ...} message of a refused request, else what the status line says."""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip()
        return f"HTTP {status} {reason}" + (f": {text}" if text else "")


def server_sent_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """JSON payloads of Server-Sent Events: the `data:` lines up to a blank line make one event. Other fields and
    comments carry nothing Triton sends."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield json.loads("\n".join(data))
            data = []
    if data:  # a stream cut after the last data line
        yield json.loads("\n".join(data))


def generated_texts(events: Iterable[dict], until_finished: bool = False) -> Iterator[str]:
    """Non-empty `text_output`s of generate_stream events; an error event raises (it can follow a 200 status).
    `until_finished`: events that end before one with a `finish_reason` raise too: the stream was cut (a server
    that died mid-stream, behind a proxy that ended the response as if complete)."""
    finished = False
    for event in events:
        if "error" in event:
            raise InferenceServerException(str(event["error"]))
        finished = finished or "finish_reason" in event
        text = event.get("text_output")
        text = "".join(text) if isinstance(text, list) else text
        if text:
            yield text
    if until_finished and not finished:
        raise InferenceServerException("the stream ended before its final response (no finish_reason): the server "
                                       "or a proxy on the way cut it")


def infer_inputs(api, arrays: dict[str, np.ndarray]) -> list:
    """tritonclient InferInputs from named arrays (object arrays of bytes become BYTES)."""
    tensors = []
    for name, array in arrays.items():
        dtype = "BYTES" if array.dtype == object else _TRITON_DTYPES[array.dtype.str[1:]]
        tensor = api.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _reported_error(responses: queue.Queue, fallback: InferenceServerException,
                    wait_s: float = 5.0) -> InferenceServerException:
    """A stream that died before the request went out (server down) reports why through the callback, racing the
    vaguer "stream is no longer in valid state" that async_stream_infer raises: prefer the callback's error."""
    try:
        _, error = responses.get(timeout=wait_s)
    except queue.Empty:
        return fallback
    return error or fallback


def _bytes_column(items: list[bytes]) -> np.ndarray:
    """A batch of N single-element BYTES rows ([N, 1]), as batching models expect."""
    column = np.empty((len(items), 1), dtype=object)
    for i, item in enumerate(items):
        column[i, 0] = item
    return column


_TRITON_DTYPES = {"f4": "FP32", "f2": "FP16", "i4": "INT32", "i8": "INT64", "b1": "BOOL", "u1": "UINT8"}
