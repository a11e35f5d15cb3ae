"""The client SDK and CLI without a tritonserver: default URLs from the `make serve` port variables, one-line CLI
errors, request building, and HTTP generate_stream (Server-Sent Events) against a canned local HTTP server."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

import client.__main__ as cli
from backends.server import free_port
from client.sdk import (
    Client,
    default_url,
    generate_request_body,
    generated_texts,
    generation_arrays,
    http_error_message,
    server_sent_events,
)

ROOT = Path(__file__).resolve().parents[2]


# --- default URLs ---------------------------------------------------------------------------------------------

@pytest.fixture
def no_port_env(monkeypatch):
    monkeypatch.delenv("HTTP_PORT", raising=False)
    monkeypatch.delenv("GRPC_PORT", raising=False)


def test_default_urls_are_tritons_ports_without_env(no_port_env):
    assert default_url("http") == "localhost:8000" and default_url("grpc") == "localhost:8001"


def test_default_urls_follow_make_serve_port_variables(monkeypatch):
    monkeypatch.setenv("HTTP_PORT", "18000")
    monkeypatch.setenv("GRPC_PORT", "18001")
    assert default_url("http") == "localhost:18000" and default_url("grpc") == "localhost:18001"
    with Client() as http_client, Client(protocol="grpc") as grpc_client:
        assert (http_client.url, grpc_client.url) == ("localhost:18000", "localhost:18001")


def test_unknown_protocol_is_refused():
    with pytest.raises(ValueError, match="http or grpc"):
        Client("localhost:1", protocol="ws")


class FakeClient:
    """Stands in for client.sdk.Client in the CLI: records where it would connect and what it was asked."""

    made: list[FakeClient] = []

    def __init__(self, url: str, protocol: str):
        self.url, self.protocol, self.calls = url, protocol, []
        FakeClient.made.append(self)

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def classify(self, images, top_k):
        self.calls.append(("classify", images, top_k))
        return [[] for _ in images]

    def generate(self, prompt, max_tokens, **kwargs):
        self.calls.append(("generate", prompt, max_tokens, kwargs))
        return iter(["a ", "cat"])

    def tile(self, image):
        self.calls.append(("tile", image))
        return np.zeros((5, 3, 336, 336), dtype=np.float32), 2928


@pytest.fixture
def fake_client(monkeypatch):
    FakeClient.made = []
    monkeypatch.setattr(cli, "Client", FakeClient)
    return FakeClient.made


@pytest.fixture
def image_file(tmp_path) -> Path:
    path = tmp_path / "x.png"
    path.write_bytes(b"\x89PNG not really")
    return path


@pytest.mark.parametrize("argv, env, expected", [
    (["classify", "IMG"], {}, ("localhost:8000", "http")),
    (["classify", "IMG"], {"HTTP_PORT": "18000", "GRPC_PORT": "18001"}, ("localhost:18000", "http")),
    (["generate", "hi"], {"HTTP_PORT": "18000", "GRPC_PORT": "18001"}, ("localhost:18001", "grpc")),
    (["--protocol", "http", "generate", "hi"], {"HTTP_PORT": "18000"}, ("localhost:18000", "http")),
    (["--protocol", "grpc", "tile", "IMG"], {"GRPC_PORT": "18001"}, ("localhost:18001", "grpc")),
    (["--url", "gpu-box:9000", "classify", "IMG"], {"HTTP_PORT": "18000"}, ("gpu-box:9000", "http")),
    (["--url", "gpu-box:9001", "generate", "hi"], {"GRPC_PORT": "18001"}, ("gpu-box:9001", "grpc")),
], ids=["defaults", "http env", "generate grpc env", "generate http env", "grpc env", "url wins", "url wins grpc"])
def test_cli_connects_to_env_port_unless_url_given(no_port_env, monkeypatch, fake_client, image_file, argv, env,
                                                    expected, capsys):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main([str(image_file) if a == "IMG" else a for a in argv]) == 0
    assert [(c.url, c.protocol) for c in fake_client] == [expected]


def test_help_names_url_and_port_variables(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "--url" in out and "HTTP_PORT" in out and "GRPC_PORT" in out


# --- argument parsing and the new commands ---------------------------------------------------------------------

def test_generate_image_and_model_options_parse():
    args = cli.build_parser().parse_args(["generate", "what is this", "--image", "a.png", "--stream"])
    assert (args.command, args.prompt, args.image, args.model, args.stream) == (
        "generate", "what is this", Path("a.png"), None, True)
    args = cli.build_parser().parse_args(["generate", "hi", "--model", "llm_big", "--stop", ".", "--stop", "!"])
    assert (args.image, args.model, args.stop) == (None, "llm_big", [".", "!"])
    assert cli.build_parser().parse_args(["tile", "a.png"]).image == Path("a.png")


@pytest.mark.parametrize("argv", [["tile"], ["generate"], ["generate", "hi", "--image"], ["nope"]])
def test_usage_errors_stay_argparse_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and "usage:" in capsys.readouterr().err


def test_generate_sends_image_bytes_and_model(fake_client, image_file, capsys):
    assert cli.main(["generate", "what is this", "--image", str(image_file), "--max-tokens", "5",
                     "--model", "vlm2", "--seed", "3", "--qos-class", "high"]) == 0
    (_, prompt, max_tokens, kwargs), = fake_client[0].calls
    assert (prompt, max_tokens) == ("what is this", 5)
    assert kwargs == {"stream": False, "model": "vlm2", "image": image_file.read_bytes(), "seed": 3,
                      "qos_class": "high"}
    assert capsys.readouterr().out == "a cat\n"


def test_tile_prints_tiles_size_and_tokens(fake_client, image_file, capsys):
    assert cli.main(["tile", str(image_file)]) == 0
    assert fake_client[0].calls == [("tile", image_file.read_bytes())]
    assert capsys.readouterr().out == f"{image_file}: 5 tiles of 336x336 pixels, 2928 visual tokens\n"


# --- one-line errors --------------------------------------------------------------------------------------------

def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, so anything written to stderr (Python or gRPC's C core) is seen."""
    return subprocess.run([sys.executable, "-m", "client", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def assert_one_error_line(result: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = result.stderr.splitlines()
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, variable", [
    (["classify", "IMG"], "HTTP_PORT"), (["--protocol", "grpc", "classify", "IMG"], "GRPC_PORT"),
    (["generate", "hi", "--stream"], "GRPC_PORT"), (["--protocol", "http", "generate", "hi"], "HTTP_PORT"),
    (["generate", "hi", "--image", "IMG"], "GRPC_PORT"), (["tile", "IMG"], "HTTP_PORT"),
], ids=["http", "grpc", "generate grpc", "generate http", "generate image", "tile"])
def test_refused_connection_is_one_line_naming_the_url(image_file, argv, variable):
    port = free_port()  # bound and closed again: nothing listens there
    argv = [str(image_file) if a == "IMG" else a for a in argv]
    result = run_cli(*argv, env={"HTTP_PORT": str(port), "GRPC_PORT": str(port)})
    assert_one_error_line(result, f"localhost:{port}", "not reachable", variable, "--url")


def test_refused_connection_with_url_names_that_url(image_file):
    url = f"127.0.0.1:{free_port()}"
    assert_one_error_line(run_cli("--url", url, "classify", str(image_file)), url, "not reachable")


def test_missing_input_file_is_one_line(tmp_path):
    missing = tmp_path / "missing.jpg"
    assert_one_error_line(run_cli("--url", f"127.0.0.1:{free_port()}", "classify", str(missing)), str(missing))


def test_http_generate_with_image_is_one_line_pointing_at_grpc(image_file):
    result = run_cli("--protocol", "http", "--url", f"127.0.0.1:{free_port()}", "generate", "hi", "--image",
                     str(image_file))
    assert_one_error_line(result, "grpc")


def test_server_error_message_is_flattened_to_one_line():
    error = InferenceServerException("image is empty\n  (input 'image')", status="StatusCode.INVALID_ARGUMENT")
    assert cli.describe(error, "localhost:8001", "grpc") == "image is empty (input 'image')"


def test_grpc_generate_reports_the_connect_failure_not_the_stream_state():
    """The stream's callback and async_stream_infer race when nothing listens; the reason must win every time."""
    with Client(f"127.0.0.1:{free_port()}", "grpc") as client:
        for _ in range(3):
            with pytest.raises(InferenceServerException, match="failed to connect"):
                list(client.generate("hi", 4))


# --- request building -------------------------------------------------------------------------------------------

def test_generation_arrays_are_unbatched_and_carry_the_image():
    arrays = generation_arrays("hi", 8, True, b"\x89PNG", temperature=0.5, seed=7, stop=[".", "!"])
    assert {name: (a.shape, a.dtype.str) for name, a in arrays.items()} == {
        "text_input": ((1,), "|O"), "max_tokens": ((1,), "<i4"), "stream": ((1,), "|b1"), "image": ((1,), "|O"),
        "temperature": ((1,), "<f4"), "seed": ((1,), "<i8"), "stop": ((2,), "|O")}
    assert arrays["image"][0] == b"\x89PNG"
    with pytest.raises(ValueError, match="unknown generation input 'beam'"):
        generation_arrays("hi", 8, beam=2)


def test_generate_body_is_json_scalars_and_a_stop_list():
    body = generate_request_body(generation_arrays("héllo", 16, False, top_k=1, top_p=0.5, stop=["."]))
    assert body == {"text_input": "héllo", "max_tokens": 16, "stream": False, "top_k": 1, "top_p": 0.5, "stop": ["."]}
    assert json.loads(json.dumps(body)) == body


def test_http_generate_with_image_refuses_before_sending():
    with Client(f"127.0.0.1:{free_port()}", "http") as client, pytest.raises(ValueError, match="grpc"):
        client.generate("hi", 4, image=b"\x89PNG")


# --- Server-Sent Events -----------------------------------------------------------------------------------------

def events(raw: bytes) -> list[dict]:
    return list(server_sent_events(io.BytesIO(raw)))


def test_sse_events_split_on_blank_lines_and_join_data_lines():
    raw = (b'data: {"text_output": "He"}\n\n'
           b': a comment\r\nevent: message\r\ndata: {"text_output":\r\ndata: "llo"}\r\n\r\n'
           b'data:{"text_output": "!"}')  # no space after the colon, no blank line at the end
    assert events(raw) == [{"text_output": "He"}, {"text_output": "llo"}, {"text_output": "!"}]


def test_sse_events_keep_multibyte_text():
    assert events('data: {"text_output": "ü→猫"}\n\n'.encode()) == [{"text_output": "ü→猫"}]


def test_generated_texts_skip_empty_outputs_and_join_lists():
    stream = [{"model_name": "llm", "text_output": "a"}, {"text_output": ""}, {"model_name": "llm"},
              {"text_output": ["b", "c"]}]
    assert list(generated_texts(stream)) == ["a", "bc"]


def test_error_event_raises_with_the_servers_message_after_earlier_deltas():
    texts = generated_texts(server_sent_events(io.BytesIO(
        b'data: {"text_output": "ok"}\n\ndata: {"error": "max_tokens must be >= 1"}\n\n')))
    assert next(texts) == "ok"
    with pytest.raises(InferenceServerException, match="max_tokens must be >= 1"):
        next(texts)


def test_a_generation_cut_before_its_finish_reason_raises():
    whole = [{"text_output": "a"}, {"text_output": "b", "finish_reason": ["length"]}]
    assert list(generated_texts(whole, until_finished=True)) == ["a", "b"]
    texts = generated_texts(whole[:1], until_finished=True)
    assert next(texts) == "a"
    with pytest.raises(InferenceServerException, match="cut"):
        next(texts)
    assert list(generated_texts(whole[:1])) == ["a"]  # answers (adapter actions) end without one


def test_http_error_message_prefers_the_json_error():
    assert http_error_message(400, "Bad Request", b'{"error": "unknown model"}') == "unknown model"
    assert http_error_message(502, "Bad Gateway", b"<html>up</html>") == "HTTP 502 Bad Gateway: <html>up</html>"
    assert http_error_message(500, "Internal Server Error", b"") == "HTTP 500 Internal Server Error"


# --- HTTP generate_stream against a canned server ---------------------------------------------------------------

class CannedTriton(BaseHTTPRequestHandler):
    """Answers /v2/models/<name>/generate_stream like Triton 2.51: chunked SSE, or a JSON error status."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []
    released = threading.Event()  # the client has the first delta; without it the test would stall here
    released_in_time: list[bool] = []

    def do_POST(self) -> None:
        CannedTriton.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        model = self.path.split("/")[3]
        if model == "llm":
            self.start_events()
            self.chunk(b'data: {"model_name":"llm","model_version":"1","text_output":"Hello"}\n\n')
            CannedTriton.released_in_time.append(CannedTriton.released.wait(10))
            self.chunk(b'data: {"model_name":"llm","model_version":"1","text_output":" world"}\n\n')
            self.chunk(b'data: {"model_name":"llm","model_version":"1","text_output":"","finish_reason":"stop"}\n\n')
            self.chunk(b"")
        elif model == "broken":
            self.start_events()
            self.chunk(b'data: {"text_output":"partial"}\n\ndata: {"error":"in-flight failure: out of memory"}\n\n')
            self.chunk(b"")
        elif model == "html":
            self.send_error(503, "Service Unavailable")
        else:
            body = json.dumps({"error": f"Request for unknown model: '{model}' is not found"}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def log_message(self, *args) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that hangs up after an error event makes the last write fail: normal, not worth a stderr
        report (which would land in the captured output the tests check)."""


@pytest.fixture
def canned_url():
    CannedTriton.bodies, CannedTriton.released_in_time = [], []
    CannedTriton.released.set()
    server = QuietServer(("127.0.0.1", 0), CannedTriton)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    CannedTriton.released.set()
    server.shutdown()
    server.server_close()


def test_http_generate_yields_each_delta_as_it_arrives(canned_url):
    CannedTriton.released.clear()
    with Client(canned_url, "http") as client:
        deltas = client.generate("hi", 8, temperature=0.5, stop=["."])
        first = next(deltas)
        CannedTriton.released.set()
        assert [first, *deltas] == ["Hello", " world"]
    assert CannedTriton.released_in_time == [True]
    assert CannedTriton.bodies == [{"text_input": "hi", "max_tokens": 8, "stream": True, "temperature": 0.5,
                                    "stop": ["."]}]


def test_http_generate_error_event_raises(canned_url):
    with Client(canned_url, "http") as client:
        deltas = client.generate("hi", 8, model="broken")
        assert next(deltas) == "partial"
        with pytest.raises(InferenceServerException, match="in-flight failure: out of memory"):
            next(deltas)


@pytest.mark.parametrize("model, message", [("nope", "Request for unknown model: 'nope' is not found"),
                                            ("html", "HTTP 503")])
def test_http_generate_error_status_raises_the_servers_message(canned_url, model, message):
    with Client(canned_url, "http") as client, pytest.raises(InferenceServerException) as error:
        list(client.generate("hi", 8, model=model))
    assert message in error.value.message()


def test_cli_generates_over_http(canned_url, capsys):
    assert cli.main(["--protocol", "http", "--url", canned_url, "generate", "hi", "--stream", "--stop", "."]) == 0
    assert capsys.readouterr().out == "Hello world\n"
    assert CannedTriton.bodies[0]["stream"] is True and CannedTriton.bodies[0]["stop"] == ["."]


def test_cli_server_error_is_one_line(canned_url, capsys):
    assert cli.main(["--protocol", "http", "--url", canned_url, "generate", "hi", "--model", "nope"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "error: Request for unknown model: 'nope' is not found\n"


def test_cli_error_midway_ends_the_output_line(canned_url, capsys):
    assert cli.main(["--protocol", "http", "--url", canned_url, "generate", "hi", "--model", "broken"]) == 1
    out, err = capsys.readouterr()
    assert out == "partial\n" and err == "error: in-flight failure: out of memory\n"
