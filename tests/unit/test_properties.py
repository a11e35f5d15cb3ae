"""Property tests (hypothesis): whatever bytes or values a client sends, the decoders and the request and parameter
parsers answer with a result or with the project's own error (InvalidInput, ParameterError), never anything else:
any other exception would reach the client as INTERNAL, and in a batch could take its neighbours with it."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from backends.core.errors import InvalidInput
from backends.core.health import HealthParams
from backends.core.inputs import Inputs, check_request_parameters
from backends.core.params import ParameterError
from backends.core.qos import read_qos_class
from backends.llm.engine import EngineConfig
from backends.llm.requests import read_adapter_action, read_generation_request
from backends.media.audio import decode_audio
from backends.media.images import decode_image
from backends.vision.encoders import EncoderParams
from tests.conftest import wav

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def encoded(fmt: str, mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, (7, 5), 128).save(out, fmt)
    return out.getvalue()


# valid files of Pillow's formats: mutated, they reach deep into each plugin's parser
SEEDS = [encoded("PNG"), encoded("JPEG"), encoded("GIF", "P"), encoded("BMP"), encoded("PPM"), encoded("TIFF"),
         encoded("WEBP"), encoded("ICO"), encoded("TGA"), encoded("PCX"), encoded("SGI"), encoded("IM"),
         encoded("PNG", "RGBA"), encoded("JPEG", "CMYK"), b"P6\n1 1\n255\n\x00\x00\x00"]


@st.composite
def mutated(draw, seeds: list[bytes]) -> bytes:
    """A seed file with some bytes overwritten, cut short or extended."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    data = data[:draw(st.integers(0, len(data)))]
    return bytes(data) + draw(st.binary(max_size=64))


@SETTINGS
@given(st.one_of(st.binary(max_size=512), mutated(SEEDS)))
def test_any_bytes_decode_to_an_image_or_invalid_input(data):
    try:
        image = decode_image(data, max_pixels=1_000_000)
    except InvalidInput:
        return
    assert image.mode == "RGB" and image.width >= 1 and image.height >= 1


AUDIO_SEEDS = [wav(np.zeros(800, np.float32)), wav(np.zeros(800, np.float32), fmt="FLAC", subtype="PCM_16"),
               wav(np.zeros((400, 2), np.float32), 8000), wav(np.zeros(800, np.float32), fmt="OGG", subtype="VORBIS")]


@SETTINGS
@given(st.one_of(st.binary(max_size=512), mutated(AUDIO_SEEDS)))
def test_any_bytes_decode_to_audio_or_invalid_input(data):
    try:
        samples = decode_audio(data)
    except InvalidInput:
        return
    assert samples.dtype == np.float32 and samples.ndim == 1 and np.isfinite(samples).all()


def arrays() -> st.SearchStrategy:
    """What a request's tensor can hold: bytes (UTF-8 or not), numbers of any dtype (NaN, inf, huge), any shape."""
    scalars = st.one_of(st.binary(max_size=32).map(lambda b: np.array([b], dtype=object)),
                        st.text(max_size=16).map(lambda t: np.array([t.encode()], dtype=object)),
                        st.integers(-2**63, 2**63 - 1).map(lambda i: np.array([i], dtype=np.int64)),
                        st.integers(-2**31, 2**31 - 1).map(lambda i: np.array([i], dtype=np.int32)),
                        st.floats(allow_nan=True, allow_infinity=True, width=32).map(
                            lambda f: np.array([f], dtype=np.float32)),
                        st.booleans().map(lambda b: np.array([b])))
    shaped = st.integers(0, 3).map(lambda n: np.zeros(n, dtype=np.int32))
    return st.one_of(scalars, shaped, scalars.map(lambda a: np.repeat(a, 2)))


GENERATION_INPUTS = ["text_input", "max_tokens", "temperature", "top_k", "top_p", "min_length", "stop", "seed",
                     "stream", "lora_id", "lora_action"]


@SETTINGS
@given(st.dictionaries(st.sampled_from(GENERATION_INPUTS), arrays()))
def test_any_generation_inputs_parse_or_are_invalid_input(inputs):
    reader = Inputs(inputs.get)
    try:
        read_adapter_action(reader)
        ask = read_generation_request(reader, max_tokens_limit=512, max_prompt_bytes=4096)
    except InvalidInput:
        return
    assert ask.prompt and 1 <= ask.sampling.max_tokens <= 512 and np.isfinite(ask.sampling.temperature)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=6)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["qos_class", "inject_fault", "triton_enable_empty_final_response", "x",
                                        "priority"]), json_values))
def test_any_request_parameters_parse_or_are_invalid_input(parameters):
    try:
        check_request_parameters(json.dumps(parameters), fault_parameter="inject_fault", allowed=("qos_class",))
        read_qos_class(dict(parameters))
    except InvalidInput:
        pass


@pytest.mark.parametrize("schema", [EncoderParams, EngineConfig, HealthParams], ids=lambda s: s.__name__)
def test_any_config_parameter_strings_parse_or_are_parameter_errors(schema):
    fields = list(schema.__dataclass_fields__)

    @SETTINGS
    @given(st.dictionaries(st.sampled_from(fields), st.text(max_size=12)))
    def check(parameters):
        try:
            schema.from_config(parameters)
        except ParameterError:
            pass

    check()
