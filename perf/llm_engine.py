"""python -m perf.llm_engine: the LLM engine in process, beside transformers `generate` in the same run.

1. copy bandwidth of the device (a large device-to-device copy; bytes read + written), the ceiling of decoding;
2. decode tokens/s at batch 1 against the roofline = bandwidth / bytes one decode step must read (every weight
   except the embedding table, plus the sequence's KV cache), and transformers at batch 1;
3. total output tokens/s of N concurrent requests of I input and O output tokens: the engine (continuous batching,
   all requests added at once) against transformers `generate` with one static batch of N.
Output lengths are forced (min_tokens = max_tokens, transformers' min_new_tokens) so both produce the same tokens
count. Weights: a local checkpoint, the tiny one, or a real-size random init (`--random-init llama-3-8b`).

`--variants bf16:paged:library,bf16:paged,fp8:paged` compares instead engines on the same weights with each other, one
after the other in the same run: PRECISION:ATTENTION[:LINEAR[:OPTION+...]] (OPTIONS below), bf16 or
quantized to FP8 E4M3 (per-channel weights; `fp8`: per-token activations, `fp8w`: weights only, activations in bf16;
backends/llm/fp8.py), decode attention by the paged Triton kernel or gather + SDPA, one-token linear layers by the
GEMV kernels of backends/llm/gemv.py (default) or the library (cuBLAS); decode tokens/s at batch 1, the concurrent
run, the graph step, and the time each engine takes to be ready. `--dtype fp8` = bf16:paged,fp8:paged.
"""
from __future__ import annotations

import argparse
import gc
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from backends.core.devices import DTYPES
from backends.llm.engine import EngineConfig, EngineStats, LLMEngine
from backends.llm import fp8, fp8_gemm, gemv, runner
from backends.llm.fp8 import Fp8Scheme
from backends.llm.model import checkpoint_tensors
from backends.llm.sampling import SamplingParams
from build_engines.checkpoints import byte_level_tokenizer, tiny_checkpoint
from build_engines.quantize import quantized_tensors, write_fp8_metadata
from perf.report import hardware_line, write_table
from perf.step_profile import describe, profile_decode

OPTIONS = {"overlap",  # overlap_steps on
           "swap",  # FP8 GEMMs of 2+ rows swapped (fp8_gemm.SWAP_FROM_ROWS)
           "w8a8gemm",  # W8A8 steps of 2-256 rows by fp8_gemm.py on FP8 inputs, not cuBLAS (fp8.W8A8_GEMM_MAX_ROWS)
           "whole",  # decode graphs captured whole, not in pieces (runner.GRAPH_PIECES)
           "ramp",  # decode graphs in pieces of 1, 2, 4, ... layers (runner.GRAPH_RAMP)
           "pdl",  # every GEMV launched with PDL, not only those after a prepare kernel (gemv.PDL_UNPREPARED)
           "pdlattn",  # rotary + cache write, paged decode attention and o_proj's GEMV with PDL (gemv.PDL_ATTENTION)
           "lmhead"}  # FP8 variants: the LM head in FP8 too (build_engines --fp8-lm-head)
LLAMA_3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, repeats: int = 10) -> float:
    """Bytes/s moved by a device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def decode_bytes(engine: LLMEngine, context: int) -> int:
    """Bytes one batch-1 decode step reads: all weights but the embedding table (one row of it), plus the KV cache."""
    model, args = engine.model, engine.model.args
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    if model.lm_head.weight is model.embed_tokens.weight:
        weights += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    kv = 2 * args.num_hidden_layers * context * args.num_key_value_heads * args.head_dim * engine.dtype.itemsize
    return weights + kv


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (count, length), generator=generator).tolist()


def engine_batch1(engine: LLMEngine, prompt: list[int], new_tokens: int, lora: tuple = ()) -> float:
    """Decode tokens/s of one sequence (the prefill step is not counted); `lora`: its adapters."""
    seq = engine.add(prompt, SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens), lora=lora)
    engine.step()  # prefill
    sync(engine.device)
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    sync(engine.device)
    return (len(seq.output_ids) - 1) / (time.perf_counter() - start)


def engine_concurrent(engine: LLMEngine, batch: list[list[int]], new_tokens: int,
                      loras: list[tuple] = ((),)) -> float:
    """Output tokens/s of all requests added at once, from the first step to the last token; request i uses the
    adapters loras[i % len(loras)]."""
    sync(engine.device)
    start = time.perf_counter()
    seqs = [engine.add(p, SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens), lora=loras[i % len(loras)])
            for i, p in enumerate(batch)]
    while engine.has_work:
        engine.step()
    sync(engine.device)
    return sum(len(s.output_ids) for s in seqs) / (time.perf_counter() - start)


def step_breakdown(stats: EngineStats) -> str:
    """Where a run's engine time went, from the engine's step counters."""
    decode_ms = 1e3 * stats.decode_seconds / max(stats.decode_steps, 1)
    return (f"{stats.prefill_steps} prefill steps ({stats.prefill_tokens} prompt tokens) took "
            f"{stats.prefill_seconds:.3f} s, {stats.decode_steps} decode steps {stats.decode_seconds:.3f} s "
            f"({decode_ms:.2f} ms a step, mean batch {stats.decode_tokens / max(stats.decode_steps, 1):.1f})")


def graph_replay_ms(engine: LLMEngine, repeats: int = 50) -> dict[str, float] | None:
    """The batch-1 decode graph alone, or None without graphs: ms a replay back to back ("replay", the GPU's time),
    the host's time in one replay call meanwhile (median, "launch"), and a replay waited for before the next
    ("waited": whether the GPU starts before the call returns)."""
    if not engine.runner.graphs:
        return None
    graph, _ = engine.runner.graphs[min(engine.runner.graphs)]
    sync(engine.device)
    start, calls = time.perf_counter(), []
    for _ in range(repeats):
        called = time.perf_counter()
        graph.replay()
        calls.append(time.perf_counter() - called)
    sync(engine.device)
    replay = (time.perf_counter() - start) / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
        sync(engine.device)
    return {"replay": 1e3 * replay, "launch": 1e3 * statistics.median(calls),
            "waited": 1e3 * (time.perf_counter() - start) / repeats}


def transformers_generate(model, batch: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Output tokens/s of one static batch through transformers `generate` (greedy, forced length)."""
    ids = torch.tensor(batch, device=device)
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        sync(device)
    return (out.shape[1] - ids.shape[1]) * len(batch) / (time.perf_counter() - start)


def load_reference(args, device: torch.device, dtype: torch.dtype, shapes: dict = LLAMA_3_8B):
    """(checkpoint dir the engine reads config/tokenizer from, transformers model, weights for the engine);
    `--random-init` makes a model of `shapes` with random weights on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.random_init:
        folder = Path(tempfile.mkdtemp(prefix="llm-random-"))
        config = AutoConfig.for_model(**shapes)
        config.save_pretrained(folder)
        byte_level_tokenizer(add_bos=True).save_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model = model.to_empty(device=device)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.02)
        model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)  # meta left its buffers empty
        return folder, model.eval(), list(model.named_parameters())
    checkpoint = args.checkpoint or tiny_checkpoint("llm")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    return checkpoint, model, None


def compare_engines(args, device: torch.device, bandwidth: float, variants: list[tuple[str, str, str]]
                    ) -> tuple[list[str], list[list[str]], list[str]]:
    """Engines on the same weights, one after the other, each a (precision bf16/fp8, decode attention paged/gather,
    one-token linear layers gemv/library) variant: table columns, rows (each variant, then its ratio to the first)
    and notes."""
    checkpoint, reference, weights = load_reference(args, device, torch.bfloat16)
    weights = weights or list(checkpoint_tensors(checkpoint))
    del reference  # `weights` keeps the tensors
    found: list[dict[str, float]] = []
    notes = []
    labels = [" ".join(v) for v in variants]
    defaults = (fp8_gemm.SWAP_FROM_ROWS, fp8.W8A8_GEMM_MAX_ROWS, runner.GRAPH_PIECES, runner.GRAPH_RAMP,
                gemv.PDL_UNPREPARED, gemv.PDL_ATTENTION)  # (variants
    # change them; restored at the end)
    for (precision, attention, linear, *options), label in zip(variants, labels):
        options = set(options[0].split("+")) if options else set()
        fp8_gemm.SWAP_FROM_ROWS = 2 if "swap" in options else defaults[0]  # (read as the engine's graphs are captured)
        fp8.W8A8_GEMM_MAX_ROWS = fp8.FP8_GEMM_MAX_ROWS if "w8a8gemm" in options else defaults[1]
        runner.GRAPH_PIECES = 1 if "whole" in options else defaults[2]
        runner.GRAPH_RAMP = "ramp" in options or defaults[3]
        gemv.PDL_UNPREPARED = "pdl" in options or defaults[4]
        gemv.PDL_ATTENTION = "pdlattn" in options or defaults[5]
        start = time.perf_counter()
        config = EngineConfig(dtype="bf16", device=str(device), max_batch=args.concurrency,
                              kv_cache_memory_mb=16384 if device.type == "cuda" else 512,
                              compile_kernels=args.compile_kernels, decode_attention=attention,
                              decode_linear=linear, overlap_steps="overlap" in options)
        if precision == "bf16":
            engine = LLMEngine(checkpoint, config, weights)
        else:  # quantized on the device as the engine loads them (part of its ready time)
            folder = Path(tempfile.mkdtemp(prefix="llm-fp8-"))
            scheme = Fp8Scheme(activations="none" if precision == "fp8w" else "token",
                               ignore=() if "lmhead" in options else ("lm_head",))
            write_fp8_metadata(Path(checkpoint), folder, scheme)
            engine = LLMEngine(folder, config, quantized_tensors(weights, scheme))
        sync(device)
        ready_s = time.perf_counter() - start
        vocab = engine.model.args.vocab_size
        engine_concurrent(engine, prompts(4, 16, vocab, seed=3), 4)  # warm-up (compiles kernels)
        print(f"{label}: ready in {ready_s:.1f}s; batch 1 ...", flush=True)
        batch1 = engine_batch1(engine, prompts(1, args.input_tokens, vocab, seed=1)[0], args.batch1_tokens)
        engine.stats = EngineStats()
        concurrent = engine_concurrent(engine, prompts(args.concurrency, args.input_tokens, vocab, seed=2),
                                       args.output_tokens)
        notes.append(f"{label}, the concurrent run: {step_breakdown(engine.stats)}.")
        profiles = {}
        for rows in args.profile_rows:
            try:
                profiles[rows] = profile_decode(engine, rows)
                notes.append(f"{label}, {describe(profiles[rows])}.")
            except Exception as e:  # noqa: BLE001 - the profile is extra; the measurements above stand
                notes.append(f"{label}: profiling {rows} rows failed: {type(e).__name__}: {e}")
                while engine.has_work:  # (its sequences run out; the next ones start clean)
                    engine.step()
        roofline = bandwidth / decode_bytes(engine, args.input_tokens + args.batch1_tokens // 2)
        found.append(dict(batch1=batch1, concurrent=concurrent, ready=ready_s, roofline=roofline,
                          **(graph_replay_ms(engine) or dict.fromkeys(("replay", "launch", "waited"), float("nan"))),
                          **{f"wall{rows}": profiles[rows].wall_ms if rows in profiles else float("nan")
                             for rows in args.profile_rows},
                          **{f"kernels{rows}": profiles[rows].total_ms if rows in profiles else float("nan")
                             for rows in args.profile_rows}))
        print(f"{label}: batch 1 {batch1:.1f} tokens/s ({100 * batch1 / roofline:.0f}% of roofline "
              f"{roofline:.1f}), {args.concurrency} concurrent {concurrent:.1f} tokens/s", flush=True)
        notes.append(f"{label} engine: {json.dumps(engine.config.__dict__)}; {engine.blocks.num_blocks} KV blocks;"
                     f" {len(engine.runner.graphs)} decode graphs captured at start.")
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (fp8_gemm.SWAP_FROM_ROWS, fp8.W8A8_GEMM_MAX_ROWS, runner.GRAPH_PIECES, runner.GRAPH_RAMP, gemv.PDL_UNPREPARED,
     gemv.PDL_ATTENTION) = defaults
    columns = ["measure", *labels, *(f"{label} / {labels[0]}" for label in labels[1:])]

    def row(measure: str, key: str, fmt: str) -> list[str]:
        return [measure, *(format(f[key], fmt) for f in found),
                *(f"{f[key] / found[0][key]:.2f}" for f in found[1:])]

    rows = [row("decode tokens/s, batch 1", "batch1", ".1f"),
            row("batch-1 roofline tokens/s (bandwidth / bytes a step reads)", "roofline", ".1f"),
            row(f"output tokens/s, {args.concurrency} x {args.input_tokens} in / {args.output_tokens} out "
                "(all added at once)", "concurrent", ".1f"),
            row("batch-1 decode step replayed from its CUDA graph, ms", "replay", ".2f"),
            row("its replay call's time on the host, ms (median, replays back to back)", "launch", ".2f"),
            row("its replay waited for before the next, ms", "waited", ".2f"),
            row("engine ready, s (load, FP8 quantizing on the device, KV cache, graph capture)", "ready", ".1f")]
    for n in args.profile_rows:
        rows += [row(f"decode step of {n} rows under the profiler, ms", f"wall{n}", ".2f"),
                 row(f"its kernels' time at {n} rows, ms (by kind in the notes)", f"kernels{n}", ".2f")]
    notes.append("fp8: E4M3 weights with per-channel scales, activations quantized per token; steps of more than "
                 "one token run torch._scaled_mm after one compiled quantization kernel; fp8w: the same weights, "
                 "activations kept in bf16 (the default of build_engines --precision fp8; steps of 2-256 rows run the "
                 "Triton GEMM of backends/llm/fp8_gemm.py, longer ones widen the weights to bf16 for cuBLAS); the "
                 "random weights rounded to nearest (GPTQ changes values, not speed); embedding, norms, "
                 "attention and the LM head in bf16 (the head in FP8 too with the lmhead option). paged: decode "
                 "attention by the Triton kernel of backends/llm/paged_decode.py (KV blocks read in place); gather: "
                 "each sequence's blocks copied out, then SDPA. gemv: one-token steps run every linear layer (the "
                 "LM head too) through backends/llm/gemv.py, with the RMSNorm / SiLU * up before and the residual "
                 "add after fused into them; library: cuBLAS (torch._scaled_mm for FP8 at one row) and separate "
                 "kernels.")
    return columns, rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.llm_engine", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path)
    source.add_argument("--random-init", choices=["llama-3-8b"])
    parser.add_argument("--dtype", choices=[*sorted(DTYPES), "fp8"], default="fp32",
                        help="fp8: the bf16 engine against the FP8 one instead of against transformers")
    parser.add_argument("--variants", help="engines against each other instead of against transformers: "
                        "PRECISION:ATTENTION,... with bf16|fp8|fp8w and paged|gather (--dtype fp8 means "
                        "bf16:paged,fp8:paged)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--batch1-tokens", type=int, default=128)
    parser.add_argument("--no-compile-kernels", dest="compile_kernels", action="store_false",
                        help="plain PyTorch elementwise kernels (default on CUDA: torch.compile'd)")
    parser.add_argument("--profile-rows", type=int, nargs="*", default=[],
                        help="with --variants: also profile decode steps of these many sequences (perf/step_profile)")
    parser.add_argument("--scenario", default="llm-engine", help="result file name")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    if args.dtype == "fp8" or args.variants:
        variants = [tuple((v + ":gemv").split(":")[:3]) if v.count(":") == 1 else tuple(v.split(":"))
                    for v in (args.variants or "bf16:paged,fp8:paged").split(",")]
        if any(len(v) not in (3, 4) or v[0] not in ("bf16", "fp8", "fp8w") or v[1] not in ("paged", "gather")
               or v[2] not in ("gemv", "library") or not set("+".join(v[3:]).split("+")) <= OPTIONS | {""}
               for v in variants):
            parser.error(f"--variants {args.variants}: PRECISION:ATTENTION[:LINEAR[:OPTION+...]] with bf16|fp8|fp8w, "
                         f"paged|gather, gemv|library, and options of {sorted(OPTIONS)}")
        columns, rows, notes = compare_engines(args, device, bandwidth, variants)
        model = "random init llama-3-8b shapes" if args.random_init else args.checkpoint or "the tiny checkpoint"
        notes.insert(0, f"Model: {model}. Device copy bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s.")
        hardware = hardware_line("n/a (in-process)")
        path = write_table(args.results / args.host, args.scenario, columns, rows, hardware, notes)
        print(path.read_text())
        return 0
    dtype = DTYPES[args.dtype]
    checkpoint, reference, weights = load_reference(args, device, dtype)
    start = time.perf_counter()
    engine = LLMEngine(checkpoint, EngineConfig(dtype=args.dtype, device=str(device), max_batch=args.concurrency,
                                                kv_cache_memory_mb=None if device.type == "cuda" else 512,
                                                compile_kernels=args.compile_kernels), weights)
    del weights
    ready_s = time.perf_counter() - start
    print(f"engine ready in {ready_s:.1f}s ({len(engine.runner.graphs)} decode graphs captured)", flush=True)
    vocab = engine.model.args.vocab_size
    one = prompts(1, args.input_tokens, vocab, seed=1)
    batch = prompts(args.concurrency, args.input_tokens, vocab, seed=2)
    start = time.perf_counter()
    engine_concurrent(engine, prompts(4, 16, vocab, seed=3), 4)  # warm-up (compiles kernels when asked)
    print(f"warm-up {time.perf_counter() - start:.1f}s", flush=True)
    transformers_generate(reference, one, 4, device)

    rows = []
    print("measuring batch 1 ...", flush=True)
    ours_1 = engine_batch1(engine, one[0], args.batch1_tokens)
    roofline = bandwidth / decode_bytes(engine, args.input_tokens + args.batch1_tokens // 2)
    graph = graph_replay_ms(engine)
    theirs_1 = transformers_generate(reference, one, min(args.batch1_tokens, 32), device)
    rows.append(["decode tokens/s, batch 1", f"{ours_1:.1f}", f"{theirs_1:.1f}", f"{ours_1 / theirs_1:.2f}",
                 f"roofline {roofline:.1f} ({100 * ours_1 / roofline:.0f}% reached)"])
    print(f"batch 1: engine {ours_1:.1f}, transformers {theirs_1:.1f} tokens/s; concurrent ...", flush=True)
    engine.stats = EngineStats()
    ours_n = engine_concurrent(engine, batch, args.output_tokens)
    stats = engine.stats
    theirs_n = transformers_generate(reference, batch, args.output_tokens, device)
    rows.append([f"output tokens/s, {args.concurrency} x {args.input_tokens} in / {args.output_tokens} out",
                 f"{ours_n:.1f}", f"{theirs_n:.1f}", f"{ours_n / theirs_n:.2f}",
                 step_breakdown(stats)])
    shape = (f"{engine.model.args.model_type}, {sum(p.numel() for p in engine.model.parameters()) / 1e9:.2f} B "
             f"parameters, {args.dtype}, {'random init' if args.random_init else checkpoint}")
    notes = [f"Model: {shape}. Device copy bandwidth measured in this run: {bandwidth / 1e9:.1f} GB/s (read + write).",
             "Roofline at batch 1 = bandwidth / (weights except the embedding table + KV cache at the mean context).",
             "transformers: `generate`, greedy, static batch, forced output length; at batch 1 over "
             f"{min(args.batch1_tokens, 32)} tokens (prefill included, so slightly pessimistic for it).",
             f"Engine: {json.dumps(engine.config.__dict__)}; {engine.blocks.num_blocks} KV blocks; ready in "
             f"{ready_s:.1f} s ({len(engine.runner.graphs)} decode graphs captured at start)."]
    if graph:
        notes.append(f"One batch-1 decode step replayed alone from its CUDA graph takes {graph['replay']:.2f} ms (the "
                     f"GPU's share of a step; a whole engine step at batch 1 takes {1e3 / ours_1:.2f} ms); the replay "
                     f"call takes {graph['launch']:.2f} ms of the host's time, and a replay waited for before the "
                     f"next {graph['waited']:.2f} ms.")
    hardware = hardware_line("n/a (in-process)")
    path = write_table(args.results / args.host, args.scenario, ["measure", "engine", "transformers", "ratio", "note"],
                       rows, hardware, notes)
    print(hardware, *notes, sep="\n")
    print(path.read_text().split("\n\n")[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
