"""Overlapped steps served by a real tritonserver: SmolLM2 built with `--overlap-steps true` answers concurrent chat
streams exactly as transformers does, a stop string cuts a stream where it would without overlap, and a stream
cancelled mid-answer leaves the others untouched and the KV cache idle."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from backends.server import TritonServer, free_port
from client.sdk import Client
from tests.conftest import ROOT, build_engines
from tests.integration.test_llm import metric
from tests.integration.test_speculative import QUESTIONS, reference_answers


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_checkpoint):
    repository = tmp_path_factory.mktemp("overlap")
    assert build_engines(["llm", "--checkpoint", str(smollm2_checkpoint), "--name", "smollm2",
                          "--overlap-steps", "true", "--repository", str(repository)]) == 0
    config = (repository / "smollm2" / "config.pbtxt").read_text()
    assert 'string_value: "true"' in config.split('key: "overlap_steps"')[1].split("}")[0]
    with TritonServer(repository, free_port(), free_port(), free_port(),
                      ROOT / "logs" / "test-overlap.log") as running:
        yield running


def test_overlapped_streams_answer_as_transformers_and_stop_and_cancel(server, smollm2_checkpoint):
    prompts, expected = reference_answers(smollm2_checkpoint, QUESTIONS, 40, chat=True)

    def ask(prompt: str, **optional) -> str:
        with Client(server.grpc_url, "grpc") as client:
            return "".join(client.generate(prompt, 40, model="smollm2", **optional))

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == expected
    stop = expected[1][len(expected[1]) // 2:][:4]
    assert ask(prompts[1], stop=[stop]) == expected[1][:expected[1].find(stop)]
    with Client(server.grpc_url, "grpc") as client, ThreadPoolExecutor(1) as pool:
        other = pool.submit(ask, prompts[0])
        stream = client.generate(prompts[3], 40, model="smollm2")
        next(stream)  # the stream is running: leave it mid-answer (the client cancels it)
        stream.close()
        assert other.result() == expected[0]
    idle, deadline = metric(server, "llm_kv_blocks_total", "smollm2"), time.monotonic() + 10
    while metric(server, "llm_kv_blocks_free", "smollm2") != idle and time.monotonic() < deadline:
        time.sleep(0.1)  # (the gauges are set between steps)
    assert metric(server, "llm_kv_blocks_free", "smollm2") == idle
