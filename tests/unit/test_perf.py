"""perf/: the CSV parser reads what perf_analyzer writes, the report writer produces table, plot and hardware line,
the input data uses Triton's raw BYTES layout."""
import base64
import json
import struct

from perf.analyzer import LoadPoint, parse_csv
from perf.inputs import encoded_images, model_input_data
from perf.report import write_sweep, write_table

# Header and rows as perf_analyzer 2.50 writes them with -f and --verbose-csv (sorted by throughput, not load).
CSV = """Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,\
Avg latency,request/response,response wait
4,37.2655,46,466,38707,454,63524,693,0,104691,128195,144036,167378,106252,512,105740
1,38.2099,60,543,2116,152,22431,211,0,27353,46339,49389,52490,26300,603,25697
"""


def test_parse_csv_sorts_by_load_and_reads_breakdown(tmp_path):
    path = tmp_path / "pa.csv"
    path.write_text(CSV)
    points = parse_csv(path)
    assert [p.load for p in points] == [1, 4]
    assert points[0] == LoadPoint(1.0, 38.2099, 27353, 46339, 52490, 2116, 152, 22431, 211)


def test_parse_csv_reads_request_rate_sweeps(tmp_path):
    path = tmp_path / "pa.csv"
    path.write_text(CSV.replace("Concurrency,", "Request Rate,", 1))
    assert [p.load for p in parse_csv(path)] == [1, 4]


def test_report_writer_makes_table_plot_and_hardware_line(tmp_path):
    points = [LoadPoint(1, 10.0, 1000, 2000, 3000, 100, 10, 800, 10), LoadPoint(4, 30.5, 3000, 5000, 9000, 900, 10,
                                                                                   1800, 10)]
    md = write_sweep(tmp_path, "vit-concurrency", "concurrency", points, "CPU test x2", ["a note"])
    text = md.read_text()
    assert "Hardware: CPU test x2" in text and "| 4 | 30.5 | 3.0 | 5.0 | 9.0 |" in text and "a note" in text
    assert md.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert md.with_suffix(".csv").read_text().splitlines()[2].startswith("4")
    table = write_table(tmp_path, "study", ["a", "b"], [[1, 2.5]], "hw").read_text()
    assert "| 1 | 2.5 |" in table


def test_input_data_is_triton_raw_bytes_layout(tmp_path):
    images = encoded_images()
    data = json.loads(model_input_data("vit", tmp_path).read_text())["data"]
    assert len(data) == len(images) >= 5
    for step, image in zip(data, images):
        raw = base64.b64decode(step["image"]["b64"])
        assert struct.unpack("<I", raw[:4])[0] == len(image) and raw[4:] == image
