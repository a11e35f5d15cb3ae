"""The SDK and CLI against a real tritonserver: `llm` over HTTP generate_stream answers exactly as over gRPC
streaming, images reach `vlm`, `anyres` tiles come back through `Client.tile`, and `generate --image` in the CLI."""
from __future__ import annotations

import json
import urllib.request

import pytest
from tritonclient.utils import InferenceServerException

from client.__main__ import main
from client.sdk import Client, server_sent_events
from tests.conftest import encode, random_image

PROMPT = "a photo of the cat"
IMAGE = encode(random_image(64, 48))


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_http_generate_equals_grpc_for_llm(server, stream):
    with Client(server.http_url, "http") as http, Client(server.grpc_url, "grpc") as grpc:
        over_http = list(http.generate(PROMPT, 8, stream=stream, temperature=0.0, min_length=8))
        over_grpc = list(grpc.generate(PROMPT, 8, stream=stream, temperature=0.0, min_length=8))
    # a stream's chunking depends on timing (deltas queued behind a slow send are merged), its text does not
    assert "".join(over_http) == "".join(over_grpc) != ""
    if not stream:
        assert len(over_http) == len(over_grpc) == 1


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_the_last_event_says_why_the_generation_ended(server, stream):
    """A client (and client.sdk) tells a finished stream from one a failed server or a proxy cut short by it."""
    body = {"text_input": PROMPT, "max_tokens": 5, "min_length": 5, "stream": stream}
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{server.http_url}/v2/models/llm/generate_stream", json.dumps(body).encode(),
            {"Content-Type": "application/json"}), timeout=60) as response:
        events = list(server_sent_events(response))
    assert [e.get("finish_reason") for e in events] == [None] * (len(events) - 1) + ["length"], events


def test_http_generate_raises_the_servers_message(server):
    with Client(server.http_url, "http") as client, pytest.raises(InferenceServerException, match="max_tokens"):
        list(client.generate(PROMPT, 0))


def test_generate_with_an_image_over_grpc_answers_from_vlm(server):
    with Client(server.grpc_url, "grpc") as client:
        text = "".join(client.generate("what is in <image> this", 8, image=IMAGE, min_length=8))
    assert text


def test_tile_returns_tiles_and_visual_tokens(server):
    with Client(server.http_url) as client:
        pixels, tokens = client.tile(IMAGE)
    assert pixels.ndim == 4 and pixels.shape[0] >= 2 and pixels.shape[1] == 3
    assert pixels.shape[2] == pixels.shape[3] and tokens > 0


def test_cli_generate_with_an_image(server, tmp_path, capsys):
    path = tmp_path / "photo.png"
    path.write_bytes(IMAGE)
    assert main(["--url", server.grpc_url, "generate", "describe it", "--image", str(path), "--max-tokens", "6",
                 "--stream"]) == 0
    assert capsys.readouterr().out.strip()


def test_cli_tile(server, tmp_path, capsys):
    path = tmp_path / "photo.png"
    path.write_bytes(IMAGE)
    assert main(["--url", server.http_url, "tile", str(path)]) == 0
    assert "visual tokens" in capsys.readouterr().out
