"""Two real tritonservers behind a real nginx (perf/failover.py), one killed under a steady load: no request is
lost, nginx stops sending to the dead server within a second, and the LLM streams all end (none hangs). nginx is
installed by `make setup`."""
from __future__ import annotations

from perf.failover import run, summary


def test_a_killed_server_loses_no_request_and_leaves_the_rotation(repository, tmp_path):
    result = run(repository, tmp_path, rate=20, duration_s=5, kill_after_s=2.5, streams=2, stream_tokens=200)
    figures = summary(result)
    assert figures["requests"] == 100 and figures["failed"] == 0, [o.error for o in result.requests if o.error]
    assert figures["last of them ended, s after the fault"] < 1.0
    assert all(s.end - result.killed_at < 30 for s in result.streams)  # every stream ended; none hangs
