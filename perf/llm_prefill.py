"""python -m perf.llm_prefill: what chunked prefill and prefix caching do for the engine in process.

1. Interference: `--streams` sequences decode; then long prompts (`--long-tokens`) arrive one every
   `--arrival-steps` steps. Reported: the running streams' inter-token latency (every step's wall time while they
   decode: p50, p99, max) and the long prompts' time to first token, with chunked prefill (`chunk_tokens`) and with
   prompts prefilled whole in steps of their own, one engine after the other on the same weights.
2. Prefix caching: time to first token of a long prompt, then of another sharing all but its last `--suffix-tokens`
   tokens (a system prompt, an image): prefix caching on and off.
Weights: the tiny checkpoint, or Llama-3-8B shapes with random bf16 weights (`--random-init llama-3-8b`).
"""
from __future__ import annotations

import argparse
import gc
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.model import checkpoint_tensors
from backends.llm.sampling import SamplingParams
from perf.llm_engine import load_reference, prompts, sync
from perf.report import hardware_line, write_table


def timed_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    sync(engine.device)
    return time.perf_counter() - start


def interference(engine: LLMEngine, args) -> dict[str, float]:
    """Inter-token latency of running streams while long prompts arrive, and those prompts' time to first token."""
    vocab = engine.model.args.vocab_size
    steps = 10 + args.long_prompts * (args.arrival_steps + args.long_tokens // 8 + 2)  # more than the run takes
    lasting = SamplingParams(max_tokens=(n := min(steps, engine.max_model_len - 128)), min_tokens=n)
    streams = [engine.add(p, lasting) for p in prompts(args.streams, 128, vocab, seed=4)]
    while any(not s.output_ids for s in streams):
        engine.step()
    warm = engine.add(prompts(1, args.long_tokens, vocab, seed=8)[0], SamplingParams(max_tokens=1))
    while not warm.finished:
        engine.step()  # a long prompt beside the streams once, untimed: first-use costs (compiles) paid here
    for _ in range(5):
        engine.step()  # every stream decoding; graphs warm
    itl, ttft, pending = [], [], {}
    for i, prompt in enumerate(prompts(args.long_prompts, args.long_tokens, vocab, seed=5)):
        for _ in range(args.arrival_steps if i else 0):
            itl.append(timed_step(engine))
        pending[engine.add(prompt, SamplingParams(max_tokens=1))] = time.perf_counter()
        while any(not s.output_ids for s in pending):
            itl.append(timed_step(engine))
            for seq in [s for s in pending if s.output_ids]:
                ttft.append(time.perf_counter() - pending.pop(seq))
    if any(s.finished for s in streams):
        raise RuntimeError("streams finished before the long prompts were served: raise max_model_len")
    for seq in streams:
        engine.cancel(seq)
    ms = sorted(1e3 * t for t in itl)
    return dict(itl_p50=statistics.median(ms), itl_p99=ms[int(0.99 * (len(ms) - 1))], itl_max=ms[-1],
                ttft=1e3 * statistics.median(ttft))


def prefix_ttft(engine: LLMEngine, args, seed: int = 6) -> tuple[float, float]:
    """ms to the first token of a long prompt, then of one sharing all but its last --suffix-tokens tokens."""
    (prompt,) = prompts(1, args.long_tokens, engine.model.args.vocab_size, seed=seed)
    (suffix,) = prompts(1, args.suffix_tokens, engine.model.args.vocab_size, seed=seed + 1)
    times = []
    for ids in (prompt, prompt[:-args.suffix_tokens] + suffix):
        sync(engine.device)
        start = time.perf_counter()
        engine.generate([ids], SamplingParams(max_tokens=1))
        sync(engine.device)
        times.append(1e3 * (time.perf_counter() - start))
    return times[0], times[1]


def profile_warm_step(engine: LLMEngine, args) -> None:
    """torch.profiler over the step of a prompt whose prefix is cached: the GPU's time against the host's."""
    from torch.profiler import ProfilerActivity, profile

    (prompt,) = prompts(1, args.long_tokens, engine.model.args.vocab_size, seed=90)
    engine.generate([prompt], SamplingParams(max_tokens=1))
    engine.add(prompt[:-args.suffix_tokens] + prompts(1, args.suffix_tokens, engine.model.args.vocab_size, seed=91)[0],
               SamplingParams(max_tokens=1))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.step()
        sync(engine.device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def diagnostics(device: torch.device) -> str:
    """What makes host-bound eager steps slower between runs: torch.compile graphs made so far (each a cache entry
    its guards check on every call) and the CUDA allocator's retries (frees and mallocs when its cache runs short)."""
    from torch._dynamo.utils import counters

    text = f"torch.compile graphs so far: {counters['stats']['unique_graphs']}"
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        text += (f"; CUDA allocator: {stats.get('num_alloc_retries', 0)} retries, "
                 f"{stats.get('num_device_alloc', 0)} device allocations")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.llm_prefill", description=__doc__)
    parser.add_argument("--random-init", choices=["llama-3-8b"])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=2048)
    parser.add_argument("--arrival-steps", type=int, default=20)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's summary of one warm "
                        "prefix step (GPU time against host time)")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    command = " ".join(["python -m perf.llm_prefill", *(sys.argv[1:] if argv is None else argv)])
    device = torch.device(args.device)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    checkpoint, reference, weights = load_reference(args, device, torch.bfloat16 if dtype == "bf16" else torch.float32)
    weights = weights or list(checkpoint_tensors(checkpoint))
    del reference
    base = dict(dtype=dtype, device=str(device), max_batch=max(64, args.streams + args.long_prompts),
                kv_cache_memory_mb=16384 if device.type == "cuda" else 512)
    rows, found, checks = [], {}, []
    for label, overrides in [(f"chunked prefill ({args.chunk_tokens} tokens a step)",
                              dict(chunk_tokens=args.chunk_tokens)), ("whole prompts in steps of their own",
                                                                      dict(chunk_tokens=None))]:
        engine = LLMEngine(checkpoint, EngineConfig(**base, **overrides, prefix_caching=False), weights)
        engine.generate(prompts(2, 64, engine.model.args.vocab_size, seed=3), SamplingParams(max_tokens=4))
        found[label] = interference(engine, args)
        print(label, found[label], flush=True)
        checks.append(f"after `{label}`: {diagnostics(device)}")
        rows.append([label, *(f"{found[label][k]:.1f}" for k in ("itl_p50", "itl_p99", "itl_max", "ttft"))])
        del engine
        gc.collect()
    prefix_rows = []
    for caching in (True, False):
        engine = LLMEngine(checkpoint, EngineConfig(**base, prefix_caching=caching), weights)
        engine.generate(prompts(2, 64, engine.model.args.vocab_size, seed=3), SamplingParams(max_tokens=4))
        prefix_ttft(engine, args, seed=60)  # untimed: first-use costs of both paths
        cold, warm = prefix_ttft(engine, args)
        if caching and args.profile:
            profile_warm_step(engine, args)
        print("prefix caching", caching, cold, warm, flush=True)
        checks.append(f"after prefix caching {'on' if caching else 'off'}: {diagnostics(device)}")
        prefix_rows.append([f"prefix caching {'on' if caching else 'off'}", f"{cold:.1f}", f"{warm:.1f}",
                            f"{warm / cold:.2f}"])
        del engine
        gc.collect()
    model = "random init llama-3-8b shapes" if args.random_init else args.checkpoint or "the tiny checkpoint"
    notes = [f"Model: {model}, {dtype}, in process on {device}. Interference: {args.streams} streams decoding "
             f"(128-token prompts), then {args.long_prompts} prompts of {args.long_tokens} tokens, one every "
             f"{args.arrival_steps} steps; ITL = wall time of each step while the streams decode (prefix caching off).",
             *checks, f"Command: `{command}`."]
    hardware = hardware_line("n/a (in-process)")
    path = write_table(args.results / args.host, "llm-chunked-prefill", ["engine", "running streams ITL p50 ms",
                                                                         "ITL p99 ms", "ITL max ms",
                                                                         "long prompt TTFT p50 ms"],
                       rows, hardware, notes)
    print(path.read_text())
    path = write_table(args.results / args.host, "llm-prefix-cache", [
        "engine", f"TTFT of a {args.long_tokens}-token prompt, ms",
        f"TTFT of one sharing all but its last {args.suffix_tokens} tokens, ms", "second / first"],
        prefix_rows, hardware, [f"Model: {model}, {dtype}, in process on {device}; one request at a time.",
                                notes[-1]])
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
