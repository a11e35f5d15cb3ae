"""python -m perf.qos: a mixed load on the served `llm` with QoS classes beside the same engine first come first
served, in one server and one run.

Two models are built from one checkpoint: `llm_qos` (the default QoS settings) and `llm_fifo` (cost weights zero,
queues unbounded, every request in the default class: first come first served, what the engine did before QoS).
The load mixes short chats (class high) and long prompts (class low). Its capacity (requests/s) is measured first,
closed-loop; then open-loop Poisson arrivals at a light load and at 1x and 2x of that capacity go to each model in
turn, on the same arrival schedule. Reported per model, load and class: requests sent, done and refused (UNAVAILABLE),
time to first token and latency p50 / p99, the longest wait before the first token.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient

from backends.server import TritonServer, free_port
from build_engines.cli import main as build_engines
from client.sdk import generation_inputs
from perf.llm import StreamTiming, make_prompts, stream_one
from perf.report import hardware_line, write_table

MODELS = {"llm_qos": [], "llm_fifo": ["--qos-weights", "image=0,audio=0,text=0",
                                      "--qos-max-queued", "high=1000000,normal=1000000,low=1000000",
                                      "--qos-timeout-s", "high=1e9,normal=1e9,low=1e9"]}
HEADER = ["model", "load (x capacity)", "class", "sent", "done", "refused", "TTFT p50 ms", "TTFT p99 ms",
          "latency p50 ms", "latency p99 ms", "longest TTFT ms"]


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix."""

    name: str
    qos_class: str
    input_tokens: int
    output_tokens: int
    share: float


MIX = [Kind("chat", "high", 16, 16, 0.2), Kind("long prompt", "low", 256, 32, 0.8)]


@dataclass
class Sent:
    kind: Kind
    timing: StreamTiming


async def send_schedule(url: str, model: str, schedule: list[tuple[float, Kind, str]], qos: bool) -> list[Sent]:
    """Each (offset s, kind, prompt) sent at its offset from now on its own stream (open loop)."""
    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()

    async def one(offset: float, kind: Kind, prompt: str) -> Sent:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        inputs = generation_inputs(grpcclient, prompt, kind.output_tokens, min_length=kind.output_tokens)
        return Sent(kind, await stream_one(client, model, inputs, {"qos_class": kind.qos_class} if qos else None))

    try:
        return await asyncio.gather(*(one(*item) for item in schedule))
    finally:
        await client.close()


def poisson_schedule(rate: float, duration_s: float, mix: list[Kind], prompts: dict[str, list[str]],
                     seed: int) -> list[tuple[float, Kind, str]]:
    rng = np.random.default_rng(seed)
    shares = np.array([k.share for k in mix]) / sum(k.share for k in mix)
    schedule, t = [], 0.0
    while (t := t + rng.exponential(1 / rate)) < duration_s:
        kind = mix[rng.choice(len(mix), p=shares)]
        schedule.append((t, kind, prompts[kind.name][len(schedule) % len(prompts[kind.name])]))
    return schedule


def capacity(url: str, model: str, mix: list[Kind], prompts: dict[str, list[str]], concurrency: int,
             requests: int) -> float:
    """Requests/s of the mix, `concurrency` kept in flight (closed loop)."""
    async def run() -> float:
        client = grpcclient.InferenceServerClient(url)
        items = iter(poisson_schedule(1e6, requests / 1e6, mix, prompts, seed=1))

        async def worker():
            for _, kind, prompt in items:
                inputs = generation_inputs(grpcclient, prompt, kind.output_tokens, min_length=kind.output_tokens)
                timing = await stream_one(client, model, inputs)
                assert timing.error is None, timing.error
        try:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return requests / (time.perf_counter() - start)
        finally:
            await client.close()
    return asyncio.run(run())


def class_rows(model: str, load: float, sent: list[Sent], classes: list[str]) -> list[list]:
    rows = []
    for qos_class in classes:
        mine = [s.timing for s in sent if s.kind.qos_class == qos_class]
        done = [t for t in mine if t.error is None and t.arrivals]
        refused = [t for t in mine if t.error and "retry later" in t.error]  # backends/core/qos.py's refusals
        failed = [t for t in mine if t.error and t not in refused]
        if failed:
            raise RuntimeError(f"{len(failed)} {qos_class} requests failed, first: {failed[0].error}")
        ttft = np.array([t.arrivals[0] - t.sent for t in done] or [np.nan]) * 1e3
        latency = np.array([t.ended - t.sent for t in done] or [np.nan]) * 1e3
        rows.append([model, load, qos_class, len(mine), len(done), len(refused),
                     *(float(np.percentile(v, q)) for v in (ttft, latency) for q in (50, 99)), float(np.max(ttft))])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.qos", description=__doc__)
    parser.add_argument("--checkpoint", type=Path, help="LLM checkpoint (default: the tiny test model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-batch", type=int, default=4, help="the engines' batch (small: queues form on CPU)")
    parser.add_argument("--kv-cache-memory-mb", type=int, help="per engine (two share the device)")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.25, 1.0, 2.0], help="x capacity")
    parser.add_argument("--duration-s", type=float, default=15.0, help="arrivals per load and model")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="vm")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from build_engines.checkpoints import tiny_checkpoint
    checkpoint = args.checkpoint or tiny_checkpoint("llm", Path(".checkpoints"))
    repository = Path(tempfile.mkdtemp(prefix="qos-bench-"))
    for name, extra in MODELS.items():
        assert build_engines(["llm", "--checkpoint", str(checkpoint), "--repository", str(repository), "--name", name,
                              "--device", args.device, "--max-batch", str(args.max_batch), *extra,
                              *(["--kv-cache-memory-mb", str(args.kv_cache_memory_mb)] if args.kv_cache_memory_mb
                                else [])]) == 0
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    mix = MIX
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = {k.name: make_prompts(32, k.input_tokens, encode, tokenizer.decode, seed=i) for i, k in enumerate(mix)}
    rows, notes = [], []
    with TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-qos.log")) as server:
        for model in MODELS:  # warm-up: each engine's first steps compile kernels
            capacity(server.grpc_url, model, mix, prompts, 2 * args.max_batch, 16 * args.max_batch)
        rate = capacity(server.grpc_url, "llm_fifo", mix, prompts, 2 * args.max_batch, 16 * args.max_batch)
        print(f"capacity: {rate:.2f} requests/s", flush=True)
        for load in args.loads:
            schedule = poisson_schedule(load * rate, args.duration_s, mix, prompts, seed=int(load * 1000))
            for model in MODELS:
                sent = asyncio.run(send_schedule(server.grpc_url, model, schedule, qos=model == "llm_qos"))
                rows += class_rows(model, load, sent, sorted({k.qos_class for k in mix}))
                for row in rows[-len(mix):]:
                    print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row), flush=True)
    by = {(r[0], r[1], r[2]): r for r in rows}
    light, heavy = min(args.loads), max(args.loads)
    for model in MODELS:
        p99 = by[model, heavy, "high"][9] / by[model, light, "high"][9]
        notes.append(f"`{model}`: high-class latency p99 at {heavy:g}x capacity = {p99:.2f}x its p99 at {light:g}x.")
    notes.insert(0, f"Capacity of the mix: {rate:.2f} requests/s (closed loop, {2 * args.max_batch} in flight). "
                    f"Mix: {', '.join(f'{k.name} ({k.qos_class}, {k.input_tokens} in / {k.output_tokens} out, {k.share:.0%})' for k in mix)}; "
                    f"Poisson arrivals for {args.duration_s:g} s per load and model, the same schedule for both models. "
                    f"Engines: max_batch {args.max_batch}, {checkpoint.name}. `llm_qos`: default QoS settings "
                    "(aging bounds high 1 s / normal 5 s / low 30 s, queue limits 256 / 512 / 512); `llm_fifo`: "
                    "cost weights 0, unbounded queues, no class sent (first come first served).")
    write_table(args.results / args.host, "qos-mixed-load", HEADER, rows, hardware_line("2.51.0"), notes)
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
