"""The `health` model through a real server: a healthy report that sees every engine loop, the probe CLI's exit
codes, an injected check failure, and a hung `llm` engine loop found by its heartbeat while the rest keeps serving."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from client.health import check
from client.sdk import generation_arrays
from tests.integration.test_backends import generate

TIMEOUT_S = 0.75  # the health model's default heartbeat_timeout_s


def address(server) -> str:
    return server.http_url.removeprefix("http://")


def test_a_healthy_server_reports_every_check_and_its_engine_loops(server):
    status = check(address(server))
    assert status["healthy"], status
    assert status["checks"]["compute"]["wrong_elements"] == 0
    loops = {name.split(".")[0] for name in status["checks"]["engines"]["heartbeat_age_s"]}
    assert {"llm", "vlm", "smollm2"} <= loops, loops
    probe = subprocess.run([sys.executable, "-m", "client.health", "--url", address(server)], capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode == 0 and json.loads(probe.stdout)["healthy"]


def test_the_probe_exits_2_when_nothing_answers():
    probe = subprocess.run([sys.executable, "-m", "client.health", "--url", "127.0.0.1:9", "--timeout", "1"],
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode == 2 and not json.loads(probe.stdout)["healthy"]


@pytest.mark.parametrize("fail", ["compute", "gpu", "engines"])
def test_an_injected_check_failure_is_reported(server, fail):
    client = httpclient.InferenceServerClient(address(server))
    tensor = httpclient.InferInput("fail", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([fail.encode()], dtype=np.object_))
    status = json.loads(client.infer("health", [tensor]).as_numpy("status")[0])
    assert not status["healthy"] and status["checks"][fail]["injected"]
    tensor.set_data_from_numpy(np.array([b"disk"], dtype=np.object_))
    with pytest.raises(Exception, match="is not a check"):
        client.infer("health", [tensor])


def test_a_hung_engine_loop_makes_the_server_unhealthy_until_it_recovers(server):
    answers = []
    stalled = threading.Thread(target=lambda: answers.append(generate(
        server, "llm", generation_arrays("a photo of", 2), {"inject_fault": "stall"})), daemon=True)
    start = time.monotonic()
    stalled.start()
    while (status := check(address(server)))["healthy"]:
        assert time.monotonic() - start < 1.5, "the hung loop was not noticed within 1 s (and a request's trip)"
        time.sleep(0.05)
    noticed = time.monotonic() - start
    assert [s.split(".")[0] for s in status["checks"]["engines"]["stale"]] == ["llm"], status
    assert noticed >= TIMEOUT_S - 0.25  # by its heartbeat's age, not by chance
    print(f"hung llm loop reported unhealthy {noticed:.2f} s after the stalling request was sent")
    assert check(address(server))["checks"]["compute"]["ok"]  # the rest of the server still works
    stalled.join(30)
    assert answers and answers[0][1] is None  # the stalled request itself was answered once the loop went on
    deadline = time.monotonic() + 5
    while not check(address(server))["healthy"]:
        assert time.monotonic() < deadline, "the loop came back but the server stayed unhealthy"
        time.sleep(0.1)
