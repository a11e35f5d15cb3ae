"""backends/core/adapter.py with a stand-in for Triton's python-backend module: the instance's device is picked,
parameters are read through the schema at load, and a request that fails fails alone."""
import json
import sys
import threading
import time
import types

import numpy as np
import pytest

from backends.core.adapter import BatchedBackend
from backends.core.errors import InvalidInput
from backends.core.params import ParameterError
from backends.vision.encoders import EncoderParams


class FakeError:
    INVALID_ARG, INTERNAL, UNAVAILABLE, NOT_FOUND = "INVALID_ARG", "INTERNAL", "UNAVAILABLE", "NOT_FOUND"

    def __init__(self, message, code):
        self.message, self.code = message, code


class FakeResponse:
    def __init__(self, tensors=(), error=None):
        self.tensors, self.error = list(tensors), error


class FakeRequest:
    def __init__(self, inputs: dict, parameters: dict | None = None):
        self.inputs, self.params = inputs, parameters or {}

    def parameters(self):
        return json.dumps(self.params)

    def requested_output_names(self):
        return ["y"]


class FakeMetricFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

    def __init__(self, name, doc, kind):
        self.name = name

    def Metric(self, labels, buckets=None):  # noqa: N802  (the python backend's name)
        return types.SimpleNamespace(set=lambda v: None, increment=lambda v: None, observe=lambda v: None)


class FakeSender:
    """A decoupled request's response sender: what was sent, from which thread."""

    def __init__(self):
        self.sent, self.done = [], threading.Event()

    def send(self, response, flags=0):
        self.sent.append((response, flags, threading.current_thread().name))
        self.done.set()


@pytest.fixture
def pb(monkeypatch):
    module = types.SimpleNamespace(
        TritonError=FakeError, InferenceResponse=FakeResponse, Tensor=lambda name, value: (name, value),
        MetricFamily=FakeMetricFamily, TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        Logger=types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None),
        get_input_tensor_by_name=lambda request, name: (
            types.SimpleNamespace(as_numpy=lambda: request.inputs[name]) if name in request.inputs else None))
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


def model_args(name: str, input_name: str, kind: str = "CPU", device_id: int = 0, **parameters) -> dict:
    config = {"input": [{"name": input_name}], "output": [{"name": "out"}],
              "parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    return {"model_config": json.dumps(config), "model_name": name, "model_version": "1",
            "model_repository": "/nonexistent", "model_instance_kind": kind, "model_instance_device_id": str(device_id)}


@pytest.mark.parametrize("model, input_name, encoder", [("vit", "image", "ImageEncoder"),
                                                        ("clip_vision", "image", "ImageEncoder"),
                                                        ("clip_text", "text", "TextEncoder")])
def test_encoder_instances_run_on_their_own_device(pb, monkeypatch, model, input_name, encoder):
    import backends.mm_encoder.model as mm_encoder

    created = []
    monkeypatch.setattr(mm_encoder, encoder, lambda folder, params, device, *stage: created.append((params, device)))
    gpu = mm_encoder.TritonPythonModel()
    gpu.initialize(model_args(model, input_name, kind="GPU", device_id=1, runtime="torch"))
    cpu = mm_encoder.TritonPythonModel()
    cpu.initialize(model_args(model, input_name, kind="CPU", device="cpu"))
    assert [device for _, device in created] == ["cuda:1", "cpu"]
    assert created[0][0] == EncoderParams(runtime="torch")


def test_an_unknown_parameter_fails_the_load(pb):
    import backends.mm_encoder.model as mm_encoder

    with pytest.raises(ParameterError, match=r"unknown parameter\(s\) \['max_pixel'\]"):
        mm_encoder.TritonPythonModel().initialize(model_args("vit", "image", max_pixel="100"))


class Doubler(BatchedBackend[EncoderParams]):
    """Items are numbers; 'bad' is the client's mistake; 13 breaks the shared engine call."""
    Params = EncoderParams
    calls: list

    def load(self):
        self.calls = []

    def read(self, inputs):
        value = inputs.array("x")
        if value is None:
            raise InvalidInput("x is required")
        return [int(value.reshape(-1)[0])]

    def prepare(self, item):
        if item < 0:
            raise KeyError("/secret/path/weights.bin")
        return item

    def infer(self, batch):
        self.calls.append(len(batch))
        if [13] in batch:
            raise RuntimeError("boom")
        return [2 * items[0] for items in batch]

    def respond(self, output):
        return FakeResponse([("y", output)])


def test_a_failing_request_fails_alone(pb):
    model = Doubler()
    model.initialize(model_args("doubler", "x", prepare_threads="2"))
    requests = [FakeRequest({"x": np.array([1])}), FakeRequest({}), FakeRequest({"x": np.array([13])}),
                FakeRequest({"x": np.array([-1])}), FakeRequest({"x": np.array([4])})]
    responses = model.execute(requests)
    assert responses[0].tensors == [("y", 2)] and responses[4].tensors == [("y", 8)]
    assert (responses[1].error.code, responses[1].error.message) == ("INVALID_ARG", "invalid input: x is required")
    for failed in (responses[2], responses[3]):  # unexpected failures: INTERNAL, no internals in the message
        assert failed.error.code == "INTERNAL" and "doubler failed on this request" in failed.error.message
        assert "secret" not in failed.error.message and "boom" not in failed.error.message
    assert model.calls == [3, 1, 1, 1]  # the shared call failed, then each of its three requests ran alone
    model.finalize()


def test_request_parameters_are_checked_and_faults_injected_only_when_enabled(pb, monkeypatch):
    model = Doubler()
    model.initialize(model_args("doubler", "x"))
    (refused,) = model.execute([FakeRequest({"x": np.array([1])}, {"inject_fault": "infer"})])
    assert refused.error.code == "INVALID_ARG" and "inject_fault" in refused.error.message
    monkeypatch.setenv("MM_FAULT_INJECTION", "1")
    model.initialize(model_args("doubler", "x"))
    for stage in ("read", "prepare", "infer"):
        good, bad = model.execute([FakeRequest({"x": np.array([1])}),
                                   FakeRequest({"x": np.array([2])}, {"inject_fault": stage})])
        assert good.tensors == [("y", 2)] and bad.error.code == "INTERNAL", stage


def test_the_error_policy_names_client_errors_with_their_codes(pb):
    from backends.core.errors import InvalidInput, NotFound, Unavailable

    model = Doubler()
    model.initialize(model_args("doubler", "x"))
    cases = [(InvalidInput("bad x"), "INVALID_ARG", "invalid input: bad x"),
             (NotFound("no adapter 'a'"), "NOT_FOUND", "invalid input: no adapter 'a'"),
             (Unavailable("the cache is full"), "UNAVAILABLE", "the cache is full"),
             (KeyError("/secret/path"), "INTERNAL", "doubler failed on this request (KeyError); the server log has "
                                                    "the details")]
    for exc, code, message in cases:
        assert (model.error(exc).code, model.error(exc).message) == (code, message)
    model.finalize()


@pytest.mark.parametrize("threads", [0, 2])
def test_our_batcher_answers_every_request_once_from_its_responder_threads(pb, threads):
    """batch_window adaptive: each request gets one final response, its own or its error, sent by a responder
    thread (by the batcher's own with response_threads 0); unloading waits for the answers in flight."""
    model = Doubler()
    model.initialize(model_args("doubler", "x", batch_window="adaptive", response_threads=str(threads)))
    requests = [FakeRequest({"x": np.array([value])}) for value in (1, 2, 13, 4)] + [FakeRequest({})]
    senders = [FakeSender() for _ in requests]
    for request, sender in zip(requests, senders):
        request.get_response_sender = lambda sender=sender: sender
    assert model.execute(requests) is None
    for sender in senders:
        assert sender.done.wait(10)
    model.finalize()
    answers = [sender.sent for sender in senders]
    assert all(len(sent) == 1 and sent[0][1] == 1 for sent in answers)  # one final response each
    assert [sent[0][0].tensors for sent in answers[:2] + answers[3:4]] == [[("y", 2)], [("y", 4)], [("y", 8)]]
    assert answers[2][0][0].error.code == "INTERNAL" and answers[4][0][0].error.code == "INVALID_ARG"
    batched = [sent[0][2] for sent in answers[:4]]  # (the invalid one is refused on the calling thread)
    expected = "doubler-respond" if threads else "doubler-batcher"
    assert all(name.startswith(expected) for name in batched), batched


def test_our_batcher_waits_while_two_batches_of_answers_are_unsent(pb):
    """A responder stuck in `send`: the batcher runs at most two batches more (their answers wait), then waits
    itself instead of piling outputs up; once sends go through, every request is answered."""
    model = Doubler()
    model.initialize(model_args("doubler", "x", batch_window="adaptive", response_threads="1"))  # batches of 1
    gate = threading.Event()
    senders = [FakeSender() for _ in range(6)]
    for sender in senders:
        sender.send = lambda response, flags=0, sender=sender: (gate.wait(10), FakeSender.send(sender, response, flags))
    requests = [FakeRequest({"x": np.array([value])}) for value in range(6)]
    for request, sender in zip(requests, senders):
        request.get_response_sender = lambda sender=sender: sender
    model.execute(requests)
    deadline = time.monotonic() + 10
    while len(model.calls) < 3 and time.monotonic() < deadline:  # one answer in send, one waiting, one held
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(model.calls) == 3 and not any(sender.sent for sender in senders)
    gate.set()
    assert all(sender.done.wait(10) for sender in senders)
    assert [sender.sent[0][0].tensors for sender in senders] == [[("y", 2 * value)] for value in range(6)]
    model.finalize()  # (waits for the responders)
    # batcher_answers_total / batcher_answer_seconds_total: the first answer waited out the stuck send (0.3 s and more)
    assert model.answers == 6 and model.answer_seconds >= 0.3
