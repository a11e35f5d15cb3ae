"""`make bench`: perf_analyzer sweeps (concurrency and request rate) per model against a server started here,
the in-process baseline beside each, the dynamic-batching study on vit, and the LLM streaming benchmark (checked on
the `token_stream` calibration model, beside genai-perf where installed). Results: perf/results/<host>/."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from backends.server import TritonServer, free_port
from backends.triton_model import model_parameters
from build_engines.checkpoints import byte_level_tokenizer
from perf import genai_perf
from perf.analyzer import LoadPoint, UnstableMeasurement, run_perf_analyzer
from perf.gpu import GpuUtilization
from perf.baseline import in_process_throughput
from perf.inputs import IMAGE_SETS, model_input_data, model_items
from perf.llm import LoadSpec, make_prompts, run_load, summarize
from perf.report import hardware_line, plot_curves, stem, write_sweep, write_table
from perf.token_stream import write_token_stream_model

# (concurrency, input tokens, output tokens) of the LLM streaming benchmark
LLM_LOADS = [(1, 32, 64), (4, 32, 64), (16, 32, 64), (64, 32, 64), (1, 256, 16), (16, 256, 16)]
GENAI_PERF_LOADS = [(1, 32, 64), (16, 32, 64), (64, 32, 64)]


def sweep(model: str, server: TritonServer, data: Path, tmp: Path, kind: str, levels: list[float],
          interval_ms: int) -> tuple[list[LoadPoint], str | None, list[str]]:
    """One perf_analyzer run per level (power-of-two sweeps; perf_analyzer's own ranges are linear), each with the
    mean GPU utilisation during it. Returns the points, where the utilisation came from (None: no GPU) and notes on
    levels left out because perf_analyzer found no stable measurement there."""
    points, source, notes = [], None, []
    for level in levels:
        value = f"{level:g}"
        args = {"concurrency": value} if kind == "concurrency" else {"request_rate": value}
        try:
            with GpuUtilization(server.metrics_url) as gpu:
                (point,) = run_perf_analyzer(model, server.grpc_url, data, tmp / f"{model}-{kind}-{value}.csv",
                                             interval_ms=interval_ms, **args)
        except UnstableMeasurement:
            notes.append(f"{kind} {value}: perf_analyzer found no stable measurement (6 trials); left out.")
            continue
        points.append(dataclasses.replace(point, gpu_util=gpu.mean))
        source = source or gpu.source
    return points, source, notes


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
    baseline = in_process_throughput(repository / model / "1", model_parameters(config),
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
                   delays_us=(0, 1000, 15000), concurrencies=(1, 64)) -> None:
    """vit under the same load with different dynamic-batcher windows (explicit mode, config override reloads)."""
    rows = []
    server = TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-batching.log"),
                          model_control="explicit", load_models=["vit"])
    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        config = client.get_model_config("vit", as_json=True)["config"]
        data = model_input_data("vit", tmp)
        for delay in delays_us:
            config["dynamic_batching"]["max_queue_delay_microseconds"] = delay
            client.load_model("vit", config=json.dumps(config))
            for concurrency in concurrencies:
                before = client.get_inference_statistics("vit", as_json=True)["model_stats"][0]
                # windows of 2x concurrency requests: at high load one request can outlast a fixed time window
                windows = ["--measurement-mode", "count_windows", "--measurement-request-count", str(2 * concurrency)]
                (point,) = run_perf_analyzer("vit", server.grpc_url, data, tmp / f"batching-{delay}-{concurrency}.csv",
                                             concurrency=str(concurrency), interval_ms=interval_ms,
                                             extra=windows if concurrency > 8 else None)
                after = client.get_inference_statistics("vit", as_json=True)["model_stats"][0]
                execs = int(after["execution_count"]) - int(before["execution_count"])
                infers = int(after["inference_count"]) - int(before["inference_count"])
                rows.append([delay / 1000, concurrency, point.throughput, point.p50_us / 1e3, point.p99_us / 1e3,
                             point.server_queue_us / 1e3, infers / max(execs, 1)])
        client.close()
    write_table(results, "vit-dynamic-batching", ["max_queue_delay ms", "concurrency", "infer/s", "p50 ms",
                                                  "p99 ms", "queue ms", "avg batch"], rows, hardware,
                ["Same vit engine and image set; avg batch = inferences / executions from the server's statistics "
                 "over the whole perf_analyzer run (warm-up included)."])
    print("vit dynamic-batching study written", flush=True)


LLM_HEADER = ["model", "tool", "concurrency", "input tokens", "output tokens", "requests", "TTFT p50 ms", "TTFT p90 ms",
              "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms", "latency p99 ms", "output tokens/s"]


def llm_row(model: str, tool: str, spec: LoadSpec, m: dict) -> list:
    return [model, tool, spec.concurrency, spec.input_tokens, spec.output_tokens, m.get("requests", "-"),
            *(m[f"{k}_p{q}"] for k in ("ttft_ms", "itl_ms") for q in (50, 90, 99)), m["latency_ms_p99"],
            m["output_tokens_per_s"]]


def llm_streaming(server: TritonServer, model: str, tokenizer_dir: Path, tmp: Path, loads=LLM_LOADS,
                  genai_loads=GENAI_PERF_LOADS) -> tuple[list[list], list[str]]:
    """perf/llm.py at each load (and genai-perf at `genai_loads` when installed), one row per measurement, and notes
    on the genai-perf runs that found no stable measurement."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    rows, notes = [], []
    for concurrency, input_tokens, output_tokens in loads:
        spec = LoadSpec(concurrency, input_tokens, output_tokens, requests=max(16, 4 * concurrency))
        prompts = make_prompts(32, input_tokens, lambda t: tokenizer.encode(t, add_special_tokens=False), decode)
        timings = asyncio.run(run_load(server.grpc_url, model, prompts, spec, {"min_length": output_tokens}))
        rows.append(llm_row(model, "perf/llm.py", spec, summarize(timings, count)))
        if (concurrency, input_tokens, output_tokens) in genai_loads and genai_perf.available():
            work = tmp / f"genai-perf-{model}-{concurrency}-{input_tokens}-{output_tokens}"
            try:
                rows.append(llm_row(model, "genai-perf", spec,
                                    genai_perf.run_genai_perf(server.grpc_url, model, spec, tokenizer_dir, work)))
            except RuntimeError as e:  # perf_analyzer under it found no stable window: say so, keep going
                notes.append(f"genai-perf at concurrency {concurrency}, {input_tokens} in / {output_tokens} out: "
                             f"failed ({str(e).splitlines()[0][:120]}).")
        print(" ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
    return rows, notes


def write_llm_results(results: Path, scenario: str, rows: list[list], hardware: str, notes: list[str]) -> None:
    base = stem(results, scenario)
    series: dict[str, list] = {}
    for row in rows:
        model, tool, concurrency, isl, osl = row[:5]
        series.setdefault(f"{model} {isl}in/{osl}out ({tool})", []).append((row[9], row[13], f"c{concurrency}"))
    plot_curves(base.with_suffix(".png"), scenario, "ITL p50 (ms)", "output tokens/s", series)
    write_table(results, scenario, LLM_HEADER, rows, hardware, notes, figure=base.with_suffix(".png").name)


def calibration_bench(results: Path, tmp: Path, hardware: str, first_token_ms: float = 20,
                      token_interval_ms: float = 5) -> None:
    """The LLM benchmark against `token_stream`, whose true TTFT and ITL are known: what the tool adds."""
    write_token_stream_model(tmp / "calibration", first_token_ms, token_interval_ms)
    tokenizer_dir = tmp / "byte-tokenizer"
    byte_level_tokenizer().save_pretrained(tokenizer_dir)
    with TritonServer(tmp / "calibration", free_port(), free_port(), free_port(),
                      Path("logs/bench-calibration.log")) as server:
        rows, genai_notes = llm_streaming(server, "token_stream", tokenizer_dir, tmp)
    notes = [f"`token_stream` produces exactly `max_tokens` tokens: the first {first_token_ms:g} ms after the request "
             f"arrives, then one every {token_interval_ms:g} ms, so the true TTFT is {first_token_ms:g} ms, the true "
             f"ITL {token_interval_ms:g} ms and the most output tokens/s at concurrency c and n output tokens is "
             f"c * n / ({first_token_ms:g} + {token_interval_ms:g} * (n - 1)) ms. Rows that miss these show what the "
             "client, gRPC and the python backend add at that load."
             + ("" if genai_perf.available() else " genai-perf rows: not run (`make genai-perf` installs it)."),
             *genai_notes]
    write_llm_results(results, "llm-streaming-calibration", rows, hardware, notes)
    print("LLM streaming calibration written", flush=True)


def served_llm_bench(repository: Path, results: Path, tmp: Path, hardware: str) -> None:
    """The same streaming loads against the served `llm` (tiny model here; output length forced by min_length)."""
    with TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-llm.log"),
                      model_control="explicit", load_models=["llm"]) as server:
        rows, genai_notes = llm_streaming(server, "llm", repository / "llm" / "1", tmp)
    write_llm_results(results, "llm-streaming", rows, hardware,
                      ["`llm` served from model_repository (its engine parameters in the model config); every request "
                       "asks for exactly `output tokens` (min_length = max_tokens)."
                       + ("" if genai_perf.available() else " genai-perf rows: not run (`make genai-perf`)."),
                       *genai_notes])
    print("LLM streaming (served llm) written", flush=True)


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
