"""The batching window study on the served `whisper`: our batcher with no window, a fixed 15 ms window and the
adaptive window (up to 15 ms), and Triton's dynamic batcher with no window and a 15 ms one, one after another in one
server (explicit mode, config override reloads), the same clips and perf_analyzer loads for each.

The adaptive window's goals (issue 17): at concurrency 1 its p50 within 1.1x of no window; at the highest
concurrency its throughput within 5% of the fixed 15 ms window. Both ratios are printed and written below the table.

python -m perf.batch_window [--repository model_repository] [--concurrency 1 4 32] [--host NAME]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from backends.server import TritonServer, free_port
from perf.analyzer import UnstableMeasurement, run_perf_analyzer
from perf.report import bench_arguments, hardware_line, write_table
from perf.whisper_bench import clips, write_input_data

WINDOW_MS = 15.0
NO_WINDOW, FIXED, ADAPTIVE = "ours, no window", "ours, fixed 15 ms", "ours, adaptive <= 15 ms"
SETUPS = {  # label -> (batch_window, batch_window_max_ms, Triton's max_queue_delay in µs or None)
    NO_WINDOW: ("fixed", 0.0, None),
    FIXED: ("fixed", WINDOW_MS, None),
    ADAPTIVE: ("adaptive", WINDOW_MS, None),
    "Triton dynamic batcher, no window": ("triton", WINDOW_MS, 0),
    "Triton dynamic batcher, 15 ms": ("triton", WINDOW_MS, int(WINDOW_MS * 1000)),
}


def configured(config: dict, window: str, max_ms: float, triton_delay_us: int | None) -> dict:
    """`config` with the batching setup: our batcher takes requests as they come (no dynamic batcher)."""
    config = {k: v for k, v in config.items() if k != "dynamic_batching"}
    config["parameters"] = dict(config["parameters"], batch_window={"string_value": window},
                                batch_window_max_ms={"string_value": f"{max_ms:g}"})
    if triton_delay_us is not None:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": triton_delay_us}
    return config


def engine_ms_by_thread(folder: Path, items, rounds: int = 3) -> tuple[float, float]:
    """Mean ms of one engine call on this process's main thread, then on a worker thread, the same clips, after a
    warm-up call on each: torch's CPU kernels on a second thread that runs OpenMP regions."""
    import threading
    import time

    import torch

    from backends.media.audio import decode_audio
    from backends.whisper.engine import WhisperEngine

    meta = json.loads((folder / "engine.json").read_text())
    engine = WhisperEngine(folder, meta["precision"], "auto")
    clips_ = [(decode_audio(audio), tokens) for audio, _, tokens in items]
    means = []

    def measure():
        times = []
        for i in range(rounds * len(clips_) + 1):
            audio, tokens = clips_[i % len(clips_)]
            start = time.perf_counter()
            engine.transcribe([audio], ["en"], ["transcribe"], [tokens])
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        means.append(1000 * sum(times[1:]) / len(times[1:]))

    measure()
    worker = threading.Thread(target=measure)
    worker.start()
    worker.join()
    return means[0], means[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.batch_window", description=__doc__)
    args = bench_arguments(parser, 4000, concurrency=(1, 4, 32)).parse_args(argv)
    items = clips()
    rows, measured = [], {}
    with tempfile.TemporaryDirectory() as tmp_name, TritonServer(
            args.repository, free_port(), free_port(), free_port(), Path("logs/bench-batch-window.log"),
            model_control="explicit", load_models=["whisper"]) as server:
        tmp = Path(tmp_name)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        version = client.get_server_metadata(as_json=True)["version"]
        config = client.get_model_config("whisper", as_json=True)["config"]
        data = write_input_data(tmp / "whisper.json", items)
        for label, setup in SETUPS.items():
            client.load_model("whisper", config=json.dumps(configured(config, *setup)))
            for concurrency in args.concurrency:
                try:
                    (point,) = run_perf_analyzer("whisper", server.grpc_url, data, tmp / f"{label}-{concurrency}.csv",
                                                 concurrency=str(concurrency), interval_ms=args.interval_ms)
                except UnstableMeasurement:
                    rows.append([label, concurrency, "no stable measurement (6 trials)", "-", "-"])
                    continue
                measured[label, concurrency] = point
                rows.append([label, concurrency, point.throughput, point.p50_us / 1e3, point.p99_us / 1e3])
                print(*rows[-1], flush=True)
        client.close()
    main_ms, worker_ms = engine_ms_by_thread(args.repository / "whisper" / "1", items)
    low, high = min(args.concurrency), max(args.concurrency)
    notes = [f"Clips: {', '.join(f'{s:g} s' for _, s, _ in items)} of speech-like noise with their token budgets "
             "(perf.whisper_bench), cycled; Triton batches up to "
             f"{config.get('max_batch_size')} requests. Our batcher: backends/core/batcher.py (`batch_window`, "
             "`batch_window_max_ms`); Triton's: `dynamic_batching.max_queue_delay_microseconds`.",
             "Setups one after another in one server (reloads with a config override), the same perf_analyzer "
             f"loads (concurrency, {args.interval_ms} ms windows) for each.",
             f"One engine call (one clip, the clips cycled) in this process after the server stopped: {main_ms:.1f} ms "
             f"on the main thread, {worker_ms:.1f} ms on a worker thread ({worker_ms / main_ms:.2f}x) once the "
             "main thread has run it too: why our batcher builds its engine on the thread that runs its batches."]
    adaptive_low, none_low = measured.get((ADAPTIVE, low)), measured.get((NO_WINDOW, low))
    adaptive_high, fixed_high = measured.get((ADAPTIVE, high)), measured.get((FIXED, high))
    if adaptive_low and none_low:
        notes.append(f"Concurrency {low}: adaptive p50 / no-window p50 = "
                     f"{adaptive_low.p50_us / none_low.p50_us:.2f} (goal <= 1.10).")
    if adaptive_high and fixed_high:
        notes.append(f"Concurrency {high}: adaptive throughput / fixed 15 ms throughput = "
                     f"{adaptive_high.throughput / fixed_high.throughput:.3f} (goal >= 0.95).")
    print("\n".join(notes[3:]), flush=True)
    header = ["setup", "concurrency", "infer/s", "p50 ms", "p99 ms"]
    print(write_table(args.results / args.host, "whisper-batch-window", header, rows, hardware_line(version), notes),
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
