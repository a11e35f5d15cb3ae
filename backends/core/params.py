"""Typed model-config parameters: one frozen dataclass per backend.

Triton hands a model its config's `parameters` as strings. Each backend declares a `Parameters` subclass; the builder
writes config.pbtxt from an instance (`to_config`), the backend reads it back once at load (`from_config`). An
unknown key or a bad value fails the model load with the key, the value and what is allowed, instead of being
silently ignored or misread.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any

# read by the python backend itself, never by our code
PYTHON_BACKEND_KEYS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS"})
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class ParameterError(ValueError):
    """A model-config parameter that cannot be used; the message names the key, the value and what is allowed."""


def parse_bool(text: str) -> bool:
    """The one boolean parser: true/false, 1/0, yes/no, on/off (any case)."""
    value = text.strip().lower()
    if value in TRUE or value in FALSE:
        return value in TRUE
    raise ValueError(f"expected one of {'/'.join(TRUE + FALSE)}")


def choice(default: str, *allowed: str) -> Any:
    """A string field limited to `allowed` (the default among them)."""
    return dataclasses.field(default=default, metadata={"choices": (default, *allowed)})


def bounded(default: float | int | None, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> Any:
    """A number field within [low, high] (or (low, high] with low_open); None stays allowed for optional fields."""
    return dataclasses.field(default=default, metadata={"low": low, "high": high, "low_open": low_open})


def mapping(default: str, keys: tuple[str, ...], zero: bool = False) -> Any:
    """A string "key=number,..." giving a positive number (or zero, with `zero`) to each of `keys`, each once."""
    return dataclasses.field(default=default, metadata={"keys": keys, "zero": zero})


def parse_mapping(text: str, keys: tuple[str, ...], zero: bool = False) -> dict[str, float]:
    values = {}
    for item in text.split(","):
        key, sep, number = item.partition("=")
        key = key.strip()
        if not sep or key not in keys or key in values:
            raise ValueError(f"expected {', '.join(f'{k}=<number>' for k in keys)}; got {item.strip()!r}")
        values[key] = float(number)
        if not (math.isfinite(values[key]) and (values[key] >= 0 if zero else values[key] > 0)):
            raise ValueError(f"{key} must be a number {'>= 0' if zero else '> 0'}")
    if missing := [k for k in keys if k not in values]:
        raise ValueError(f"missing {', '.join(missing)}")
    return values


def device(default: str = "auto") -> Any:
    """auto (CUDA when present), cpu, cuda or cuda:N."""
    return dataclasses.field(default=default, metadata={"pattern": DEVICE})


@dataclasses.dataclass(frozen=True)
class Parameters:
    """Base of every backend's parameter schema. Subclasses only declare fields (with defaults)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                raise ParameterError(f"parameter {f.name!r} = {value!r}: must be a finite number")
            if "choices" in meta and value not in meta["choices"]:
                raise ParameterError(f"parameter {f.name!r} = {value!r}: allowed values are {list(meta['choices'])}")
            if "keys" in meta:
                try:
                    parse_mapping(value, meta["keys"], meta["zero"])
                except ValueError as e:
                    raise ParameterError(f"parameter {f.name!r} = {value!r}: {e}") from None
            if "pattern" in meta and not meta["pattern"].fullmatch(str(value)):
                raise ParameterError(f"parameter {f.name!r} = {value!r}: expected auto, cpu, cuda or cuda:N")
            low, high = meta.get("low"), meta.get("high")
            if (low is not None and (value <= low if meta["low_open"] else value < low)) or \
                    (high is not None and value > high):
                span = f"{'(' if meta['low_open'] else '['}{'-inf' if low is None else low}, " \
                       f"{'inf' if high is None else high}]"
                raise ParameterError(f"parameter {f.name!r} = {value!r}: must be in {span}")

    @classmethod
    def from_config(cls, parameters: dict[str, str]) -> typing.Self:
        """From a model config's parameters (strings). Keys the python backend reads itself are skipped."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(parameters) - set(known) - PYTHON_BACKEND_KEYS)
        if unknown:
            raise ParameterError(f"unknown parameter(s) {unknown} in the model config; this backend takes "
                                 f"{sorted(known)}")
        hints = typing.get_type_hints(cls)
        values = {}
        for name, text in parameters.items():
            if name in known:
                values[name] = _parse(name, text, hints[name])
        return cls(**values)

    def to_config(self) -> dict[str, str]:
        """Every set field as the string Triton's config holds (None, "not set", is left out)."""
        return {f.name: _render(value) for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None}

    @classmethod
    def from_model_config(cls, model_config: dict) -> typing.Self:
        """From the model config JSON Triton passes to `initialize`."""
        return cls.from_config({k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()})


def _parse(name: str, text: str, kind: Any) -> Any:
    optional = type(None) in typing.get_args(kind)
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
    if optional and text.strip() == "":
        return None
    try:
        if base is bool:
            return parse_bool(text)
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        return text
    except ValueError as e:
        expected = {int: "expected an integer", float: "expected a number"}.get(base, str(e))
        raise ParameterError(f"parameter {name!r} = {text!r}: {expected}"
                             f"{' or empty' if optional else ''}") from None


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)
