"""What a generation request asks for, read from the `llm`-style inputs.

The tensor names follow tensorrtllm_backend (`text_input`, `max_tokens`, `stream`, `min_length`, ...), so genai-perf
and clients written for TensorRT-LLM's ensemble work unchanged. Every check names the input that was wrong.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from backends.errors import InvalidInput

# name, Triton dtype, dims, optional: the inputs every generating model declares
GENERATION_INPUTS = (
    ("text_input", "BYTES", [1], False),
    ("max_tokens", "INT32", [1], False),
    ("stream", "BOOL", [1], True),
    ("temperature", "FP32", [1], True),
    ("top_k", "INT32", [1], True),
    ("top_p", "FP32", [1], True),
    ("seed", "INT64", [1], True),
    ("stop", "BYTES", [-1], True),
    ("min_length", "INT32", [1], True),
)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # EOS is ignored until this many tokens were produced

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True


def _scalar(get: Callable[[str], np.ndarray | None], name: str, kind: type, default):
    array = get(name)
    if array is None:
        return default
    if array.size != 1:
        raise InvalidInput(f"{name} must hold one value, got shape {list(array.shape)}")
    value = array.reshape(-1)[0]
    return value.decode() if isinstance(value, bytes) else kind(value)


def _text(value: object, name: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def check_request_parameters(parameters_json: str) -> None:
    """Generation options travel as input tensors; a request parameter we would silently ignore is an error instead
    (Triton's own `triton_*` parameters, such as the empty-final-response flag, pass)."""
    unknown = sorted(k for k in json.loads(parameters_json or "{}") if not k.startswith("triton_"))
    if unknown:
        optional = ", ".join(name for name, *_ in GENERATION_INPUTS[2:])
        raise InvalidInput(f"unknown request parameter(s) {unknown}: this model takes its options as input tensors "
                           f"({optional})")


def read_generation_request(get: Callable[[str], np.ndarray | None], max_tokens_limit: int) -> GenerationRequest:
    """`get(name)` returns an input as a numpy array, or None when the request left it out."""
    text = get("text_input")
    if text is None or text.size != 1:
        raise InvalidInput("text_input must hold exactly one string")
    prompt = _text(text.reshape(-1)[0], "text_input")
    if not prompt:
        raise InvalidInput("text_input is empty")
    max_tokens = _scalar(get, "max_tokens", int, None)
    if max_tokens is None:
        raise InvalidInput("max_tokens is required")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidInput(f"max_tokens must be between 1 and {max_tokens_limit}, got {max_tokens}")
    temperature = _scalar(get, "temperature", float, 0.0)
    if not (np.isfinite(temperature) and temperature >= 0):
        raise InvalidInput(f"temperature must be a finite number >= 0, got {temperature}")
    top_k = _scalar(get, "top_k", int, 0)
    if top_k < 0:
        raise InvalidInput(f"top_k must be >= 0, got {top_k}")
    top_p = _scalar(get, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {top_p}")
    min_tokens = _scalar(get, "min_length", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidInput(f"min_length must be between 0 and max_tokens ({max_tokens}), got {min_tokens}")
    stop_array = get("stop")
    stop = tuple(s for s in (_text(v, "stop") for v in stop_array.reshape(-1)) if s) if stop_array is not None else ()
    seed = _scalar(get, "seed", int, None)
    sampling = SamplingParams(max_tokens, temperature, top_k, top_p, seed, stop, min_tokens)
    return GenerationRequest(prompt, sampling, stream=bool(_scalar(get, "stream", bool, True)))
