"""A real Prometheus (the Debian package, installed by `make setup`) scrapes the test server: Triton's series and
ours (engine gauges and counters, QoS, the request-level histograms) are queryable through its API, with the
values the server shows."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from backends.server import free_port
from client.sdk import generation_arrays
from tests.integration.test_backends import generate

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus")
    target = server.metrics_url.removeprefix("http://").split("/")[0]
    (folder / "prometheus.yml").write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "triton", "static_configs": [{"targets": [target]}]}]}))
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen([PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
                                f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address={address}"],
                               stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "wb"))
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://{address}/-/ready", timeout=1).read()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, (folder / "prometheus.log").read_text()
            time.sleep(0.2)
    yield address
    process.terminate()
    process.wait(10)


def query(address: str, promql: str) -> dict[str, float]:
    """model label -> value of an instant query."""
    url = f"http://{address}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    body = json.loads(urllib.request.urlopen(url, timeout=5).read())
    assert body["status"] == "success", body
    return {r["metric"].get("model", ""): float(r["value"][1]) for r in body["data"]["result"]}


def eventually(address: str, promql: str, check, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while not check(result := query(address, promql)):
        assert time.monotonic() < deadline, f"{promql}: {result}"
        time.sleep(0.5)
    return result


def test_prometheus_scrapes_our_series_and_tritons(server, prometheus):
    for _ in range(3):
        text, error = generate(server, "llm", generation_arrays("a photo of", 8, temperature=0.0))
        assert error is None
    eventually(prometheus, 'up{job="triton"}', lambda r: r and all(v == 1 for v in r.values()))
    eventually(prometheus, 'nv_inference_count{model="llm"}', lambda r: r.get("llm", 0) >= 3)
    # the request-level histograms: every one of our requests observed, with buckets, count and sum
    counts = eventually(prometheus, 'sum by (model) (llm_time_to_first_token_seconds_count{model="llm"})',
                        lambda r: r.get("llm", 0) >= 3)
    assert query(prometheus, 'sum by (model) (llm_output_tokens_count{model="llm"})')["llm"] == counts["llm"]
    assert query(prometheus, 'sum by (model) (llm_output_tokens_sum{model="llm"})')["llm"] >= counts["llm"]
    p50 = query(prometheus, 'histogram_quantile(0.5, sum by (le, model) '
                            '(llm_time_to_first_token_seconds_bucket{model="llm"}))')
    assert 0 < p50["llm"] < 60
    assert query(prometheus, 'sum by (model) (llm_inter_token_latency_seconds_count{model="llm"})')["llm"] >= 3
    # engine gauges and counters, QoS: present for every LLM model the server runs
    for series in ("llm_kv_blocks_free", "llm_generated_tokens_total", "qos_admitted_total"):
        models = eventually(prometheus, f"sum by (model) ({series})", lambda r: {"llm", "smollm2"} <= set(r))
        assert all(v >= 0 for v in models.values())
