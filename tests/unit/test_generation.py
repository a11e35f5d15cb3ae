"""backends/llm/requests.py: the llm-style inputs are read with tensorrtllm_backend's names and every bad value is an
InvalidInput that names the input."""
import re

import numpy as np
import pytest

from backends.core.errors import InvalidInput
from backends.core.inputs import Inputs, check_request_parameters
from backends.llm.requests import read_generation_request


def reader(**inputs):
    arrays = {k: v if isinstance(v, np.ndarray) else np.array([v]) for k, v in inputs.items()}
    return Inputs(arrays.get)


def test_defaults_are_greedy_streaming():
    ask = read_generation_request(reader(text_input=b"hi", max_tokens=np.int32(8)), max_tokens_limit=100)
    assert ask.prompt == "hi" and ask.stream and ask.sampling.greedy and ask.sampling.max_tokens == 8


def test_optional_inputs_are_read():
    ask = read_generation_request(
        reader(text_input=np.array([b"hi"], dtype=object), max_tokens=4, stream=False, temperature=np.float32(0.7),
               top_k=5, top_p=np.float32(0.9), seed=np.int64(3), min_length=2,
               stop=np.array([b"\n", b"", b"END"], dtype=object)), max_tokens_limit=100)
    s = ask.sampling
    assert not ask.stream and not s.greedy
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.min_tokens, s.stop) == (
        pytest.approx(0.7), 5, pytest.approx(0.9), 3, 2, ("\n", "END"))


@pytest.mark.parametrize("inputs, message", [
    (dict(max_tokens=4), "text_input must hold exactly one string"),
    (dict(text_input=b"", max_tokens=4), "text_input is empty"),
    (dict(text_input=b"\xff\xfe", max_tokens=4), "text_input is not valid UTF-8"),
    (dict(text_input=b"hi"), "max_tokens is required"),
    (dict(text_input=b"hi", max_tokens=0), "max_tokens must be between 1 and 100, got 0"),
    (dict(text_input=b"hi", max_tokens=10**9), "max_tokens must be between 1 and 100, got 1000000000"),
    (dict(text_input=b"hi", max_tokens=4, temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(text_input=b"hi", max_tokens=4, temperature=np.nan), "temperature must be a finite number >= 0"),
    (dict(text_input=b"hi", max_tokens=4, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(text_input=b"hi", max_tokens=4, top_k=-1), "top_k must be >= 0"),
    (dict(text_input=b"hi", max_tokens=4, min_length=5), "min_length must be between 0 and max_tokens"),
    (dict(text_input=b"hi", max_tokens=np.array([1, 2])), "max_tokens must hold one value"),
    (dict(text_input=b"hi", max_tokens=4, stop=np.array([b"\xff"], dtype=object)), "stop is not valid UTF-8"),
])
def test_bad_values_name_the_input(inputs, message):
    with pytest.raises(InvalidInput, match=re.escape(message)):
        read_generation_request(reader(**inputs), max_tokens_limit=100)


def test_unknown_request_parameters_are_refused_but_tritons_own_pass():
    check_request_parameters('{"triton_enable_empty_final_response": true}')
    check_request_parameters("")
    with pytest.raises(InvalidInput, match=r"unknown request parameter\(s\) \['temprature'\]"):
        check_request_parameters('{"temprature": 0.5, "triton_x": 1}')
    assert check_request_parameters('{"inject_fault": "read"}', fault_parameter="inject_fault") == "read"
    with pytest.raises(InvalidInput, match="inject_fault"):  # only where fault injection is enabled
        check_request_parameters('{"inject_fault": "read"}')


def test_a_prompt_longer_than_any_that_fits_is_refused_before_tokenizing():
    """An 8 MB prompt was tokenized on the engine loop (every stream stalled 18 s) before its length was checked."""
    huge = reader(text_input=("x " * 4_000_000).encode(), max_tokens=np.int32(4))
    with pytest.raises(InvalidInput, match="text_input is 8000000 bytes: longer than any prompt that fits the "
                                           "context of 512 tokens can be"):
        read_generation_request(huge, max_tokens_limit=512, max_prompt_bytes=512 * 4 * 16)
    assert read_generation_request(reader(text_input=b"x" * 100, max_tokens=np.int32(4)), 512, 100).prompt
