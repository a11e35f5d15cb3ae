"""Whisper throughput: clips/s and audio seconds per second (real-time factor) vs concurrency through the served
`whisper` (perf_analyzer over gRPC), beside the in-process engine under the same load (a closed loop of as many
clips in flight as the highest concurrency) on the same clips in the same run. --py-spy: the stub recorded from the
start of the highest concurrency's run.

python -m perf.whisper_bench [--repository model_repository] [--concurrency 1 16 64] [--host NAME]
"""
from __future__ import annotations

import argparse
import io
import itertools
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from backends.media.audio import decode_audio
from backends.server import TritonServer, free_port
from backends.whisper.engine import PHASES
from perf.analyzer import LoadPoint, sweep
from perf.gpu import served_device
from perf.inputs import bytes_entry
from perf.llm_scenarios import reload_with
from perf.report import bench_arguments, hardware_line, write_table
from perf.stub_profile import add_arguments as add_profile_arguments, stub_profile

# (seconds, max_tokens): about 3 tokens per second of speech, so the decoder does what real speech would ask of it
CLIPS = [(5.0, 16), (12.0, 36), (28.0, 84)]


def speech_like(seconds: float, seed: int, rate: int = 16000) -> bytes:
    """16-bit WAV of noise shaped by a 4 Hz syllable-rate envelope (random noise alone has no pauses)."""
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    envelope = 0.5 * (1 + np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6.28))) * (rng.uniform(size=t.size) > 0.001)
    out = io.BytesIO()
    sf.write(out, (0.2 * envelope * rng.normal(size=t.size)).astype(np.float32), rate, format="WAV",
             subtype="PCM_16")
    return out.getvalue()


def clips() -> list[tuple[bytes, float, int]]:
    return [(speech_like(seconds, seed), seconds, tokens) for seed, (seconds, tokens) in enumerate(CLIPS)]


def write_input_data(path: Path, items: list[tuple[bytes, float, int]]) -> Path:
    """perf_analyzer steps: audio, language en, the clip's token budget; it cycles through them."""
    path.write_text(json.dumps({"data": [
        {"audio": bytes_entry(audio), "language": bytes_entry(b"en"), "max_tokens": {"content": [tokens],
                                                                                     "shape": [1]}}
        for audio, _, tokens in items]}))
    return path


def in_process(folder: Path, items: list[tuple[bytes, float, int]], concurrency: int, params: dict[str, str],
               device: str, clips_per_round: int) -> tuple[float, list[float]]:
    """Clips/s and `ENGINE_COLUMNS` of the engine alone with `concurrency` clips always in flight (a finished clip is
    replaced by the next, the clips cycled): features, encoder and continuous-batched greedy decoding, with the served
    model's engine parameters; after a warm-up round. The clips are decoded beforehand: the served model decodes on its
    prepare threads, beside the engine's loop."""
    from backends.whisper.engine import Clip, WhisperEngine

    engine = WhisperEngine(folder, params["dtype"], device, int(params["max_batch"]), int(params["encoder_batch"]),
                           params["cuda_graphs"] == "true", join_min=int(params.get("join_min", "1")),
                           join_wait_s=float(params.get("join_wait_ms", "50")) / 1000,
                           fused_encoder=params.get("fused_encoder", "true") == "true")
    cycle = itertools.cycle([(decode_audio(audio), tokens) for audio, _, tokens in items])

    def add() -> None:
        samples, tokens = next(cycle)
        engine.add(Clip(samples, "en", "transcribe", tokens))

    def run(clips: int) -> None:
        for _ in range(concurrency - len(engine.waiting) - (len(engine.running) - engine.free_slots)):
            add()
        done = 0
        while done < clips:
            occupancy.append(engine.occupancy())
            for clip in engine.step():
                if clip.error is not None:
                    raise clip.error
                done += 1
                add()

    occupancy: list[tuple[int, int, int]] = []
    run(concurrency)
    occupancy.clear()  # counted over the timed clips only
    start, steps, fed, computed = time.perf_counter(), engine.steps, engine.fed, engine.computed
    step_s, join_s, joins, encoded = engine.step_seconds, engine.join_seconds, engine.joins, engine.encoded
    left, phases = engine.left, dict(engine.phase_seconds)
    run(clips_per_round)
    seconds, steps = time.perf_counter() - start, engine.steps - steps
    per_clip = [1e3 * (engine.phase_seconds[phase] - phases[phase]) / max(engine.left - left, 1) for phase in PHASES]
    per_step = [1e3 * (engine.step_seconds - step_s) / steps, 1e3 * (engine.join_seconds - join_s) / steps]
    return clips_per_round / seconds, [(engine.fed - fed) / steps, (engine.computed - computed) / steps,
                                       steps / seconds, *per_step, "-", 1e3 * seconds / steps - sum(per_step),
                                       (engine.encoded - encoded) / max(engine.joins - joins, 1),
                                       *np.mean(occupancy, axis=0), *per_clip, "-", "-", "-", "-", "-"]


# the served engine's figures end with the last request it started: the drain after the client stopped (fewer clips
# a step, so faster steps) left out
STARTS = "qos_admitted_total"
ENGINE_COLUMNS = ["decode batch", "rows a step", "decoder steps/s", "step ms", "join ms", "metrics ms",
                  "other ms", "clips a join", "clips in slots", "joining", "waiting", "clip waiting ms",
                  "clip joining ms", "clip decoding ms", "queued", "queue wait ms", "in model ms", "answer ms",
                  "Triton queue ms"]


def engine_columns(point: LoadPoint) -> list[float]:
    """The served engine over a perf_analyzer run: clips per decoder step, rows it computed (free slots below the
    highest in use, up to its graph's size, computed too), decoder steps/s, the loop's ms per step in
    decoder steps (launch and wait), starting joins and updating metrics, the mean clips in its
    slots, joining (in a slot, encoder not finished) and waiting for a slot (its gauges), the mean requests queued
    ahead of it, their mean wait from arrival to start (QoS metrics; preparation included) and their mean time from
    arrival to answer, and their wait in Triton's queue before that (perf_analyzer's server-side figure).
    Per clip that left its slot: its ms queued in the engine, joining and decoding; per response, the ms from the
    request's end in the engine to its response sent."""
    growth, mean = point.watched.growth, point.watched.mean
    steps = growth.get("whisper_decode_steps_total", 0.0)
    per_step = [1e3 * growth.get(name, 0.0) / max(steps, 1.0) for name in (
        "whisper_decode_seconds_total", "whisper_join_seconds_total", "batcher_metrics_seconds_total")]
    return [*(growth.get(f"whisper_decode_{name}_total", 0.0) / max(steps, 1.0) for name in ("tokens", "rows")),
            steps / point.watched.seconds, *per_step, 1e3 * point.watched.seconds / max(steps, 1.0) - sum(per_step),
            growth.get("whisper_encoded_clips_total", 0.0) / max(growth.get("whisper_joins_total", 0.0), 1.0),
            *(mean.get(f"whisper_clips_{name}", 0.0) for name in ("running", "joining", "waiting")),
            *(1e3 * growth.get(f"whisper_clip_{phase}_seconds_total", 0.0)
              / max(growth.get("whisper_clips_left_total", 0.0), 1.0) for phase in PHASES),
            mean.get("qos_queue_depth", 0.0),
            *(1e3 * growth.get(f"qos_{name}_seconds_sum", 0.0) / max(growth.get(f"qos_{name}_seconds_count", 0.0), 1.0)
              for name in ("wait", "request")),
            1e3 * growth.get("batcher_answer_seconds_total", 0.0) / max(growth.get("batcher_answers_total", 0.0), 1.0),
            point.server_queue_us / 1e3]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.whisper_bench", description=__doc__)
    add_profile_arguments(parser)
    parser.add_argument("--http-too", action="store_true", help="the highest concurrency again with perf_analyzer "
                        "over HTTP (the sweep is over gRPC): whether the transport sets the served pace")
    parser.add_argument("--join-min-too", type=int, nargs="*", default=[], help="the highest concurrency again with "
                        "the model reloaded with each of these join_min (over HTTP with --http-too), and in process")
    parser.add_argument("--async-too", action="store_true", help="the highest concurrency again with perf_analyzer "
                        "in its async mode (a few threads keep the requests in flight, not one blocking thread each): "
                        "whether the client's threads set the served pace")
    parser.add_argument("--unfused-too", action="store_true", help="the engine in process again with transformers' "
                        "encoder (fused_encoder false) in place of the fused one")
    args = bench_arguments(parser, 4000, concurrency=(1, 16, 64)).parse_args(argv)
    items = clips()
    mean_seconds = float(np.mean([seconds for _, seconds, _ in items]))
    folder = args.repository / "whisper" / "1"
    engine_meta = json.loads((folder / "engine.json").read_text())
    with tempfile.TemporaryDirectory() as tmp_name, TritonServer(
            args.repository, free_port(), free_port(), free_port(), Path("logs/bench-whisper.log"),
            model_control="explicit", load_models=["whisper"]) as server:
        tmp = Path(tmp_name)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        version = client.get_server_metadata(as_json=True)["version"]
        config = client.get_model_config("whisper", as_json=True)["config"]
        client.close()
        device = served_device(config)
        data = write_input_data(tmp / "whisper.json", items)
        *lower, top = args.concurrency
        points, _, notes = sweep("whisper", server, data, tmp, "concurrency", lower, args.interval_ms, watch=True,
                                 watch_until=STARTS)
        with stub_profile(args, server, "whisper"):
            top_points, _, top_notes = sweep("whisper", server, data, tmp, "concurrency", [top], args.interval_ms,
                                             watch=True, watch_until=STARTS)
        points, notes = [("Triton", p) for p in points + top_points], notes + top_notes

        def top_again(label: str, **how) -> None:
            """The highest concurrency again, as a row `label` (`how`: sweep's protocol or extra arguments)."""
            tried, _, tried_notes = sweep("whisper", server, data, tmp, "concurrency", [top], args.interval_ms,
                                          watch=True, watch_until=STARTS, **how)
            points.extend((label, p) for p in tried)
            notes.extend(tried_notes)
        if args.http_too:
            top_again("Triton over HTTP", protocol="http")
        if args.async_too:
            top_again("Triton, perf_analyzer --async", extra=["--async"])
        protocol = "http" if args.http_too else "grpc"
        for join_min in args.join_min_too:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            reload_with(client, "whisper", config, device, join_min=str(join_min))
            client.close()
            top_again(f"Triton ({protocol}), join_min {join_min}", protocol=protocol)
    rows = [[f"{how}, concurrency {p.load:g}", p.throughput, p.throughput * mean_seconds, 1e3 * p.load / p.throughput,
             p.p50_us / 1e3, p.p99_us / 1e3, "-" if p.gpu_util is None else f"{100 * p.gpu_util:.0f}%",
             *engine_columns(p)] for how, p in points]
    hardware = hardware_line(version)
    load = max(args.concurrency)
    params = {key: value["string_value"] for key, value in config["parameters"].items()}

    def engine_alone(label: str, **overrides: str) -> float:
        """The engine in process with these parameters over the served ones, as a row; its clips/s."""
        clips_s, columns = in_process(folder, items, load, {**params, **overrides}, device, clips_per_round=4 * load)
        rows.append([f"in-process engine, {load} clips in flight{label}", clips_s, clips_s * mean_seconds,
                     "-", "-", "-", "-", *columns])
        return clips_s
    rate = engine_alone("")
    compared = []
    for join_min in args.join_min_too:
        tried_rate = engine_alone(f", join_min {join_min}", join_min=str(join_min))
        served = [p.throughput for how, p in points if how.endswith(f"join_min {join_min}")]
        if served:
            compared.append(f"join_min {join_min}: served / in-process (both with it) {served[0] / tried_rate:.2f}, "
                            f"served / the default's in-process {served[0] / rate:.2f}.")
    if args.unfused_too:
        engine_alone(", transformers' encoder", fused_encoder="false")
    best = max((p.throughput for how, p in points if "join_min" not in how), default=float("nan"))
    notes = [f"Clips: {', '.join(f'{s:g} s' for _, s, _ in items)} of speech-like noise (16-bit WAV, 16 kHz), "
             f"cycled; each asks for a fixed number of tokens ({', '.join(str(n) for *_, n in items)}: about 3 per "
             "second of speech) in English. Audio s/s = clips/s x the mean clip length "
             f"({mean_seconds:g} s): the real-time factor's inverse (RTFx).",
             f"Model: {params['dtype']} weights from {Path(engine_meta['checkpoint']).name}, device {device}; "
             f"batch_window {params['batch_window']}, {params['max_batch']} decoder slots, up to "
             f"{params['encoder_batch']} clips joining per step, CUDA graphs {params['cuda_graphs']}, join_min "
             f"{params.get('join_min', '1')} (join_wait_ms {params.get('join_wait_ms', '50')}), fused encoder "
             f"{params.get('fused_encoder', 'true')}.",
             f"In-process: the same engine and parameters with {load} clips always in flight (features, encoder, "
             f"continuous-batched greedy decoding; the audio decoded beforehand, as the served model decodes it on "
             f"its prepare threads beside the engine), {4 * load} clips after a warm-up, in this "
             f"process after the server stopped. Best Triton / in-process = {best / rate:.2f}.",
             "Engine columns, served: over the perf_analyzer run while the model answered and started requests (from "
             "the last reading before its first answer to the first after it last started one: perf_analyzer's "
             "start-up and the drain after it stopped left out), clips fed per decoder step, the rows it computed "
             "(free slots below the highest in use, up to its CUDA graph's size, too) and steps/s from the model's "
             "whisper_decode_* counters, the engine loop's ms per step in decoder steps (launch and the wait for their "
             "choices), starting joins and updating metrics (whisper_decode_seconds, whisper_join_seconds, "
             "batcher_metrics_seconds) and the rest of a step's time (other: admitting and answering requests, the "
             "engine's own bookkeeping, waits for the GIL), clips an encoder pass took "
             "(whisper_encoded_clips / whisper_joins), the means of its gauges read "
             "every 0.25 s: clips in the decoder's slots (joining ones too), joining (encoder not finished) and "
             "waiting for a slot; per clip that left its slot, its mean ms queued in the engine for one, in it while "
             "its join ran, and decoding (whisper_clip_*_seconds / whisper_clips_left); requests queued ahead of the "
             "engine (qos_queue_depth), their mean wait from arrival to start (qos_wait_seconds: preparation "
             "included) and from arrival to answer (qos_request_seconds: in model), the mean ms from that answer to "
             "its response sent (batcher_answer_seconds / batcher_answers) and perf_analyzer's server queue time "
             "(Triton's queue, before the model's); latency mean is at the client, concurrency / clips/s (Little's "
             "law, in perf_analyzer's closed loop): clips/s x (it - in model) requests were outside the model at any "
             "time. In process: "
             "the same over the timed clips, counted before each step.",
             *(f"{how}, concurrency {p.load:g}: Triton's compute input / infer / output (perf_analyzer's server-side "
               f"figures; infer is `execute`, which only queues the request) {p.server_compute_input_us / 1e3:.2f} / "
               f"{p.server_compute_infer_us / 1e3:.2f} / {p.server_compute_output_us / 1e3:.2f} ms; the client's "
               f"send / wait on network and server beyond those / receive {p.client_send_us / 1e3:.2f} / "
               f"{p.network_server_us / 1e3:.1f} / {p.client_recv_us / 1e3:.2f} ms."
               for how, p in points if p.load == load),
             *compared, *notes]
    header = ["setup", "clips/s", "audio s/s (RTFx)", "latency mean ms", "latency p50 ms", "latency p99 ms",
              "GPU util", *ENGINE_COLUMNS]
    print(write_table(args.results / args.host, "whisper-throughput", header, rows, hardware, notes), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
