"""What a generation request asks for, read from the `llm`-style inputs.

The tensor names follow tensorrtllm_backend (`text_input`, `max_tokens`, `stream`, `min_length`, ...), so genai-perf
and clients written for TensorRT-LLM's ensemble work unchanged. Every check names the input that was wrong.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backends.core.errors import InvalidInput
from backends.core.inputs import Inputs
from backends.llm.sampling import SamplingParams

# name, Triton dtype, dims, optional: the inputs every generating model declares (text_input and max_tokens are
# required by read_generation_request, but an adapter control request carries only lora_action and lora_id)
GENERATION_INPUTS = (
    ("text_input", "BYTES", [1], True),
    ("max_tokens", "INT32", [1], True),
    ("stream", "BOOL", [1], True),
    ("temperature", "FP32", [1], True),
    ("top_k", "INT32", [1], True),
    ("top_p", "FP32", [1], True),
    ("seed", "INT64", [1], True),
    ("stop", "BYTES", [-1], True),
    ("min_length", "INT32", [1], True),
    ("lora_id", "BYTES", [1], True),  # the request's LoRA adapter (a name in the adapter root, or "auto")
    ("lora_action", "BYTES", [1], True),  # instead of generating: "load", "unload" or "list" adapters
)
# said to a client that sends a generation option as a request parameter
OPTIONS_HINT = f"; generation options are input tensors ({', '.join(n for n, *_ in GENERATION_INPUTS[2:])})"
LORA_ACTIONS = ("load", "unload", "list")


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True
    lora_id: str = ""  # "" : the base model


@dataclass(frozen=True)
class AdapterAction:
    """A control request: load, unload or list the model's LoRA adapters."""

    action: str
    name: str = ""


def read_adapter_action(inputs: Inputs) -> AdapterAction | None:
    """The request's `lora_action`, or None for a generation request."""
    action = inputs.text("lora_action")
    if action is None:
        return None
    if action not in LORA_ACTIONS:
        raise InvalidInput(f"lora_action must be one of {list(LORA_ACTIONS)}, got {action!r}")
    name = inputs.text("lora_id", "")
    if action != "list" and not name:
        raise InvalidInput(f"lora_action {action!r} needs lora_id, the adapter's name")
    if inputs.get("text_input") is not None:
        raise InvalidInput("a lora_action request generates nothing: leave text_input out")
    return AdapterAction(action, name)


def read_generation_request(inputs: Inputs, max_tokens_limit: int,
                            max_prompt_bytes: int | None = None) -> GenerationRequest:
    """`max_prompt_bytes`: longer text cannot fit the context; refused before it is tokenized."""
    prompt = inputs.text("text_input")
    if prompt is None:
        raise InvalidInput("text_input must hold exactly one string")
    if not prompt:
        raise InvalidInput("text_input is empty")
    if max_prompt_bytes is not None and (size := len(prompt.encode())) > max_prompt_bytes:
        raise InvalidInput(f"text_input is {size} bytes: longer than any prompt that fits the context of "
                           f"{max_tokens_limit} tokens can be ({max_prompt_bytes} bytes)")
    max_tokens = inputs.scalar("max_tokens", int)
    if max_tokens is None:
        raise InvalidInput("max_tokens is required")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise InvalidInput(f"max_tokens must be between 1 and {max_tokens_limit}, got {max_tokens}")
    temperature = inputs.scalar("temperature", float, 0.0)
    if not (np.isfinite(temperature) and temperature >= 0):
        raise InvalidInput(f"temperature must be a finite number >= 0, got {temperature}")
    top_k = inputs.scalar("top_k", int, 0)
    if top_k < 0:
        raise InvalidInput(f"top_k must be >= 0, got {top_k}")
    top_p = inputs.scalar("top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {top_p}")
    min_tokens = inputs.scalar("min_length", int, 0)
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidInput(f"min_length must be between 0 and max_tokens ({max_tokens}), got {min_tokens}")
    stop = tuple(s for s in inputs.texts("stop") if s)
    seed = inputs.scalar("seed", int)
    sampling = SamplingParams(max_tokens, temperature, top_k, top_p, seed, stop, min_tokens)
    return GenerationRequest(prompt, sampling, stream=inputs.scalar("stream", bool, True),
                             lora_id=inputs.text("lora_id", ""))
