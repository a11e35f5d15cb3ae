"""The deep health check's parts without a server: heartbeats age and go stale, the compute check's known answer,
NVML absent is skipped, an injected failure shows, our batcher beats while idle, and the balancer's active checks."""
from __future__ import annotations

import os
import time

from backends.core.batcher import Batcher, BatchWindow
from backends.core.health import HealthParams, check_compute, check_engines, check_gpu, report
from backends.core.heartbeat import Heartbeat, ages
from tests.conftest import process_alive


def test_a_loop_that_stops_beating_goes_stale(tmp_path):
    beat = Heartbeat("llm", tmp_path)
    assert check_engines(0.2, tmp_path)["ok"]
    time.sleep(0.3)
    stale = check_engines(0.2, tmp_path)
    assert not stale["ok"] and stale["stale"] == [f"llm.{os.getpid()}"]
    beat.beat()
    assert check_engines(0.2, tmp_path)["ok"]
    beat.stop()  # unloaded on purpose: no longer watched
    assert ages(tmp_path) == {}


def test_a_loop_whose_process_is_gone_is_stale(tmp_path):
    (tmp_path / "whisper.999999999").touch()  # no such process
    result = check_engines(60, tmp_path)
    assert not result["ok"] and result["heartbeat_age_s"] == {"whisper.999999999": "process gone"}


def test_the_compute_check_finds_its_known_answer():
    result = check_compute("cpu", 512)
    assert result["ok"] and result["wrong_elements"] == 0 and result["device"] == "cpu"


def test_without_nvml_the_gpu_check_is_skipped_not_failed():
    result = check_gpu(HealthParams())
    assert result["ok"] and ("skipped" in result or "temperature_c" in result)


def test_an_injected_failure_makes_the_report_unhealthy(tmp_path):
    Heartbeat("llm", tmp_path)
    healthy = report(HealthParams(device="cpu"), folder=tmp_path)
    assert healthy["healthy"] and set(healthy["checks"]) == {"compute", "gpu", "engines"}
    failing = report(HealthParams(device="cpu"), "compute", folder=tmp_path)
    assert not failing["healthy"] and failing["checks"]["compute"]["injected"]
    assert failing["checks"]["engines"]["ok"]  # the others still ran and say what they saw


def test_the_batcher_beats_while_idle(tmp_path):
    heartbeat = Heartbeat("vit", tmp_path)
    batcher = Batcher(lambda batch: [None] * len(batch), 4, BatchWindow("fixed", 0.0), heartbeat=heartbeat)
    time.sleep(0.6)
    for _ in range(4):  # an idle loop wakes every IDLE_WAKE_S (0.25 s)
        time.sleep(0.2)
        assert -0.01 < ages(tmp_path)[heartbeat.path.name] < 0.4
    batcher.close()


def test_a_step_announces_twice_the_longest_recent_step(tmp_path):
    heartbeat = Heartbeat("whisper", tmp_path)
    with heartbeat.step():  # the first step has no history: no allowance
        assert ages(tmp_path)[heartbeat.path.name] >= -0.01
        time.sleep(0.3)
    assert 0.3 <= heartbeat.longest_step_s < 0.5
    with heartbeat.step():  # a slow batch again: its file is dated up to 2x the longest step ahead
        age = ages(tmp_path)[heartbeat.path.name]
        assert -2 * heartbeat.longest_step_s - 0.01 < age < -2 * heartbeat.longest_step_s + 0.05
        assert check_engines(0.1, tmp_path)["ok"]
    time.sleep(0.15)  # the step ended, the loop went quiet: stale after the timeout, not after the allowance
    assert not check_engines(0.1, tmp_path)["ok"]


def test_the_balancer_marks_a_failing_server_down_at_once_and_up_after_rise_probes(tmp_path, monkeypatch):
    import client.balancer as balancer

    healthy = {"a:8000": True, "b:8000": True}
    monkeypatch.setattr(balancer, "probe", lambda server, timeout_s: healthy[server])
    monkeypatch.setattr(balancer, "alive", lambda server, timeout_s: True)
    reloads = []
    watcher = balancer.Watcher(list(healthy), tmp_path / "upstream.conf", lambda: reloads.append(1), rise=2)
    assert not watcher.poll() and " down" not in (tmp_path / "upstream.conf").read_text()
    healthy["b:8000"] = False
    assert watcher.poll() and reloads == [1]
    assert "server b:8000 max_fails=1 fail_timeout=10s down;" in (tmp_path / "upstream.conf").read_text()
    healthy["b:8000"] = True
    assert not watcher.poll()  # one healthy probe is not enough to come back
    assert watcher.poll() and " down" not in (tmp_path / "upstream.conf").read_text() and reloads == [1, 1]
    healthy.update({"a:8000": False, "b:8000": False})
    watcher.poll()  # everyone failing: all stay listed, passive checks decide
    assert " down" not in (tmp_path / "upstream.conf").read_text()
    watcher.stop()


def test_the_balancer_takes_a_frozen_server_out_without_waiting_for_its_deep_probe(tmp_path, monkeypatch):
    """A frozen server leaves its deep probe waiting out the long timeout; the quick check's own loop fails it
    first, and the other server's probes go on."""
    import threading

    import client.balancer as balancer

    frozen, thawed = threading.Event(), threading.Event()

    def deep(server: str, timeout_s: float) -> bool:  # b's hangs until its timeout once frozen
        return server == "a:8000" or not frozen.is_set() or thawed.wait(timeout_s)

    monkeypatch.setattr(balancer, "alive", lambda server, timeout_s: not (server == "b:8000" and frozen.is_set()))
    monkeypatch.setattr(balancer, "probe", deep)
    watcher = balancer.Watcher(["a:8000", "b:8000"], tmp_path / "upstream.conf", lambda: None, interval_s=0.01,
                               timeout_s=30.0).start()
    time.sleep(0.1)
    frozen.set()
    froze = time.time()
    deadline = time.monotonic() + 5
    while watcher.healthy["b:8000"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    watcher.stop()
    thawed.set()
    assert watcher.changes[0][0] - froze < 1.0 and watcher.changes[0][1:] == ("b:8000", False), watcher.changes
    assert watcher.healthy["a:8000"] and "server b:8000 max_fails=1 fail_timeout=10s down;" in \
        (tmp_path / "upstream.conf").read_text()


def test_a_loop_whose_server_is_gone_exits(tmp_path):
    """A stub whose tritonserver was killed is re-parented: its next beat ends it instead of leaving it orphaned."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    loop = ("import sys, time; from pathlib import Path; from backends.core.heartbeat import Heartbeat; "
            f"beat = Heartbeat('llm', Path({str(tmp_path)!r}))\nwhile True: beat.beat(); time.sleep(0.02)")
    server = subprocess.Popen(["bash", "-c", 'python -c "$LOOP" & echo $!; wait'], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "LOOP": loop, "PATH": f"{Path(sys.executable).parent}:"
                                              f"{os.environ['PATH']}", "PYTHONPATH": str(Path.cwd())})
    stub = int(server.stdout.readline())
    deadline = time.monotonic() + 30
    while not ages(tmp_path):  # the loop is beating
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.send_signal(signal.SIGKILL)
    server.wait()
    while process_alive(stub):
        assert time.monotonic() < deadline, "the orphaned loop kept running"
        time.sleep(0.05)
    assert ages(tmp_path) == {}  # and it took its heartbeat file with it
