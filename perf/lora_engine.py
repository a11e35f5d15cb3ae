"""python -m perf.lora_engine: the engine serving LoRA adapters against the base model, in one run.

Concurrent requests (64 x 128 in / 128 out by default) where the requests use 1, 8 or 64 distinct adapters (rank 16
on every linear layer, random weights in PEFT's layout), each engine with as many device slots as distinct adapters,
each run between two runs of the same load on the base model's engine (loaded once, kept beside it), and base requests
on the 64-slot engine (what enabling LoRA costs requests that use none); batch-1 decode with an adapter against the
base engine; the time to load an adapter (read and checked from disk, then copied into a device slot). Adapters are
in their slots before the timed rounds (every engine runs the whole load once untimed first), so the figures are the
steady state of a server whose adapters fit its slots.
"""
from __future__ import annotations

import argparse
import gc
import json
import socket
import tempfile
import time
from pathlib import Path

import torch

from backends.llm import lora_kernels
from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.lora import PARTS
from backends.llm.model import ModelArgs, checkpoint_tensors
from backends.llm.sampling import SamplingParams
from perf.llm_engine import copy_bandwidth, engine_batch1, engine_concurrent, load_reference, prompts, sync
from perf.report import hardware_line, write_table

MODULES = [m for parts in PARTS.values() for m in parts]


def write_adapters(root: Path, args: ModelArgs, count: int, distinct: int, rank: int) -> list[str]:
    """`count` adapter folders in PEFT's layout; the first `distinct` hold their own random weights, the others are
    links to them inside the root (each name still loads as its own adapter, into its own slot)."""
    from safetensors.torch import save_file

    from backends.llm.adapters import projection_shapes

    shapes = projection_shapes(args)
    names = [f"adapter{i:02d}" for i in range(count)]
    for i, name in enumerate(names[:distinct]):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(args.num_hidden_layers):
            for module in MODULES:
                (n_in, n_out), block = shapes[module], "mlp" if module in PARTS["gate_up_proj"] + ("down_proj",) \
                    else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                a = torch.randn(rank, n_in, generator=generator) / n_in**0.5
                tensors[f"{prefix}.lora_A.weight"] = a.bfloat16()
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=generator) * 0.01).bfloat16()
        (root / name).mkdir(parents=True)
        save_file(tensors, str(root / name / "adapter_model.safetensors"))
        (root / name / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": MODULES, "bias": "none"}))
    for i, name in enumerate(names[distinct:], start=distinct):
        (root / name).symlink_to(root / names[i % distinct], target_is_directory=True)
    return names


def adapters_of(engine: LLMEngine, names: list[str | None]) -> list[tuple]:
    return [engine.choose_adapters(name, []) if name else () for name in names]


def bytes_bound(before: float, after: float, concurrency: int, adapters: list, per_adapter: int,
                bandwidth: float) -> float:
    """Of base, if each decode step only added reading its distinct adapters' bytes at `bandwidth` to the base
    engine's step (tokens/s `before` and `after` the row; a decode step gives `concurrency` tokens)."""
    base = (before + after) / 2
    added_per_token = sum(a is not None for a in adapters) * per_adapter / bandwidth / concurrency
    return 1 / (1 + base * added_per_token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.lora_engine", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path)
    source.add_argument("--random-init", choices=["llama-3-8b"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--distinct", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--batch1-tokens", type=int, default=128)
    parser.add_argument("--pdl", nargs="+", choices=["on", "off"], default=["on"],
                        help="each LoRA engine with its kernels launched with programmatic dependent launch "
                        "(lora_kernels.PDL) and / or without, side by side")
    parser.add_argument("--expand-stages", type=int, nargs="+", default=[lora_kernels.EXPAND_STAGES],
                        help="each LoRA engine with each of these lora_kernels.EXPAND_STAGES (the expand's blocks in "
                        "flight through shared memory, at least 2), side by side")
    parser.add_argument("--profile", action="store_true", help="instead: torch.profiler over the prefill step and the "
                        "first decode steps of the load on the largest engine, with its adapters and without")
    parser.add_argument("--scenario", default="lora-engine")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    checkpoint, reference, weights = load_reference(args, device, torch.bfloat16 if args.dtype == "bf16" else
                                                    torch.float32)
    weights = weights or list(checkpoint_tensors(checkpoint))
    del reference
    model_args = ModelArgs.from_checkpoint(checkpoint)
    root = Path(tempfile.mkdtemp(prefix="lora-adapters-"))
    names = write_adapters(root, model_args, max(args.distinct), min(8, max(args.distinct)), args.rank)
    base_config = dict(dtype=args.dtype, device=str(device), max_batch=args.concurrency, max_lora_rank=args.rank,
                       kv_cache_memory_mb=4096 if device.type == "cuda" else 512, lora_root=str(root),
                       prefix_caching=False)  # every round sends the same prompts: no round may reuse another's KV
    vocab = model_args.vocab_size
    batch = prompts(args.concurrency, args.input_tokens, vocab, seed=2)
    one = prompts(1, args.input_tokens, vocab, seed=1)[0]
    if args.profile:
        return profile(checkpoint, weights, base_config, batch, names[:max(args.distinct)], args.output_tokens)
    columns = ["engine", "requests", "output tokens/s", "base engine before / after, tokens/s", "of base",
               "of base if adapters took only their bytes' time", "batch-1 decode tokens/s (base engine)", "of base",
               "engine ready, s", "adapter load: read + check, ms", "adapter load: into a slot, ms"]
    base_engine = LLMEngine(checkpoint, EngineConfig(**base_config), weights)  # stays: timed around each LoRA run
    engine_concurrent(base_engine, batch, args.output_tokens)  # warm-up

    def base_round() -> float:
        return engine_concurrent(base_engine, batch, args.output_tokens)
    rows = []
    per_adapter = (root / names[0] / "adapter_model.safetensors").stat().st_size
    for slots, pdl, stages in ((slots, pdl, stages) for slots in args.distinct for pdl in args.pdl
                               for stages in args.expand_stages):
        lora_kernels.PDL = pdl == "on"  # read at every launch: this engine's graphs and its eager steps
        lora_kernels.EXPAND_STAGES = stages
        start = time.perf_counter()
        engine = LLMEngine(checkpoint, EngineConfig(**base_config, max_loras=slots), weights)
        sync(device)
        ready = time.perf_counter() - start
        started = time.perf_counter()  # the first adapter's load, timed apart: from disk, then into a device slot
        first = engine.adapters.get(names[0])
        read_ms = (time.perf_counter() - started) * 1e3
        sync(device)
        started = time.perf_counter()
        engine.adapters.release(engine.adapters.acquire([first]))
        sync(device)
        slot_ms = (time.perf_counter() - started) * 1e3
        used = names[:slots]
        engine_concurrent(engine, batch, args.output_tokens, adapters_of(engine, used))  # warm-up; fills the slots
        runs = [(f"{slots} distinct adapters", used)]
        if slots == max(args.distinct):  # what enabling LoRA costs requests that use none
            runs.append(("no adapter", [None]))
        for what, adapters in runs:
            before = base_round()
            tokens_s = engine_concurrent(engine, batch, args.output_tokens, adapters_of(engine, adapters))
            after = base_round()
            one_s = base_1 = None
            if len(adapters) == 1:  # batch 1, against the base engine's right after
                one_s = engine_batch1(engine, one, args.batch1_tokens, adapters_of(engine, adapters)[0])
                base_1 = engine_batch1(base_engine, one, args.batch1_tokens)
            label = f"LoRA, {slots} slots" + ("" if pdl == "on" else ", no PDL") + (
                f", expand stages {stages}" if len(args.expand_stages) > 1 else "")
            rows.append([label, what, f"{tokens_s:.1f}", f"{before:.1f} / {after:.1f}",
                         f"{2 * tokens_s / (before + after):.2f}",
                         f"{bytes_bound(before, after, args.concurrency, adapters, per_adapter, bandwidth):.2f}",
                         "" if one_s is None else f"{one_s:.1f} ({base_1:.1f})",
                         "" if one_s is None else f"{one_s / base_1:.2f}", f"{ready:.1f}", f"{read_ms:.1f}",
                         f"{slot_ms:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    notes = [f"Model: {'random init llama-3-8b shapes' if args.random_init else checkpoint}, {args.dtype}; "
             f"{args.concurrency} requests of {args.input_tokens} random tokens in, {args.output_tokens} out (forced), "
             f"added at once. Device copy bandwidth in this run: {bandwidth / 1e9:.1f} GB/s. The base model's engine "
             "(no LoRA) stays loaded beside each LoRA engine and runs the same load right before and right after it "
             "(\"of base\": over their mean), since these figures drift between engines of one run.",
             f"Adapters: rank {args.rank} on q, k, v, o, gate, up and down of every layer, "
             f"{per_adapter / 2**20:.0f} MiB each in bf16. A step's rows are grouped by adapter into tiles of up to 16 "
             "rows (backends/llm/lora.py, lora_kernels.py): each tile reads its adapter's weights, rows without one read "
             "none. \"no PDL\": the LoRA kernels launched without programmatic dependent launch (lora_kernels.PDL); "
             "\"expand stages N\": lora_kernels.EXPAND_STAGES = N (the expand's blocks in flight through shared "
             "memory).",
             "\"of base if adapters took only their bytes' time\": the base engine's time for the load (its mean "
             "around the row) over that plus, for each decode step, every distinct adapter's "
             f"{per_adapter / 1e6:.1f} MB read once at this run's copy bandwidth: what LoRA kernels reading at that "
             "bandwidth would give."]
    path = write_table(args.results / args.host, args.scenario, columns, rows, hardware_line("n/a (in-process)"), notes)
    print(path.read_text())
    return 0


def profile(checkpoint: Path, weights, config: dict, batch: list[list[int]], names: list[str], tokens: int) -> int:
    """GPU time by kernel of a prefill step and 8 decode steps, for the requests with adapters and without."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    engine = LLMEngine(checkpoint, EngineConfig(**config, max_loras=len(names)), weights)
    for label, adapters in (("64 distinct adapters" if len(names) == 64 else f"{len(names)} adapters", names),
                            ("no adapter", [None])):
        loras = adapters_of(engine, adapters)
        engine_concurrent(engine, batch, tokens, loras)  # warm
        for i, prompt in enumerate(batch):
            engine.add(prompt, SamplingParams(max_tokens=tokens, min_tokens=tokens), lora=loras[i % len(loras)])
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in range(9):  # the prefill, then decode steps
                started = time.perf_counter()
                engine.step()
                sync(engine.device)
                print(f"{label}: step {step} {(time.perf_counter() - started) * 1e3:.1f} ms", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
        while engine.has_work:
            engine.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
