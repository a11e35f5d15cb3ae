"""A request's inputs, read and decoded in one place: every mistake raises InvalidInput naming the input.

Transport-free (it takes a `get(name)` that returns the input as numpy (or a torch tensor where a model takes GPU
tensors), or None when the request left it out), so
the backends and the library code they call share one set of checks, UTF-8 decoding included.
"""
from __future__ import annotations

import json
from typing import Callable

import numpy as np

from backends.core.errors import InvalidInput


def utf8(raw: bytes | str, name: str) -> str:
    """The one UTF-8 decoder for BYTES inputs."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, (bytes, bytearray, memoryview)):  # a number where a string belongs
        raise InvalidInput(f"{name} must be a string (BYTES), got {type(raw).__name__}")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def check_request_parameters(parameters_json: str, hint: str = "", fault_parameter: str | None = None,
                             allowed: tuple[str, ...] = ()) -> str | None:
    """Refuses request parameters the model does not take (`allowed`, read by the caller; Triton's own `triton_*`
    pass), as one sent would be silently ignored. Returns the value of `fault_parameter` (test-only fault
    injection), when named and present."""
    parameters = json.loads(parameters_json or "{}")
    fault = parameters.pop(fault_parameter, None) if fault_parameter else None
    unknown = sorted(k for k in parameters if not k.startswith("triton_") and k not in allowed)
    if unknown:
        takes = f"only {list(allowed)}" if allowed else "none"
        raise InvalidInput(f"unknown request parameter(s) {unknown}: this model takes {takes}{hint}")
    return fault


def as_bytes(value: object, name: str = "input") -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidInput(f"{name} must hold encoded bytes (BYTES), got {type(value).__name__}")


class Inputs:
    def __init__(self, get: Callable[[str], np.ndarray | None], requested: frozenset[str] | None = None):
        """`requested`: the outputs the client asked for (Triton names them all when it asked for none); None: all."""
        self.get, self.requested = get, requested

    def array(self, name: str) -> np.ndarray | None:
        return self.get(name)

    def blob(self, name: str, what: str = "encoded file") -> bytes:
        """Exactly one BYTES element (an encoded image or audio file)."""
        array = self.get(name)
        if array is None or array.size != 1:
            raise InvalidInput(f"{name} must hold exactly one {what}, got "
                               f"{'none' if array is None else array.size}")
        return as_bytes(array.reshape(-1)[0], name)

    def items(self, name: str) -> list[bytes]:
        """Every element of a BYTES input of any shape, in order."""
        array = self.get(name)
        return [] if array is None else [as_bytes(item, name) for item in array.reshape(-1)]

    def text(self, name: str, default: str | None = None) -> str | None:
        """One UTF-8 string, or `default` when the input is absent."""
        array = self.get(name)
        if array is None:
            return default
        if array.size != 1:
            raise InvalidInput(f"{name} must hold one string, got {array.size}")
        return utf8(array.reshape(-1)[0], name)

    def texts(self, name: str) -> list[str]:
        return [utf8(item, name) for item in self.items(name)]

    def scalar(self, name: str, kind: type, default=None):
        """One number or flag, converted to `kind`, or `default` when absent."""
        array = self.get(name)
        if array is None:
            return default
        if array.size != 1:
            raise InvalidInput(f"{name} must hold one value, got shape {list(array.shape)}")
        value = array.reshape(-1)[0]
        if isinstance(value, (bytes, str, np.bytes_, np.str_)):  # a BYTES tensor (Triton checks dtypes; we too)
            raise InvalidInput(f"{name} must be a number, got {array.dtype} data")
        try:
            return kind(value)
        except (ValueError, OverflowError) as e:  # int(nan), int(inf)
            raise InvalidInput(f"{name}: {value!r} is not a valid {kind.__name__} ({e})") from None
