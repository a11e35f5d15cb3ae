"""perf/: the CSV parser reads what perf_analyzer writes, the report writer produces table, plot and hardware line,
the input data uses Triton's raw BYTES layout."""
import argparse
import base64
import csv
import io
import json
import struct

import numpy as np
import pytest
import torch

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
    assert points[0] == LoadPoint(1.0, 38.2099, 27353, 46339, 52490, 2116, 152, 22431, 211, 60, 543, 0)


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


def test_summarize_uses_genai_perf_definitions():
    from perf.llm import StreamTiming, summarize

    # two requests: first token 20 ms after sending, then a token every 5 ms
    timings = [StreamTiming(t0, [t0 + 0.020 + 0.005 * i for i in range(n)], "x" * n) for t0, n in ((0.0, 11), (0.1, 3))]
    m = summarize(timings)
    assert m["ttft_ms_p50"] == pytest.approx(20)
    assert m["itl_ms_p99"] == pytest.approx(5)
    assert m["latency_ms_p50"] == pytest.approx((70 + 30) / 2)
    assert m["output_tokens_per_s"] == pytest.approx(14 / 0.130)  # all tokens / (last arrival - first send)
    assert summarize(timings, count_tokens=lambda text: 2 * len(text))["output_tokens_mean"] == 14


def test_summarize_counts_a_forced_length_where_the_request_ended_for_length():
    from perf.llm import StreamTiming, summarize

    # random weights over a byte-level vocabulary: 4 tokens whose text re-tokenises as 12 ("\ufffd" is 3 bytes)
    timings = [StreamTiming(0.0, [0.01 * (i + 1) for i in range(4)], "\ufffd" * 4, finish_reason=reason)
               for reason in ("length", "stop")]
    count = lambda text: len(text.encode())  # noqa: E731  (a byte-level tokenizer)
    assert summarize(timings, count, forced_tokens=4)["output_tokens_mean"] == (4 + 12) / 2
    assert summarize(timings, count)["output_tokens_mean"] == 12


def test_summarize_refuses_failed_requests():
    from perf.llm import StreamTiming, summarize

    with pytest.raises(RuntimeError, match="1 of 2 requests failed"):
        summarize([StreamTiming(0.0, [0.1], "a"), StreamTiming(0.0, [], "", error="boom")])


def test_genai_perf_export_maps_to_our_keys(tmp_path):
    from perf.genai_perf import read_export

    stat = {"unit": "ms", "avg": 1.0, "p50": 2.0, "p90": 3.0, "p99": 4.0}
    export = {"time_to_first_token": stat, "inter_token_latency": {**stat, "p50": 5.0}, "request_latency": stat,
              "output_token_throughput": {"avg": 100.0}, "request_throughput": {"avg": 2.0},
              "output_sequence_length": {"avg": 64.0}}
    (tmp_path / "e.json").write_text(json.dumps(export))
    m = read_export(tmp_path / "e.json")
    assert (m["ttft_ms_p99"], m["itl_ms_p50"], m["output_tokens_per_s"]) == (4.0, 5.0, 100.0)


def test_prompts_have_the_requested_token_count():
    from build_engines.checkpoints import byte_level_tokenizer
    from perf.llm import make_prompts

    tok = byte_level_tokenizer(["cat", "the"])
    prompts = make_prompts(5, 40, lambda t: tok.encode(t, add_special_tokens=False), tok.decode)
    assert [len(tok.encode(p, add_special_tokens=False)) for p in prompts] == [40] * 5
    assert len(set(prompts)) == 5


def test_report_shows_gpu_utilisation_when_measured(tmp_path):
    points = [LoadPoint(1, 10.0, 1000, 2000, 3000, 100, 10, 800, 10, gpu_util=0.42)]
    text = write_sweep(tmp_path, "gpu", "concurrency", points, "hw").read_text()
    assert "GPU util % |" in text and text.splitlines()[6].endswith("| 42 |")


def test_gpu_utilisation_is_read_from_server_metrics():
    import http.server
    import threading

    from perf.gpu import GpuUtilization, server_gpu_utilization

    metrics = b'# TYPE nv_gpu_utilization gauge\nnv_gpu_utilization{gpu_uuid="GPU-a"} 0.5\n' \
              b'nv_gpu_utilization{gpu_uuid="GPU-b"} 0.7\nnv_gpu_power_usage{gpu_uuid="GPU-a"} 300\n'

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(metrics)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        assert server_gpu_utilization(url) == pytest.approx(0.6)
        with GpuUtilization(url, period_s=0.01) as gpu:
            import time
            time.sleep(0.1)
        assert gpu.source.startswith("server metrics") and gpu.mean == pytest.approx(0.6)
    finally:
        server.shutdown()
    assert server_gpu_utilization("http://127.0.0.1:9/metrics") is None  # nothing listening


def test_metrics_watch_counts_only_while_the_model_answered():
    """perf_analyzer's start-up (reading its input data) and wind-down are idle time the engine's means leave out:
    from the last reading before the first answer to the first after the last."""
    from perf.server_metrics import MetricsWatch

    watch = MetricsWatch("unused", "m")
    done, busy = "qos_request_seconds_count", "whisper_clips_running"
    watch.readings = [(t, {done: d, busy: b}) for t, d, b in
                      [(0, 5, 0), (1, 5, 0), (2, 5, 8), (3, 9, 8), (4, 13, 8), (5, 15, 0), (6, 15, 0)]]
    assert watch.seconds == 3 and watch.growth[done] == 10  # readings at 2 to 5 s
    assert watch.mean[busy] == 6
    watch.readings = [(t, {done: 5, busy: 1}) for t in range(3)]  # nothing answered: the whole watch
    assert watch.seconds == 2 and watch.mean[busy] == 1
    # with `until`, the span ends at the first reading after the last start: the drain after it is left out
    started = "qos_admitted_total"
    watch = MetricsWatch("unused", "m", until=started)
    watch.readings = [(t, {done: d, started: s, busy: b}) for t, d, s, b in
                      [(0, 0, 0, 0), (1, 0, 8, 8), (2, 4, 12, 8), (3, 8, 16, 8), (4, 12, 16, 4), (5, 16, 16, 0)]]
    assert watch.seconds == 2 and watch.growth[done] == 8 and watch.mean[busy] == 8  # readings at 1 to 3 s
    watch.until = "not_served"  # a model without that counter: to the first reading after the last answer
    assert watch.seconds == 4


def test_whisper_bench_inputs_are_real_audio_with_their_token_budget(tmp_path):
    import base64
    import json

    from backends.media.audio import decode_audio
    from perf.whisper_bench import CLIPS, clips, write_input_data

    items = clips()
    data = json.loads(write_input_data(tmp_path / "w.json", items).read_text())["data"]
    assert [step["max_tokens"] for step in data] == [{"content": [n], "shape": [1]} for _, n in CLIPS]
    for step, (seconds, _) in zip(data, CLIPS):
        raw = base64.b64decode(step["audio"]["b64"])
        assert int.from_bytes(raw[:4], "little") == len(raw) - 4  # Triton's BYTES layout: length, then the file
        assert len(decode_audio(raw[4:])) == int(seconds * 16000)
        assert base64.b64decode(step["language"]["b64"])[4:] == b"en"


def test_prefill_bench_compares_chunked_and_whole_prefill_and_prefix_caching(tmp_path):
    from perf.llm_prefill import main

    assert main(["--streams", "3", "--long-prompts", "2", "--long-tokens", "100", "--arrival-steps", "2",
                 "--suffix-tokens", "8", "--chunk-tokens", "24", "--results", str(tmp_path), "--host", "t"]) == 0
    chunked = (tmp_path / "t").glob("*-llm-chunked-prefill.csv")
    rows = next(chunked).read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("chunked prefill (24 tokens a step),")
    prefix = next((tmp_path / "t").glob("*-llm-prefix-cache.csv")).read_text().splitlines()
    assert [r.split(",")[0] for r in prefix[1:]] == ["prefix caching on", "prefix caching off"]


def test_engine_host_bench_times_both_detokenisers_and_restores_the_engines(tmp_path):
    import backends.llm.detokenizer as detokenizer
    from perf.engine_host import main

    real = detokenizer.text_of
    assert main(["--batches", "1", "4", "--tokens", "6", "--rounds", "1", "--results", str(tmp_path),
                 "--host", "t"]) == 0
    rows = list(csv.reader(next((tmp_path / "t").glob("*-engine-host.csv")).open()))
    assert [r[0] for r in rows[1:]] == [f"host ms a decode step, {n} sequences" for n in (1, 4)]
    assert all(float(v) > 0 for r in rows[1:] for v in r[1:])
    assert detokenizer.text_of is real


def test_speculative_bench_by_construction_and_on_a_trained_model(tmp_path, smollm2_checkpoint):
    from perf.speculative import main

    assert main(["--random-init", "tiny", "--device", "cpu", "--dtype", "fp32", "--output-tokens", "12",
                 "--input-tokens", "8", "--batches", "1", "2", "--rates", "1.0", "--results", str(tmp_path),
                 "--host", "t"]) == 0
    rows = next((tmp_path / "t").glob("*-speculative-tiny.csv")).read_text().splitlines()
    assert [r.split(",")[:3] for r in rows[1:3]] == [["1", "none", ""], ["1", "1.0", "1.00"]]  # all accepted
    assert len(rows) == 5
    assert main(["--checkpoint", str(smollm2_checkpoint), "--draft", str(smollm2_checkpoint), "--device", "cpu",
                 "--dtype", "fp32", "--requests", "2", "--output-tokens", "8", "--results", str(tmp_path),
                 "--host", "t"]) == 0
    table = next((tmp_path / "t").glob("*-speculative-pretrained-smollm2.csv")).read_text().splitlines()
    own = [r.split(",") for r in table[1:] if "draft pretrained-smollm2" in r]
    assert len(table) == 1 + 2 * 2 * 3 and len(own) == 4
    assert all(r[5] == "1.00" and r[-1] in ("2/2", "4/4") for r in own)  # the model as its own draft: all accepted


def test_overload_memory_watch_sums_a_process_and_its_children():
    import os
    import subprocess
    import sys
    import time

    from perf.overload import MemoryWatch

    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(30)"])
    try:
        with MemoryWatch(os.getpid(), period_s=0.05) as watch:
            own = watch.root.memory_info().rss / 2**20
            start, deadline = time.perf_counter(), time.perf_counter() + 20
            while watch.now() - own < 190 and time.perf_counter() < deadline:  # the child touches its 200 MB
                time.sleep(0.05)
            time.sleep(0.2)
        assert watch.peak(start, time.perf_counter()) - own >= 190
    finally:
        child.kill()
        child.wait()


def test_engine_comparison_profiles_decode_steps_by_kind(tmp_path):
    from perf.llm_engine import main
    from perf.step_profile import category

    assert category("sm90_xmma_gemm_bf16bf16") == category("nvjet_tst_128x64") == "library GEMM (cuBLAS, CUTLASS)"
    assert category("_gemv_kernel") == "GEMV (gemv.py)" and category("triton_poi_fused_mul_silu_0").startswith("comp")
    assert category("void at::native::unrolled_elementwise") == "elementwise (aten)"
    assert category("sm90_xmma_fprop_implicit_gemm_f16") == category("regular_fft") == "convolution, FFT (cuDNN, cuFFT)"
    assert category("void at::native::vectorized_layer_norm_kernel") == "normalisation, softmax (aten)"
    assert category("cudaLaunchKernel") == "other"
    assert category("_rope_write_kernel") == "rotary + cache write (rope_cache.py)"
    assert main(["--variants", "bf16:gather:library", "--device", "cpu", "--concurrency", "4", "--input-tokens", "8",
                 "--output-tokens", "4", "--batch1-tokens", "4", "--profile-rows", "1", "4", "--results",
                 str(tmp_path), "--host", "t"]) == 0
    rows = {r[0]: r[1:] for r in csv.reader(next((tmp_path / "t").glob("*-llm-engine.csv")).open())}
    for n in (1, 4):
        wall = float(rows[f"decode step of {n} rows under the profiler, ms"][0])
        kernels = float(rows[f"its kernels' time at {n} rows, ms (by kind in the notes)"][0])
        assert 0 < kernels < wall
    table = next((tmp_path / "t").glob("*-llm-engine.md")).read_text()
    assert "decode steps of 4 rows under the profiler" in table
    assert "library GEMM (cuBLAS, CUTLASS)" in table and "attention, library (SDPA, flash)" in table  # by kind


def test_device_timeline_counts_overlapping_kernels_once_and_finds_the_gaps():
    from perf.step_profile import GAP_US, device_timeline

    # overlapping spans count once; a kernel inside a would-be gap splits it into two short ones
    busy, gaps = device_timeline([(0, 10), (5, 12), (12 + GAP_US, 40 + GAP_US), (20, 21)])
    assert busy == 12 + 1 + 28 and gaps == []
    busy, gaps = device_timeline([(0, 1), (1 + 2 * GAP_US, 2 + 2 * GAP_US), (2 + 2 * GAP_US, 3 + 2 * GAP_US)])
    assert busy == 3 and gaps == [2 * GAP_US]


def test_qos_variants_are_named_flag_lists():
    from perf.qos import variant

    assert variant("rides=--qos-lower-rides=true+--prompt-rows=64") == ("rides", ["--qos-lower-rides=true",
                                                                               "--prompt-rows=64"])
    assert variant("q=--qos-max-queued high=1,low=2") == ("q", ["--qos-max-queued", "high=1,low=2"])
    with pytest.raises(argparse.ArgumentTypeError):
        variant("no flags=")


def test_served_llm_notes_the_servers_own_time_to_first_token():
    from perf.llm_scenarios import server_side

    before = {"llm_time_to_first_token_seconds_count": 2.0, "llm_time_to_first_token_seconds_sum": 0.5}
    after = {"llm_time_to_first_token_seconds_count": 6.0, "llm_time_to_first_token_seconds_sum": 0.9,
             "llm_decode_steps_total": 40.0, "llm_decode_seconds_total": 0.2}
    note = server_side(before, after, wall_s=1.0)
    assert "100.0 ms on average over 4 requests" in note and "40 decode steps" in note
    assert server_side({}, {"nv_inference_count": 3.0}, wall_s=1.0) is None  # a model without llm_* metrics


def test_ttft_split_joins_client_trace_and_spans_by_request_id(tmp_path):
    from perf.llm import StreamTiming
    from perf.ttft_split import STAGES, describe, stage_ms

    trace = tmp_path / "trace.json"
    # Triton wrote one file per trace (log-frequency 1); "b" was not traced, "c" is an ensemble step's child
    stamps = {"REQUEST_START": 1_002_000_000, "COMPUTE_START": 1_005_000_000}
    (tmp_path / "trace.json.0").write_text(json.dumps([{"id": 1, "model_name": "llm", "request_id": "a", "timestamps":
                                                        [{"name": k, "ns": v} for k, v in stamps.items()]}]))
    (tmp_path / "trace.json.1").write_text(json.dumps([{"id": 2, "model_name": "llm", "request_id": "c",
                                                        "parent_id": 9, "timestamps": []}]))
    spans = {"queued": 1_006_000_000, "admitted": 1_010_000_000, "first_token": 1_030_000_000}
    (tmp_path / "trace.json.spans.jsonl").write_text("".join(
        json.dumps({"request_id": rid, "model": "llm", "spans": spans}) + "\n" for rid in "abc"))
    timings = [StreamTiming(1.0, [1.031, 1.04], "xy", request_id=rid) for rid in "abc"]
    stages = stage_ms(timings, trace)
    assert list(stages) == [name for name, _, _ in STAGES]
    assert {k: v.item() for k, v in stages.items()} == pytest.approx(
        {"client to Triton": 2.0, "Triton's queue": 3.0, "execute": 1.0, "waiting for the engine loop": 4.0,
         "admitted to first token": 20.0, "first token to client": 1.0}, rel=1e-6)
    note = describe(stages)
    assert "1 traced requests" in note and "Triton's queue 3.0 / 3.0" in note
    assert note.endswith("all of them 31.0 / 31.0.")
    two = {name: np.array([ms, 2 * ms]) for name, ms in {"execute": 1.0, "admitted to first token": 20.0}.items()}
    assert describe(two, slowest=True).endswith("; the slowest, 42.0: execute 2.0; admitted to first token 40.0.")
    assert describe(stage_ms(timings, tmp_path / "none.json")) is None


def test_a_jpeg_with_a_comment_is_another_file_with_the_same_pixels():
    import numpy as np
    from PIL import Image

    from perf.inputs import with_comment

    jpeg = encoded_images([(64, 48, "JPEG")])[0]
    tagged = with_comment(jpeg, "request 7")
    assert tagged != jpeg and with_comment(jpeg, "request 8") != tagged
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(tagged))), np.asarray(Image.open(io.BytesIO(jpeg))))
    with pytest.raises(ValueError, match="not a JPEG"):
        with_comment(b"\x89PNG", "x")


def test_stub_profile_summary_splits_each_thread_by_where_it_was(tmp_path):
    from perf.stub_profile import summarize

    recording = tmp_path / "stub.txt"
    recording.write_text(
        "thread (1): batcher;_loop (backends/core/batcher.py:262);step (backends/whisper/engine.py:194);"
        "tolist (torch/x.py:1) 30\n"
        "thread (1): batcher;_loop (backends/core/batcher.py:262);_join (backends/whisper/engine.py:241) 10\n"
        "thread (2): respond_0;_worker (concurrent/futures/thread.py:81) 5\n")
    rows = summarize(recording).splitlines()[2:]
    assert rows[0] == "| batcher | 40 | tolist (torch/x.py:1) | step (backends/whisper/engine.py:194) | 75% |"
    assert rows[1] == "|  |  | _join (backends/whisper/engine.py:241) | _join (backends/whisper/engine.py:241) | 25% |"
    assert rows[2] == "| respond_0 | 5 | _worker (concurrent/futures/thread.py:81) | - | 100% |"


def test_whisper_join_flops_equal_what_torch_counts_in_a_join(whisper_checkpoint):
    """perf.whisper_steps' arithmetic of a clip's join (its TFLOP/s rows) against torch's FLOP counter over the
    engine's own join (features, encoder, cross-attention keys and values) of two clips."""
    from torch.utils.flop_counter import FlopCounterMode

    from backends.whisper.engine import WhisperEngine
    from perf.whisper_steps import join_flops

    # transformers' encoder with attention as matmuls, which the counter sees on the CPU (not SDPA there); the fused
    # encoder does the same arithmetic (tests/unit/test_whisper.py)
    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=2, fused_encoder=False)
    engine.model.set_attn_implementation("eager")
    waves = torch.zeros(2, engine.features.n_samples)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as features:  # the mel filter bank, left out of join_flops (0.01%)
            engine.features.from_waves(waves)
        with FlopCounterMode(display=False) as join:
            engine._encode_into(waves, torch.arange(2))
    counted = join.get_total_flops() - features.get_total_flops()
    assert counted == pytest.approx(2 * join_flops(engine.model.config), rel=0.01)
