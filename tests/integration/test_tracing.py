"""Tracing through a real server started by the launcher with `--trace-file`: Triton's trace and the LLM engine's
spans of one streamed request, joined by its id into one timeline in a consistent order, and the CLI."""
from __future__ import annotations

import queue
import subprocess
import sys
import time
from functools import partial

import tritonclient.grpc as grpcclient

from backends.core.spans import EVENTS
from backends.server import TritonServer, free_port
from client.sdk import generation_arrays, infer_inputs
from client.timeline import timeline
from tests.conftest import ROOT

def stream_with_id(server: TritonServer, request_id: str) -> int:
    """Streams a generation from `llm` sent with `request_id`; the number of responses."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(partial(lambda q, result, error: q.put((result, error)), answers))
    client.async_stream_infer("llm", infer_inputs(grpcclient, generation_arrays("a photo of", 6)),
                              request_id=request_id, enable_empty_final_response=True)
    responses = 0
    while True:
        result, error = answers.get(timeout=60)
        assert error is None, error
        responses += 1
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    return responses


def test_one_requests_timeline_joins_tritons_trace_and_the_engines_spans(repository, tmp_path):
    trace = tmp_path / "trace.json"
    with TritonServer(repository, free_port(), free_port(), free_port(), ROOT / "logs" / "test-tracing.log",
                      model_control="explicit", load_models=["llm"], trace_file=trace) as server:
        assert stream_with_id(server, "other") >= 2
        responses = stream_with_id(server, "traced-42")
        deadline = time.monotonic() + 20
        while True:  # both are written once the request is over
            try:
                events = timeline(trace, "traced-42")
                if {"REQUEST_START", "finished"} <= {e.name for e in events}:
                    break
            except LookupError:
                pass
            assert time.monotonic() < deadline, "no complete trace of the request"
            time.sleep(0.2)
        cli = subprocess.run([sys.executable, "-m", "client.timeline", str(trace), "--request-id", "traced-42"],
                             capture_output=True, text=True, timeout=60)
        missing = subprocess.run([sys.executable, "-m", "client.timeline", str(trace), "--request-id", "nope"],
                                 capture_output=True, text=True, timeout=60)

    names = [e.name for e in events]
    triton = {e.name: e.ns for e in events if e.source == "triton llm"}
    engine = {e.name: e.ns for e in events if e.source == "engine llm"}
    assert [n for n in names if n in EVENTS] == list(EVENTS), names  # the engine's spans, in order
    assert triton["REQUEST_START"] <= triton["COMPUTE_START"] <= engine["queued"] <= engine["admitted"]
    sends = sorted(e.ns for e in events if e.name == "GRPC_SEND_END")
    assert len(sends) == responses  # one per streamed response, the other request's not mixed in
    assert engine["first_token"] <= sends[0] and engine["finished"] <= sends[-1]
    assert sends[-1] - triton["REQUEST_START"] < 30e9  # one clock: the two sources are seconds apart at most

    assert cli.returncode == 0 and "engine llm" in cli.stdout and "first_token" in cli.stdout, cli.stderr
    assert missing.returncode == 1 and "traced-42" in missing.stderr  # the ids it does know
