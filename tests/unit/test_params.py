"""backends/core/params.py: one typed schema per backend; unknown keys and bad values are refused with the key, the
value and what is allowed; one boolean parser; the builder's output reads back to the same values."""
import re
from dataclasses import dataclass

import pytest

from backends.core.params import ParameterError, Parameters, bounded, choice, device, parse_bool
from backends.llm.engine import EngineConfig
from backends.sam.engine import SamParams
from backends.vision.anyres import AnyResParams
from backends.vision.clip import ClipParams
from backends.vision.encoders import EncoderParams
from backends.vision.llava_vision import VLMParams
from backends.whisper.engine import WhisperParams

SCHEMAS = [EncoderParams, ClipParams, AnyResParams, EngineConfig, VLMParams, WhisperParams, SamParams]


@dataclass(frozen=True)
class Example(Parameters):
    runtime: str = choice("auto", "torch")
    device: str = device()
    threads: int = bounded(4, 1, 64)
    ratio: float = bounded(1.0, 0, 1, low_open=True)
    limit: int | None = bounded(None, 1)
    fast: bool = False


@pytest.mark.parametrize("text, value", [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
                                         ("false", False), ("0", False), ("No", False), ("off", False)])
def test_one_boolean_parser(text, value):
    assert parse_bool(text) is value
    assert Example.from_config({"fast": text}).fast is value


def test_values_are_typed_and_defaults_kept():
    p = Example.from_config({"runtime": "torch", "device": "cuda:1", "threads": "8", "ratio": "0.5", "limit": ""})
    assert (p.runtime, p.device, p.threads, p.ratio, p.limit, p.fast) == ("torch", "cuda:1", 8, 0.5, None, False)


@pytest.mark.parametrize("params, message", [
    ({"thread": "8"}, "unknown parameter(s) ['thread']"),
    ({"threads": "eight"}, "parameter 'threads' = 'eight': expected an integer"),
    ({"threads": "0"}, "parameter 'threads' = 0: must be in [1, 64]"),
    ({"ratio": "0"}, "parameter 'ratio' = 0.0: must be in (0, 1]"),
    ({"ratio": "nan"}, "parameter 'ratio' = nan: must be a finite number"),
    ({"limit": "x"}, "parameter 'limit' = 'x': expected an integer or empty"),
    ({"fast": "maybe"}, "parameter 'fast' = 'maybe': expected one of true/1/yes/on/false/0/no/off"),
    ({"runtime": "tvm"}, "parameter 'runtime' = 'tvm': allowed values are ['auto', 'torch']"),
    ({"device": "gpu0"}, "parameter 'device' = 'gpu0': expected auto, cpu, cuda or cuda:N"),
])
def test_bad_keys_and_values_name_key_value_and_what_is_allowed(params, message):
    with pytest.raises(ParameterError, match=re.escape(message)):
        Example.from_config(params)


def test_python_backend_keys_pass():
    assert Example.from_config({"EXECUTION_ENV_PATH": "/venv"}) == Example()


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_schema_round_trips_through_the_config(schema):
    defaults = schema() if schema is not ClipParams else schema(logit_scale=14.3)
    assert schema.from_config(defaults.to_config()) == defaults


def test_engine_config_is_the_llm_backends_schema():
    config = EngineConfig.from_config({"block_size": "32", "cuda_graphs": "0", "kv_cache_memory_mb": "64"})
    assert (config.block_size, config.cuda_graphs, config.kv_cache_memory_mb) == (32, False, 64)
    with pytest.raises(ParameterError, match="'max_batch'"):
        EngineConfig.from_config({"max_batch": "0"})
    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['max_batch_size'\]"):
        EngineConfig.from_config({"max_batch_size": "8"})
