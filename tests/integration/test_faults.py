"""A model's stub process killed under load (issue 21): requests in flight and after fail with an error, not a hang;
the launcher (`python -m backends.server`, the same command `make serve` and the image run) sees the stub gone,
restarts the server, and the model serves again. Triton 2.51 alone never restarts it: the model stays READY and
answers every request with "Stub process ... is not healthy"."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from backends.server import free_port, stub_pids
from tests.conftest import ROOT, build_engines
from tests.integration.test_overload import infer


def test_a_killed_stub_fails_requests_with_an_error_and_the_launcher_brings_the_model_back(vit_checkpoint,
                                                                                            tmp_path):
    repository = tmp_path / "repository"
    assert build_engines(["vit", "--checkpoint", str(vit_checkpoint), "--repository", str(repository)]) == 0
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = ROOT / "logs" / "test-faults.log"
    launcher = subprocess.Popen([sys.executable, "-m", "backends.server", "--repository", str(repository),
                                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 "--log-file", str(log)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    url = f"localhost:{http}"
    try:
        assert "tritonserver ready" in launcher.stdout.readline()
        assert infer(url)[1] is None
        server_pid = int(subprocess.run(["pgrep", "-P", str(launcher.pid), "-x", "tritonserver"],
                                        capture_output=True, text=True).stdout.split()[0])
        (stub,) = stub_pids(server_pid)
        with ThreadPoolExecutor(4) as pool:
            load = [pool.submit(lambda: [infer(url) for _ in range(40)]) for _ in range(4)]
            time.sleep(0.3)
            os.kill(stub, signal.SIGKILL)
            results = [r for f in load for r in f.result(timeout=120)]
        errors = [e for _, e in results if e is not None]
        assert errors, "the stub was killed mid-load; some request must have failed"
        assert max(t for t, _ in results) < 30  # each ended (answered or refused), none hung
        assert "restarting the server" in launcher.stdout.readline()
        assert "ready again" in launcher.stdout.readline()
        assert infer(url)[1] is None  # the model is back
    finally:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(60)
