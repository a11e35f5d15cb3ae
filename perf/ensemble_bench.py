"""`python -m perf.ensemble_bench`: an image encoder served as one model and as Triton ensembles, side by side in
one run. Each variant is a repository built beforehand (`--variant NAME=REPOSITORY`, e.g. `single=repo_a`
`ensemble=repo_b` from `build_engines vit` and `build_engines vit --ensemble`); for each model every variant gets a
server of its own, and on it the same perf_analyzer concurrency sweep per image set (GPU utilisation from the
server's metrics, each step's batch size and time from Triton's statistics), and the in-process baseline (the same encoder called directly, with each variant's preprocessing device)
gives Triton / in-process. Results: <date>-ensembles[-label].{md,csv} and the full sweep, ...-sweep."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from backends.server import TritonServer, free_port
from backends.vision.encoders import EncoderParams
from perf.analyzer import LoadPoint, sweep
from perf.baseline import in_process_throughput
from perf.inputs import IMAGE_SETS, model_input_data, model_items
from perf.report import bench_arguments, hardware_line, write_table
from perf.server_metrics import model_metrics


@dataclasses.dataclass
class Variant:
    name: str
    repository: Path

    def engine_folder(self, model: str) -> Path:
        """The model's or, in an ensemble, its encoder step's version folder."""
        ensemble_step = self.repository / f"{model}_encoder"
        return (ensemble_step if ensemble_step.exists() else self.repository / model) / "1"

    def preprocess_folder(self, model: str) -> Path:
        """The model that prepares images: the model itself, or the ensemble's first step."""
        folder = self.repository / f"{model}_preprocess"
        return folder if folder.exists() else self.repository / model

    def preprocess_config(self, model: str) -> dict:
        return read_config(self.preprocess_folder(model))

    def describe(self, model: str) -> str:
        config = self.preprocess_config(model)
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        place = "on the device (torch; nvJPEG for JPEGs on a GPU)" if parameters.get("preprocess_on_device") == "true" else \
            "on the CPU (Pillow)"
        group = config["instance_group"][0]
        steps = "ensemble: preprocessing step" if (self.repository / f"{model}_preprocess").exists() else \
            "one model: preprocessing in its execute"
        return (f"{self.name}: {steps} {place}, {group.get('count', 1)} {group.get('kind', 'KIND_AUTO')} instance(s) "
                f"x {parameters.get('prepare_threads', '4')} threads, batch window "
                f"{parameters.get('batch_window', 'triton')}")


def read_config(folder: Path) -> dict:
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = text_format.Parse((folder / "config.pbtxt").read_text(), mc.ModelConfig())
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def serve_and_sweep(variant: Variant, model: str, image_sets: list[str], concurrency: list[int], interval_ms: int,
                    tmp: Path) -> dict[str, tuple[list[LoadPoint], list[str]]]:
    """Points (and notes on unstable levels) per image set, with a server of this variant's repository."""
    server = TritonServer(variant.repository, free_port(), free_port(), free_port(),
                          Path(f"logs/bench-ensembles-{variant.name}.log"), model_control="explicit",
                          load_models=[model], cuda_memory_pool_mb=2048)  # an ensemble loads its steps
    out, csvs = {}, tmp / variant.name
    csvs.mkdir(exist_ok=True)
    with server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        steps = [s["model_name"] for s in client.get_model_config(model, as_json=True)["config"]
                 .get("ensemble_scheduling", {}).get("step", [])] or [model]
        for image_set in image_sets:
            data = model_input_data(model, tmp, image_set)
            before = [(step_stats(client, step), model_metrics(server.metrics_url, step)) for step in steps]
            points, _, notes = sweep(model, server, data, csvs, "concurrency", concurrency, interval_ms)
            for step, (old, old_metrics) in zip(steps, before):
                notes.append(describe_step(step, old, step_stats(client, step)))
                now = model_metrics(server.metrics_url, step)
                batched = {name: now.get(name, 0) - old_metrics.get(name, 0)
                           for name in ("batcher_requests_total", "batcher_batches_total")}
                if batched["batcher_batches_total"]:  # our batcher: Triton counts an execution per request
                    notes.append(f"step {step}, our batcher: {batched['batcher_requests_total']:.0f} requests in "
                                 f"{batched['batcher_batches_total']:.0f} engine calls (mean batch "
                                 f"{batched['batcher_requests_total'] / batched['batcher_batches_total']:.1f})")
            out[image_set] = (points, notes)
        client.close()
    return out


def step_stats(client, model: str) -> dict:
    (stats,) = client.get_inference_statistics(model, as_json=True)["model_stats"]
    return stats


def describe_step(model: str, before: dict, after: dict) -> str:
    """Where one model's time went over the sweep (Triton's cumulative statistics, warm-up included)."""
    def delta(*keys: str) -> float:
        def read(stats):
            for key in keys:
                stats = stats.get(key, {})
            return float(stats or 0)
        return read(after) - read(before)
    executions, inferences = delta("execution_count"), delta("inference_count")
    per = {name: delta("inference_stats", name, "ns") / max(inferences, 1) / 1e6
           for name in ("queue", "compute_input", "compute_infer", "compute_output")}
    return (f"step {model}: {inferences:.0f} requests in {executions:.0f} executions (mean batch "
            f"{inferences / max(executions, 1):.1f}); ms per request (a batch's time counts for each): " +
            ", ".join(f"{name} {ms:.2f}" for name, ms in per.items()))


def baseline(variant: Variant, model: str, image_set: str, batch: int) -> float:
    """In-process images/s of the same engine, with this variant's preprocessing (device, threads)."""
    prep = EncoderParams.from_model_config(variant.preprocess_config(model))
    engine = EncoderParams.from_model_config(read_config(variant.engine_folder(model).parent))
    params = dataclasses.replace(engine, preprocess_on_device=prep.preprocess_on_device,
                                 prepare_threads=prep.prepare_threads)
    return in_process_throughput(variant.engine_folder(model), params, model_items(model, image_set), batch,
                                 preprocessor_dir=variant.preprocess_folder(model) / "1")


def write_results(args, argv, variants, summary, rows, notes, hardware) -> None:
    """Both tables, rewritten after each model (a run cut short keeps what it measured)."""
    results = args.results / args.host
    sets = "; ".join(f"`{name}`: {IMAGE_SETS[name]}" for name in args.image_sets)
    common = [f"Image sets: {sets}. Concurrency {args.concurrency}, perf_analyzer over gRPC, "
              f"{args.interval_ms} ms windows. GPU util: mean during the run, from the server's nv_gpu_utilization.",
              *notes, f"Command line: python -m perf.ensemble_bench {' '.join(argv or sys.argv[1:])}"]
    name = "ensembles" + (f"-{args.label}" if args.label else "")
    write_table(results, name, ["model", "image set", "variant", "peak images/s", "at concurrency",
                                       "p99 ms at peak", "GPU util % at peak", f"vs {variants[0].name}",
                                       "in-process images/s", "Triton / in-process"], summary, hardware,
                [f"In-process: the same engine and preprocessing called directly, batch {max(args.concurrency)}, "
                 "images prepared on the variant's threads (perf/baseline.py).", *common])
    write_table(results, f"{name}-sweep", ["model", "image set", "variant", "concurrency", "images/s", "p50 ms",
                                             "p99 ms", "GPU util %"], rows, hardware, common)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.ensemble_bench", description=__doc__)
    bench_arguments(parser, interval_ms=1500, concurrency=(8, 32, 128))
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=REPOSITORY",
                        help="a repository to serve; the first is the one the others are compared with")
    parser.add_argument("--models", nargs="+", default=["vit", "clip_vision"])
    parser.add_argument("--image-sets", nargs="+", choices=sorted(IMAGE_SETS), default=["thumbnails", "mixed"])
    parser.add_argument("--label", help="results are named <date>-ensembles-LABEL")
    parser.add_argument("--stages", action="store_true",
                        help="also time each stage of a batch in process (perf.encoder_stages) for every variant")
    args = parser.parse_args(argv)
    variants = [Variant(name, Path(path)) for name, _, path in (v.partition("=") for v in args.variant)]
    hardware = hardware_line("2.51.0")
    summary, rows, notes, stages = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for model in args.models:
            notes += [f"{model}, {v.describe(model)}." for v in variants]
            measured = {v.name: serve_and_sweep(v, model, args.image_sets, args.concurrency, args.interval_ms, tmp)
                        for v in variants}
            for image_set in args.image_sets:
                first_peak = None  # of the first variant, which the others are compared with
                for v in variants:
                    points, unstable = measured[v.name][image_set]
                    notes += [f"{model}, {image_set}, {v.name}: {n}" for n in unstable]
                    rows += [[model, image_set, v.name, p.load, p.throughput, p.p50_us / 1e3, p.p99_us / 1e3,
                              "-" if p.gpu_util is None else round(100 * p.gpu_util)] for p in points]
                    if not points:
                        continue
                    peak = max(points, key=lambda p: p.throughput)
                    if v is variants[0]:
                        first_peak = peak.throughput
                    in_process = baseline(v, model, image_set, max(args.concurrency))
                    summary.append([model, image_set, v.name, peak.throughput, peak.load, peak.p99_us / 1e3,
                                    "-" if peak.gpu_util is None else round(100 * peak.gpu_util),
                                    round(peak.throughput / first_peak, 2) if first_peak else "-",
                                    round(in_process, 1),
                                    round(peak.throughput / in_process, 2)])
                    print(f"{model} {image_set} {v.name}: peak {peak.throughput:.1f} images/s at {peak.load:g}, "
                          f"in-process {in_process:.1f}", flush=True)
            write_results(args, argv, variants, summary, rows, notes, hardware)
            if args.stages:
                stages += stage_rows(variants, model, args.image_sets)
                write_table(args.results / args.host, "ensembles" + (f"-{args.label}" if args.label else "") +
                            "-stages", ["model", "image set", "variant", "batch", "stage", "ms per batch",
                                        "images/s"], stages, hardware,
                            ["One process, the device synchronised after each stage (perf/encoder_stages.py)."])
    return 0


def stage_rows(variants: list[Variant], model: str, image_sets: list[str]) -> list[list]:
    from perf.encoder_stages import profile

    rows = []
    for v in variants:
        on_device = EncoderParams.from_model_config(v.preprocess_config(model)).preprocess_on_device
        for image_set in image_sets:
            for batch in (16, 64):
                stages = profile(v.engine_folder(model), model, image_set, batch, on_device, 10,
                                 v.preprocess_folder(model) / "1")
                rows += [[model, image_set, v.name, batch, name, round(ms, 2), round(batch / ms * 1e3)]
                         for name, ms in stages.items()]
                print("\n".join(f"{model} {image_set} {v.name} {batch}: {r[4]} {r[5]} ms" for r in rows[-len(stages):]),
                      flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
