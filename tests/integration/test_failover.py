"""Two real tritonservers behind a real nginx (perf/failover.py), one killed or hung under a steady load: no
request is lost, nginx stops sending to the failed server within a second (a hung one: with the active checks of
client.balancer), and the LLM streams all end, the ones cut short with an error. nginx is installed by
`make setup`."""
from __future__ import annotations

import pytest

from perf.failover import STREAM_READ_TIMEOUT_S, run, summary


@pytest.mark.parametrize("fault, active", [("kill", False), ("stop", True)], ids=["killed", "hung-active-checks"])
def test_a_failed_server_loses_no_request_and_leaves_the_rotation(repository, tmp_path, fault, active):
    result = run(repository, tmp_path, rate=20, duration_s=5, kill_after_s=2.5, streams=2, stream_tokens=500,
                 fault=fault, active=active)
    figures = summary(result)
    assert figures["requests"] == 100 and figures["failed"] == 0, [o.error for o in result.requests if o.error]
    shown = str(figures)  # whole (pytest shortens a dict); printed, so a failing run's log has them
    print(shown)
    assert figures["last of them sent, s after the fault"] < 1.0, shown
    if active:
        assert figures["active checks took B out, s after the fault"] < 1.0, shown
    # the streams B was serving raise (their last event has no finish_reason); the others finish
    assert figures["streams ended with an error"] == figures["streams on B at the fault"], shown
    assert all(s.end - result.killed_at < STREAM_READ_TIMEOUT_S + 5 for s in result.streams)  # none hangs
