"""python -m perf.overload: four times what a model can serve, for a bounded time, with the server's memory watched.

Each model is served from one repository by one server, in this order:
- `vit_ours`: our batcher (`--batch-window adaptive`), its queue bounded per QoS class (`qos_max_queued`);
- `llm`: the tiny LLM engine streaming, its queue bounded per QoS class;
- `vit_bounded`: Triton's dynamic batcher with a bounded queue (`--max-queue-size`);
- `vit_unbounded`: Triton's dynamic batcher without a bound (Triton's default, and the default here: README,
  "Overload, faults, cancellation").
Per model: its capacity (closed loop), then Poisson arrivals at `--load` times that for `--duration-s`, then the
drain. Reported: requests sent, served, refused (UNAVAILABLE), failed otherwise, and unanswered (none expected);
how fast refusals come; the served requests' latency (the longest is how long a request can wait); and the resident
memory of the server's processes (tritonserver and its model stubs) before, in each half of the overload, and after.
A bounded queue shows refusals, a latency bound and flat memory; the unbounded one, growing latency and memory.
`make stress` runs it (on this machine's CPU); the results go to perf/results/<host>/.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import tritonclient.grpc.aio as grpcclient
import tritonclient.http as httpclient

from backends.server import TritonServer, free_port
from build_engines.checkpoints import tiny_checkpoint
from build_engines.cli import main as build_engines
from client.sdk import generation_arrays, infer_inputs
from perf.inputs import photo_like
from perf.llm import LoadSpec, StreamTiming, closed_loop, make_prompts, stream_one
from perf.report import hardware_line, write_table

REFUSALS = ("Exceeds maximum queue size", "retry later")  # Triton's queue policy; backends/core/qos.py
HEADER = ["model", "capacity req/s", "offered req/s", "sent", "served", "served req/s", "refused", "failed",
          "unanswered", "refusal p99 ms", "Triton queue mean ms", "served p50 ms", "served p99 ms", "served max ms",
          "RSS before MB", "RSS peak 1st half MB", "RSS peak 2nd half MB", "RSS after MB"]


@dataclass(frozen=True)
class Scenario:
    model: str
    family: str
    flags: list[str] = field(default_factory=list)


def scenarios(queue: int, prepare_nice: int | None) -> list[Scenario]:
    vit = ["--max-batch-size", "4"]
    per_class = f"high={queue},normal={queue},low={queue}"
    nice = [] if prepare_nice is None else ["--prepare-nice", str(prepare_nice)]
    return [Scenario("vit_ours", "vit", [*vit, "--batch-window", "adaptive", "--qos-max-queued", per_class, *nice]),
            Scenario("llm", "llm", ["--max-batch", "4", "--qos-max-queued", per_class]),
            Scenario("vit_bounded", "vit", [*vit, "--max-queue-size", str(queue)]),
            Scenario("vit_unbounded", "vit", vit)]  # last: the memory it takes stays with the server


class MemoryWatch:
    """Resident memory of a process and its descendants (MB), sampled every `period_s` on a thread."""

    def __init__(self, pid: int, period_s: float = 0.1):
        self.root, self.period_s = psutil.Process(pid), period_s
        self.samples: list[tuple[float, float]] = []  # (time.perf_counter(), MB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> float:
        total = 0
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total / 2**20

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.perf_counter(), self.now()))

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start: float, end: float) -> float:
        return max((mb for t, mb in self.samples if start <= t < end), default=float("nan"))


def payloads(scenario: Scenario, checkpoint: Path, count: int = 8) -> list[dict[str, np.ndarray]]:
    if scenario.family == "vit":  # photos of 1280x960: decoding them is most of the work
        images = []
        for i in range(count):
            buf = io.BytesIO()
            photo_like(1280, 960, seed=i).save(buf, "JPEG", quality=90)
            images.append({"image": np.array([[buf.getvalue()]], dtype=object)})
        return images
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = make_prompts(count, 16, lambda t: tokenizer.encode(t, add_special_tokens=False), tokenizer.decode, seed=1)
    return [generation_arrays(prompt, 32, min_length=32) for prompt in prompts]


async def send_one(client, scenario: Scenario, arrays: dict[str, np.ndarray], timeout_s: float) -> StreamTiming:
    inputs = infer_inputs(grpcclient, arrays)
    if scenario.family == "llm":
        return await asyncio.wait_for(stream_one(client, scenario.model, inputs), timeout_s)
    timing = StreamTiming(time.perf_counter(), [], "")
    try:
        await client.infer(scenario.model, inputs, client_timeout=timeout_s)
    except Exception as e:  # noqa: BLE001  (classified by the caller)
        timing.error = str(e)
    timing.ended = time.perf_counter()
    return timing


async def capacity(url: str, scenario: Scenario, requests: list[dict], concurrency: int, count: int) -> float:
    """Requests/s with `concurrency` in flight (perf.llm's closed loop), after a warm-up of 4 x concurrency."""
    client = grpcclient.InferenceServerClient(url)

    async def send(i: int) -> StreamTiming:
        return await send_one(client, scenario, requests[i % len(requests)], 120)
    try:
        await closed_loop(send, LoadSpec(concurrency, 0, 0, 3 * concurrency))  # warm-up (it adds one round)
        timings = await closed_loop(send, LoadSpec(concurrency, 0, 0, count))
    finally:
        await client.close()
    errors = [t.error for t in timings if t.error]
    assert not errors, errors[0]
    return count / (max(t.ended for t in timings) - min(t.sent for t in timings))


async def open_loop(url: str, scenario: Scenario, requests: list[dict], rate: float, duration_s: float,
                    timeout_s: float) -> list[StreamTiming | None]:
    """Poisson arrivals at `rate` for `duration_s`; None for a request that got no answer within `timeout_s`."""
    rng = np.random.default_rng(7)
    offsets, t = [], 0.0
    while (t := t + rng.exponential(1 / rate)) < duration_s:
        offsets.append(t)
    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()

    async def one(i: int, offset: float) -> StreamTiming | None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        try:
            return await send_one(client, scenario, requests[i % len(requests)], timeout_s)
        except asyncio.TimeoutError:
            return None
    try:
        return await asyncio.gather(*(one(i, offset) for i, offset in enumerate(offsets)))
    finally:
        await client.close()


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def triton_queue(url: str, model: str) -> tuple[int, int]:
    """(requests, nanoseconds) the model's requests spent in Triton's queue before its `execute`, so far."""
    client = httpclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    return int(stats["queue"]["count"]), int(stats["queue"]["ns"])


def run(scenario: Scenario, server: TritonServer, checkpoint: Path, args: argparse.Namespace) -> list:
    requests = payloads(scenario, checkpoint)
    concurrency = 8
    rate_1x = asyncio.run(capacity(server.grpc_url, scenario, requests, concurrency, args.capacity_requests))
    rate = args.load * rate_1x
    print(f"{scenario.model}: capacity {rate_1x:.1f} requests/s, offering {rate:.1f} for {args.duration_s:g} s",
          flush=True)
    queued_before = triton_queue(server.http_url, scenario.model)
    with MemoryWatch(server.process.pid) as memory:
        time.sleep(0.5)
        before = memory.now()
        start = time.perf_counter()
        sent = asyncio.run(open_loop(server.grpc_url, scenario, requests, rate, args.duration_s, args.timeout_s))
        time.sleep(1.0)
        after = memory.now()
    queued = [a - b for a, b in zip(triton_queue(server.http_url, scenario.model), queued_before)]
    half = start + args.duration_s / 2
    answered = [t for t in sent if t is not None]
    refused = [t for t in answered if t.error and any(r in t.error for r in REFUSALS)]
    failed = [t for t in answered if t.error and t not in refused]
    served = [t for t in answered if not t.error]
    if failed:
        print(f"{scenario.model}: {len(failed)} failed, first: {failed[0].error}", flush=True)
    latency = [t.ended - t.sent for t in served]
    served_s = max((t.ended for t in served), default=start) - start
    row = [scenario.model, rate_1x, rate, len(sent), len(served), len(served) / max(served_s, 1e-9), len(refused),
           len(failed),
           len(sent) - len(answered), percentile_ms([t.ended - t.sent for t in refused], 99),
           queued[1] / max(1, queued[0]) / 1e6,
           percentile_ms(latency, 50), percentile_ms(latency, 99), max(latency, default=float("nan")) * 1e3,
           before, memory.peak(start, half), memory.peak(half, start + args.duration_s), after]
    print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.overload", description=__doc__)
    parser.add_argument("--models", nargs="+", help="a subset of the scenarios' models")
    parser.add_argument("--load", type=float, default=4.0, help="x capacity")
    parser.add_argument("--duration-s", type=float, default=10.0, help="of arrivals per model")
    parser.add_argument("--queue", type=int, default=16, help="the bounded queues' length (per class for ours)")
    parser.add_argument("--prepare-nice", type=int, help="vit_ours: its prepare threads' niceness (default: the "
                        "backend's; 0 shows what it is for)")
    parser.add_argument("--capacity-requests", type=int, default=200)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a request unanswered after this is lost")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="vm")
    args = parser.parse_args(argv)
    chosen = [s for s in scenarios(args.queue, args.prepare_nice) if not args.models or s.model in args.models]
    checkpoints = {family: tiny_checkpoint(family, Path(".checkpoints")) for family in {s.family for s in chosen}}
    repository = Path(tempfile.mkdtemp(prefix="overload-"))
    for s in chosen:
        assert build_engines([s.family, "--checkpoint", str(checkpoints[s.family]), "--repository", str(repository),
                              "--name", s.model, "--device", "cpu", *s.flags]) == 0
    rows = []
    with TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-overload.log")) as server:
        for s in chosen:
            rows.append(run(s, server, checkpoints[s.family], args))
    notes = [f"Poisson arrivals at {args.load:g}x each model's capacity (closed loop, 8 in flight, "
             f"{args.capacity_requests} requests) for {args.duration_s:g} s, then the drain; one server for all, "
             f"the models in turn. Bounded queues: {args.queue} requests (Triton's `max_queue_size`; ours per QoS "
             "class). vit: the tiny ViT on 1280x960 JPEGs, batches of 4; llm: the tiny model, 16-token prompts, "
             "32 tokens out, streamed, batches of 4. Refused: UNAVAILABLE; unanswered: no answer within "
             f"{args.timeout_s:g} s. RSS: tritonserver and its stubs together, sampled every 0.1 s.",
             f"Command: `{' '.join(['python -m perf.overload', *(sys.argv[1:] if argv is None else argv)])}` "
             "(`make stress`)."]
    scenario = "overload" + ("" if args.prepare_nice is None else f"-prepare-nice-{args.prepare_nice}")
    write_table(args.results / args.host, scenario, HEADER, rows, hardware_line("2.51.0"), notes)
    print("\n".join(notes))
    return 0 if all(row[7] == 0 and row[8] == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
