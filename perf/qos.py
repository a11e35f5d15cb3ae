"""python -m perf.qos: a mixed load with QoS classes beside the same engine first come first served, in one server and
one run per model family: short chats and long prompts to `llm`, small images and 4K photos to `vlm`, short and long
clips to `whisper`.

For each family two models are built from one checkpoint: `<family>_qos` (the default QoS settings) and
`<family>_fifo` (cost weights zero, queues unbounded, every request in the default class: first come first served,
what the engines did before QoS). The cheap kind of request is sent in class high, the heavy kind in class low. The
mix's capacity (requests/s) is measured first, closed-loop; then open-loop Poisson arrivals at a light load and at 1x
and 2x of that capacity go to each model in turn, on the same arrival schedule. `--variant NAME=FLAGS` adds a model
`<family>_qos_NAME` (the QoS defaults and FLAGS) measured the same way, so settings compare side by side in one run.
Reported per model, load and class:
requests sent, done and refused (UNAVAILABLE), time to first token (whisper: its whole answer) and latency p50 / p99,
the longest wait before the first token.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient

from backends.llm.engine import EngineConfig
from backends.server import TritonServer, free_port
from build_engines.cli import main as build_engines
from client.sdk import generation_arrays, infer_inputs
from perf import ttft_split
from perf.llm import StreamTiming, make_prompts, stream_one
from perf.report import hardware_line, write_table
from perf.server_metrics import engine_steps, model_metrics

FIFO_FLAGS = ["--qos-weights", "image=0,audio=0,text=0", "--qos-max-queued", "high=1000000,normal=1000000,low=1000000",
              "--qos-timeout-s", "high=1e9,normal=1e9,low=1e9"]
# per family: flags of both models. llm, vlm: no prefix cache (and vlm no feature cache), so that every prompt and
# photo costs what a new one does (the mix cycles through 16 of each; with the cache a 256-token prompt computed one
# token); vlm on a GPU decodes images there (what a 4K photo needs); whisper: our batcher (Triton's dynamic batcher
# knows no QoS), with its adaptive window
FAMILY_FLAGS = {"llm": ["--prefix-caching", "false"], "vlm": ["--image-cache", "0", "--prefix-caching", "false"],
                "whisper": ["--batch-window", "adaptive"]}
HEADER = ["model", "load (x capacity)", "class", "sent", "done", "refused", "TTFT p50 ms", "TTFT p99 ms",
          "latency p50 ms", "latency p99 ms", "longest TTFT ms"]
DISTINCT = 16  # different payloads of each kind, sent in turn


@dataclass(frozen=True)
class Kind:
    """One kind of request in a family's mix."""

    name: str
    qos_class: str
    share: float
    output_tokens: int
    input_tokens: int = 0  # text prompt
    image: tuple[int, int] | None = None  # width, height of a photo-like JPEG
    audio_s: float = 0.0

    def describe(self) -> str:
        size = (f"{self.image[0]}x{self.image[1]} JPEG + {self.input_tokens} tokens" if self.image else
                f"{self.audio_s:g} s of audio" if self.audio_s else f"{self.input_tokens} tokens")
        return f"{self.name} ({self.qos_class}, {size} in / {self.output_tokens} out, {self.share:.0%})"


MIXES = {
    "llm": [Kind("chat", "high", 0.2, 16, 16), Kind("long prompt", "low", 0.8, 32, 256)],
    "vlm": [Kind("small image", "high", 0.2, 16, 16, image=(336, 336)),
            Kind("4K photo", "low", 0.8, 32, 16, image=(3840, 2160))],
    "whisper": [Kind("short clip", "high", 0.2, 16, audio_s=5.0), Kind("long clip", "low", 0.8, 84, audio_s=28.0)],
}


@dataclass
class Sent:
    kind: Kind
    timing: StreamTiming


def payloads(family: str, kind: Kind, checkpoint: Path, seed: int) -> list[dict[str, np.ndarray]]:
    """`DISTINCT` request tensors of one kind (prompts, images and clips differ between them)."""
    if family == "whisper":
        from perf.whisper_bench import speech_like
        return [{"audio": np.array([[speech_like(kind.audio_s, seed * 100 + i)]], dtype=object),
                 "language": np.array([[b"en"]], dtype=object),
                 "max_tokens": np.array([[kind.output_tokens]], dtype=np.int32)} for i in range(DISTINCT)]
    from transformers import AutoTokenizer

    from perf.inputs import photo_like
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = make_prompts(DISTINCT, kind.input_tokens, lambda t: tokenizer.encode(t, add_special_tokens=False),
                           tokenizer.decode, seed=seed)
    images = [None] * DISTINCT
    if kind.image:
        images = []
        for i in range(DISTINCT):
            buf = io.BytesIO()
            photo_like(*kind.image, seed=seed * 100 + i).save(buf, "JPEG", quality=90)
            images.append(buf.getvalue())
    return [generation_arrays(prompt, kind.output_tokens, image=image, min_length=kind.output_tokens)
            for prompt, image in zip(prompts, images)]


async def send_one(client, family: str, model: str, arrays: dict[str, np.ndarray],
                   parameters: dict | None) -> StreamTiming:
    """One request; generating models stream (their first token timed), whisper answers once."""
    inputs = infer_inputs(grpcclient, arrays)
    if family != "whisper":
        return await stream_one(client, model, inputs, parameters)
    timing = StreamTiming(time.perf_counter(), [], "")
    try:
        result = await client.infer(model, inputs, parameters=parameters)
        timing.text = result.as_numpy("text").reshape(-1)[0].decode()
    except Exception as e:  # noqa: BLE001 - refusals are counted, other errors raised by class_rows
        timing.error = str(e)
    timing.ended = time.perf_counter()
    timing.arrivals = [] if timing.error else [timing.ended]
    return timing


def poisson_schedule(rate: float, duration_s: float, mix: list[Kind], seed: int) -> list[tuple[float, Kind, int]]:
    """(offset s, kind, payload index) of open-loop arrivals."""
    rng = np.random.default_rng(seed)
    shares = np.array([k.share for k in mix]) / sum(k.share for k in mix)
    schedule, t = [], 0.0
    while (t := t + rng.exponential(1 / rate)) < duration_s:
        schedule.append((t, mix[rng.choice(len(mix), p=shares)], len(schedule) % DISTINCT))
    return schedule


async def send_schedule(url: str, family: str, model: str, schedule: list[tuple[float, Kind, int]],
                        requests: dict[str, list[dict]], qos: bool) -> list[Sent]:
    """Each item sent at its offset from now (open loop), with its class when `qos`."""
    client = grpcclient.InferenceServerClient(url)
    start = time.perf_counter()

    async def one(offset: float, kind: Kind, index: int) -> Sent:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        parameters = {"qos_class": kind.qos_class} if qos else None
        return Sent(kind, await send_one(client, family, model, requests[kind.name][index], parameters))

    try:
        return await asyncio.gather(*(one(*item) for item in schedule))
    finally:
        await client.close()


def capacity(url: str, family: str, model: str, mix: list[Kind], requests: dict[str, list[dict]], concurrency: int,
             count: int) -> float:
    """Requests/s of the mix with `concurrency` kept in flight (closed loop)."""
    async def run() -> float:
        client = grpcclient.InferenceServerClient(url)
        items = iter(poisson_schedule(1e6, count / 1e6, mix, seed=1))

        async def worker():
            for _, kind, index in items:
                timing = await send_one(client, family, model, requests[kind.name][index], None)
                assert timing.error is None, timing.error
        try:
            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return count / (time.perf_counter() - start)
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
            raise RuntimeError(f"{len(failed)} {qos_class} requests to {model} failed, first: {failed[0].error}")
        ttft = np.array([t.arrivals[0] - t.sent for t in done] or [np.nan]) * 1e3
        latency = np.array([t.ended - t.sent for t in done] or [np.nan]) * 1e3
        rows.append([model, load, qos_class, len(mine), len(done), len(refused),
                     *(float(np.percentile(v, q)) for v in (ttft, latency) for q in (50, 99)), float(np.max(ttft))])
    return rows


def run_family(family: str, checkpoint: Path, args: argparse.Namespace) -> tuple[list[list], list[str]]:
    """Build `<family>_qos` and `<family>_fifo`, serve them, measure capacity, then every load on each."""
    repository = Path(tempfile.mkdtemp(prefix=f"qos-bench-{family}-"))
    models = {f"{family}_qos": [], f"{family}_fifo": FIFO_FLAGS,
              **{f"{family}_qos_{name}": flags for name, flags in args.variant}}
    for name, extra in models.items():
        assert build_engines([family, "--checkpoint", str(checkpoint), "--repository", str(repository), "--name", name,
                              "--device", args.device, "--max-batch", str(args.max_batch), *FAMILY_FLAGS[family],
                              *(["--precision", args.precision] if args.precision else []),
                              *(["--preprocess-on-device", "true"]
                                if family == "vlm" and args.device == "cuda" else []),
                              *extra, *args.engine_flags,
                              *(["--kv-cache-memory-mb", str(args.kv_cache_memory_mb)]
                                if args.kv_cache_memory_mb and family != "whisper" else [])]) == 0
    mix = MIXES[family]
    requests = {k.name: payloads(family, k, checkpoint, seed=i) for i, k in enumerate(mix)}
    concurrency = 2 * args.max_batch
    rows, steps = [], []
    log = Path(f"logs/bench-qos-{family}.log")
    # streaming families: Triton traces one request in TRACE_RATE and the engines log their spans, so the high class's
    # TTFT can be split by stage (perf.ttft_split)
    traced = {} if family == "whisper" else {"trace_file": Path(tempfile.mkdtemp(prefix="qos-trace-")) / "trace.json",
                                             "trace_rate": ttft_split.TRACE_RATE}
    with TritonServer(repository, free_port(), free_port(), free_port(), log, **traced) as server:
        for model in models:  # warm-up: each engine's first steps compile kernels
            capacity(server.grpc_url, family, model, mix, requests, concurrency, 8 * concurrency)
        given = dict(item.split("=", 1) for item in args.capacity)
        rate = float(given[family]) if family in given else \
            capacity(server.grpc_url, family, f"{family}_fifo", mix, requests, concurrency, 8 * concurrency)
        print(f"{family} capacity: {rate:.2f} requests/s{' (given)' if family in given else ''}", flush=True)
        for load in args.loads:
            high = sum(k.share for k in mix if k.qos_class == "high") / sum(k.share for k in mix)
            duration = max(args.duration_s, args.min_high / (load * rate * high))  # enough for a p99 (see --min-high)
            schedule = poisson_schedule(load * rate, duration, mix, seed=int(load * 1000))
            for model in models:
                before, start = model_metrics(server.metrics_url, model), time.perf_counter()
                sent = asyncio.run(send_schedule(server.grpc_url, family, model, schedule, requests,
                                                 qos=not model.endswith("_fifo")))
                if family != "whisper":
                    steps.append(f"`{model}` at {load:g}x: " + engine_steps(
                        before, model_metrics(server.metrics_url, model), time.perf_counter() - start))
                    time.sleep(0.5)  # the engine loop logs a request's spans after its final response
                    high = [s.timing for s in sent if s.kind.qos_class == "high"]
                    if split := ttft_split.describe(ttft_split.stage_ms(high, server.trace_file), slowest=True):
                        steps[-1] += f"; high class: {split}"
                    print(steps[-1], flush=True)
                rows += class_rows(model, load, sent, sorted({k.qos_class for k in mix}))
                for row in rows[-len(mix):]:
                    print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in row), flush=True)
    by = {(r[0], r[1], r[2]): r for r in rows}
    light, heavy = min(args.loads), max(args.loads)
    measured = "given (--capacity)" if family in given else f"closed loop, {concurrency} in flight"
    notes = [f"`{family}`: capacity of the mix {rate:.2f} requests/s ({measured}); mix: "
             f"{', '.join(k.describe() for k in mix)}; {checkpoint.name}."]
    for model in models:
        p99 = by[model, heavy, "high"][9] / by[model, light, "high"][9]
        notes.append(f"`{model}`: high-class latency p99 at {heavy:g}x capacity = {p99:.2f}x its p99 at {light:g}x.")
    if steps:
        notes += ["", "Engine steps while each schedule ran (its llm_* counters):", "", *(f"- {s}" for s in steps)]
    return rows, notes


def variant(spec: str) -> tuple[str, list[str]]:
    """'NAME=FLAGS' -> (NAME, the flags split as a shell would, and at a '+' before '--', so that a variant of several
    flags needs no spaces: 'rides=--qos-lower-rides=true+--prompt-rows=64')."""
    name, _, flags = spec.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9_]+", name) or not flags.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=FLAGS with NAME of letters, digits and _; got {spec!r}")
    return name, [flag for part in re.split(r"\+(?=--)", flags) for flag in shlex.split(part)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.qos", description=__doc__)
    parser.add_argument("--families", nargs="+", choices=sorted(MIXES), default=["llm", "vlm", "whisper"])
    parser.add_argument("--checkpoint", action="append", default=[], metavar="FAMILY=PATH",
                        help="a family's checkpoint (default: its tiny test model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", help="build_engines --precision (default: its default for the family)")
    parser.add_argument("--max-batch", type=int, default=4, help="the engines' batch (small: queues form on CPU)")
    parser.add_argument("--kv-cache-memory-mb", type=int, help="per LLM engine (two share the device)")
    parser.add_argument("--engine-flags", nargs=argparse.REMAINDER, default=[],
                        help="more build_engines flags for every model (last on the line), e.g. --chunk-tokens 256")
    parser.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME=FLAGS",
                        help="one more QoS model with these build_engines flags, e.g. rides=--qos-lower-rides=true")
    parser.add_argument("--capacity", action="append", default=[], metavar="FAMILY=REQUESTS_PER_S",
                        help="a family's capacity, not measured: the same load for two commits on a machine whose "
                        "speed drifts")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.25, 1.0, 2.0], help="x capacity")
    parser.add_argument("--duration-s", type=float, default=15.0, help="arrivals per load and model, at least")
    parser.add_argument("--min-high", type=int, default=100, help="a load's arrivals last until about this many "
                        "high-class requests are expected (the p99 of 10 requests is their maximum; the light load "
                        "needs longer than the heavy one)")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="vm")
    args = parser.parse_args(argv)
    from build_engines.checkpoints import tiny_checkpoint
    checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
    rows, notes = [], []
    for family in args.families:
        checkpoint = Path(checkpoints[family]) if family in checkpoints else \
            tiny_checkpoint(family, Path(".checkpoints"))
        family_rows, family_notes = run_family(family, checkpoint, args)
        rows += family_rows
        notes += family_notes
    llm = EngineConfig()  # the LLM engines' defaults, as the `*_qos` models run them
    notes.append(f"Poisson arrivals for {args.duration_s:g} s per load and model, or longer where fewer than "
                 f"{args.min_high} high-class requests would be sent, the same schedule for the models of "
                 f"a family. Engines: max_batch {args.max_batch}"
                 f"{', ' + ' '.join(args.engine_flags) if args.engine_flags else ''}. `*_qos`: default QoS settings "
                 "(aging bounds high 1 s / normal 5 s / low 30 s, queue limits 256 / 512 / 512; LLM engines: while a "
                 f"higher class runs, lower-class prompts start in at most {llm.qos_lower_share:.0%} of the engine's "
                 f"time, in steps of at most {llm.qos_lower_tokens} prompt tokens and of what recent prefill steps "
                 f"computed in {llm.qos_lower_step_ms:g} ms); `*_fifo`: cost "
                 "weights 0, unbounded queues, no class sent (first come first served).")
    notes.append(f"Command: `python -m perf.qos {' '.join(sys.argv[1:] if argv is None else argv)}`.")
    scenario = "qos-mixed-load" + ("" if set(args.families) == set(MIXES) else "-" + "-".join(args.families))
    write_table(args.results / args.host, scenario, HEADER, rows, hardware_line("2.51.0"), notes)
    print("\n".join(notes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
