"""`make bench`: perf_analyzer sweeps (concurrency and request rate) per model against a server started here,
the in-process baseline beside each, the dynamic-batching study on vit, and the LLM streaming benchmark (checked on
the `token_stream` calibration model, beside genai-perf where installed). Results: perf/results/<host>/."""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from backends.server import TritonServer, free_port
from backends.vision.encoders import EncoderParams
from perf.analyzer import UnstableMeasurement, run_perf_analyzer, sweep
from perf.baseline import in_process_throughput
from perf.inputs import IMAGE_SETS, model_input_data, model_items
from perf.llm_scenarios import calibration_bench, served_llm_bench
from perf.report import hardware_line, write_sweep, write_table


def bench_model(model: str, server: TritonServer, repository: Path, results: Path, tmp: Path,
                concurrency: list[int], interval_ms: int, hardware: str, image_set: str = "mixed") -> None:
    data = model_input_data(model, tmp, image_set)
    by_concurrency, gpu_source, unstable = sweep(model, server, data, tmp, "concurrency", concurrency, interval_ms)
    peak = max(p.throughput for p in by_concurrency)
    rates = [round(peak * f, 1) for f in (0.25, 0.5, 0.75)]
    by_rate, _, unstable_rates = sweep(model, server, data, tmp, "request_rate", rates, interval_ms)
    client = grpcclient.InferenceServerClient(server.grpc_url)  # gRPC only: the GPU bundle carries no HTTP client deps
    config = client.get_model_config(model, as_json=True)["config"]
    client.close()
    batch = max(concurrency)
    baseline = in_process_throughput(repository / model / "1", EncoderParams.from_model_config(config),
                                     model_items(model, image_set), batch)
    inputs = "" if model == "clip_text" else f"Image set `{image_set}`: {IMAGE_SETS[image_set]}. "
    notes = [inputs + f"Engine: runtime {config['parameters']['runtime']['string_value']}, "
             f"prepare_threads {config['parameters'].get('prepare_threads', {}).get('string_value', '4')}.",
             f"In-process baseline (same encoder, same inputs, batch {batch}, called directly): {baseline:.1f} "
             f"infer/s. Triton peak / in-process = {peak:.1f} / {baseline:.1f} = {peak / baseline:.2f}."]
    if gpu_source:
        notes.append(f"GPU util: mean during each perf_analyzer run, from {gpu_source}.")
    scenario = model if image_set == "mixed" else f"{model}-{image_set}"
    write_sweep(results, f"{scenario}-concurrency", "concurrency", by_concurrency, hardware, notes + unstable)
    write_sweep(results, f"{scenario}-request-rate", "request rate (req/s)", by_rate, hardware,
                [f"Rates are 25/50/75% of the concurrency sweep's peak ({peak:.1f} infer/s).", *notes[:1],
                 *unstable_rates])
    print(f"{scenario}: peak {peak:.1f} infer/s, in-process {baseline:.1f}, ratio {peak / baseline:.2f}", flush=True)


def batching_study(repository: Path, results: Path, tmp: Path, interval_ms: int, hardware: str,
                   delays_us=(0, 1000, 15000), concurrencies=(1, 64), levels_delay_us: int = 1000) -> None:
    """vit under the same load with different dynamic-batcher windows, and with `levels_delay_us` also with the QoS
    classes as priority levels (explicit mode, config override reloads)."""
    rows = []
    server = TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-batching.log"),
                          model_control="explicit", load_models=["vit"])
    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        config = client.get_model_config("vit", as_json=True)["config"]
        data = model_input_data("vit", tmp)
        plain = dict(config["dynamic_batching"])
        for delay, levels in [*((d, False) for d in delays_us), (levels_delay_us, True)]:
            config["dynamic_batching"] = dict(plain, max_queue_delay_microseconds=delay)
            if levels:
                config["dynamic_batching"].update(priority_levels_json())
            client.load_model("vit", config=json.dumps(config))
            for concurrency in concurrencies:
                before = client.get_inference_statistics("vit", as_json=True)["model_stats"][0]
                # windows of 2x concurrency requests: at high load one request can outlast a fixed time window
                windows = ["--measurement-mode", "count_windows", "--measurement-request-count", str(2 * concurrency)]
                try:
                    (point,) = run_perf_analyzer("vit", server.grpc_url, data,
                                                 tmp / f"batching-{delay}-{levels}-{concurrency}.csv",
                                                 concurrency=str(concurrency), interval_ms=interval_ms,
                                                 extra=windows if concurrency > 8 else None)
                except UnstableMeasurement:  # a row that says so: how unsteady a setting is is a result too
                    rows.append([delay / 1000, "yes" if levels else "no", concurrency,
                                 *["no stable measurement (6 trials)"] + ["-"] * 4])
                    continue
                after = client.get_inference_statistics("vit", as_json=True)["model_stats"][0]
                execs = int(after["execution_count"]) - int(before["execution_count"])
                infers = int(after["inference_count"]) - int(before["inference_count"])
                rows.append([delay / 1000, "yes" if levels else "no", concurrency, point.throughput,
                             point.p50_us / 1e3, point.p99_us / 1e3, point.server_queue_us / 1e3,
                             infers / max(execs, 1)])
        client.close()
    write_table(results, "vit-dynamic-batching", ["max_queue_delay ms", "priority levels", "concurrency", "infer/s",
                                                  "p50 ms",
                                                  "p99 ms", "queue ms", "avg batch"], rows, hardware,
                ["Same vit engine and image set; avg batch = inferences / executions from the server's statistics "
                 "over the whole perf_analyzer run (warm-up included). Priority levels: the QoS classes as the "
                 "dynamic batcher's three levels with their queue limits and timeouts (`build_engines "
                 "--priority-levels`), no request setting a priority."])
    print("vit dynamic-batching study written", flush=True)


def priority_levels_json() -> dict:
    """build_engines' priority levels (--priority-levels) as the JSON form of a model config's dynamic batching."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2 as mc

    from build_engines.repository import priority_queues

    batching = mc.ModelDynamicBatching()
    priority_queues(batching)
    return json_format.MessageToDict(batching, preserving_proto_field_name=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf", description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname(), help="results go to RESULTS/HOST/")
    parser.add_argument("--models", nargs="+", default=["vit", "clip_vision", "clip_text"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--image-sets", nargs="+", choices=sorted(IMAGE_SETS), default=["mixed"],
                        help="image inputs for vit/clip_vision (clip_text always uses its text set)")
    parser.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer measurement window")
    parser.add_argument("--skip-batching-study", action="store_true")
    parser.add_argument("--skip-llm", action="store_true", help="skip the LLM streaming benchmark")
    args = parser.parse_args(argv)
    args.results = args.results / args.host
    with tempfile.TemporaryDirectory() as tmp_name, TritonServer(
            args.repository, free_port(), free_port(), free_port(), Path("logs/bench-tritonserver.log"),
            model_control="explicit", load_models=args.models) as server:  # only what is measured
        tmp = Path(tmp_name)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        version = client.get_server_metadata(as_json=True)["version"]
        client.close()
        hardware = hardware_line(version)
        print(hardware, flush=True)
        for model in args.models:
            for image_set in ["mixed"] if model == "clip_text" else args.image_sets:
                bench_model(model, server, args.repository, args.results, tmp, args.concurrency, args.interval_ms,
                            hardware, image_set)
    if not args.skip_batching_study:
        with tempfile.TemporaryDirectory() as tmp_name:
            batching_study(args.repository, args.results, Path(tmp_name), args.interval_ms, hardware)
    if not args.skip_llm:
        with tempfile.TemporaryDirectory() as tmp_name:
            calibration_bench(args.results, Path(tmp_name), hardware)
        if (args.repository / "llm" / "config.pbtxt").exists():
            with tempfile.TemporaryDirectory() as tmp_name:
                served_llm_bench(args.repository, args.results, Path(tmp_name), hardware)
    return 0


if __name__ == "__main__":
    sys.exit(main())
