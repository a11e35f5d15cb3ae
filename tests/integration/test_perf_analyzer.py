"""The real perf_analyzer binary (from the tritonclient 2.50.0 wheel) measures vit and clip_vision with real
encoded images as input data (perf_analyzer's JSON format, base64 BYTES)."""
import base64
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from build_engines.repository import serialize_bytes_tensor
from tests.conftest import encode, random_image

PERF_ANALYZER = Path(sys.prefix) / "bin" / "perf_analyzer"


def image_input_data(path: Path) -> Path:
    """Several sizes, aspect ratios and formats, as perf_analyzer --input-data JSON."""
    images = [encode(random_image(w, h, seed=i), fmt) for i, (w, h, fmt) in
              enumerate([(224, 224, "JPEG"), (640, 480, "JPEG"), (1024, 768, "PNG"), (300, 900, "WEBP")])]
    # b64 content of a BYTES input is Triton's raw layout: a 4-byte length prefix per element
    data = [{"image": {"b64": base64.b64encode(serialize_bytes_tensor([image])).decode(), "shape": [1]}}
            for image in images]
    path.write_text(json.dumps({"data": data}))
    return path


@pytest.mark.parametrize("model", ["vit", "clip_vision"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_measures_model(server, model, protocol, tmp_path):
    url = server.http_url if protocol == "http" else server.grpc_url
    report = tmp_path / "report.csv"
    cmd = [str(PERF_ANALYZER), "-m", model, "-u", url, "-i", protocol,
           "--input-data", str(image_input_data(tmp_path / "images.json")),
           "--concurrency-range", "1:4:3", "--measurement-interval", "1500",
           "--stability-percentage", "100", "--max-trials", "6", "--percentile=99", "-f", str(report), "--verbose-csv"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = list(csv.DictReader(report.open()))
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 4], run.stdout + run.stderr
    for row in rows:
        assert float(row["Inferences/Second"]) > 0
        assert int(row["p99 latency"]) > 0
