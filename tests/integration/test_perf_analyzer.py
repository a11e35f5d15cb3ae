"""The real perf_analyzer binary (from the tritonclient 2.50.0 wheel) measures the models with perf/'s real input
data (encoded JPEG/PNG/WebP images of several sizes; texts), over HTTP and gRPC."""
import pytest

from perf.analyzer import run_perf_analyzer
from perf.inputs import model_input_data


@pytest.mark.parametrize("model", ["vit", "clip_vision", "clip_text"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_model(server, model, protocol, tmp_path):
    url = server.http_url if protocol == "http" else server.grpc_url
    points = run_perf_analyzer(model, url, model_input_data(model, tmp_path), tmp_path / "report.csv",
                               concurrency="1:4:3", protocol=protocol, interval_ms=1500)
    assert [p.load for p in points] == [1, 4]
    for point in points:
        assert point.throughput > 0 and point.p99_us >= point.p50_us > 0
        assert point.server_compute_infer_us > 0
