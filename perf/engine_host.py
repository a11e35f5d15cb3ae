"""python -m perf.engine_host: the LLM engine's host time per step, the model taken out.

On a GPU the host's work between decode steps (scheduling, sampling's bookkeeping, appending tokens, incremental
detokenisation, prefix-cache keys) adds to every step unless it overlaps the GPU's; on the H200 it was 2.5 ms a step
with 64 sequences (perf/results/h200/README.md, 2026-12-04). Here the model's forward is a lookup in a fixed table
(the next token's logits by the current token, so the text varies) while the runner still prepares each step's
inputs, so what is timed is that host work alone, on any machine. Variants, one run: detokenising through
`tokenizer.decode` against the fast tokenizer's backend directly (backends/llm/detokenizer.text_of, the engine's
way).
"""
from __future__ import annotations

import argparse
import functools
import socket
import sys
import time
from pathlib import Path

import torch

import backends.llm.detokenizer as detokenizer
from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.sampling import SamplingParams
from build_engines.checkpoints import tiny_checkpoint
from perf.report import hardware_line, write_table

VARIANTS = {"tokenizer.decode": lambda tokenizer: functools.partial(tokenizer.decode, skip_special_tokens=True),
            "backend decode (the engine's)": detokenizer.text_of}


def host_ms_per_step(engine: LLMEngine, batch: int, tokens: int, seed: int) -> float:
    """Mean wall time of the decode steps of `batch` sequences of 128-token prompts and `tokens` output tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, engine.model.args.vocab_size - 10, (batch, 128), generator=generator).tolist()
    for prompt in prompts:
        engine.add(prompt, SamplingParams(max_tokens=tokens, min_tokens=tokens))
    engine.step()  # the prefill
    start, steps = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        steps += 1
    return 1e3 * (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.engine_host", description=__doc__)
    parser.add_argument("--checkpoint", type=Path, help="default: the tiny llm (its tokenizer is what is timed)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="variants alternate; the best round of each counts")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    checkpoint = args.checkpoint or tiny_checkpoint("llm")
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=64,
                                                max_batch=max(args.batches)))
    vocab = engine.model.args.vocab_size
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
    engine.eos_ids = ()  # outputs run their full length
    # the runner still prepares each step's inputs (what a GPU step's host side does); only the model is a lookup
    engine.runner.forward_static = lambda batch, width: table[engine.runner.ids[:batch]]
    found = {(name, batch): float("inf") for name in VARIANTS for batch in args.batches}
    real = detokenizer.text_of
    try:
        for round_ in range(args.rounds):
            for name, text_of in VARIANTS.items():
                detokenizer.text_of = text_of
                for batch in args.batches:
                    found[name, batch] = min(found[name, batch], host_ms_per_step(engine, batch, args.tokens, round_))
    finally:
        detokenizer.text_of = real
    names = list(VARIANTS)
    rows = [[f"host ms a decode step, {batch} sequences", *(f"{found[n, batch]:.3f}" for n in names),
             f"{found[names[1], batch] / found[names[0], batch]:.2f}"] for batch in args.batches]
    notes = [f"Checkpoint: {checkpoint} (its tokenizer); greedy sampling of logits looked up from a fixed random table "
             f"by the current token; 128-token prompts, {args.tokens} output tokens, EOS off; one torch thread; the best "
             f"of {args.rounds} alternating rounds. Command: `python -m perf.engine_host "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`."]
    path = write_table(args.results / args.host, "engine-host", ["measure", *names, "ratio"], rows,
                       hardware_line("n/a (in-process)"), notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
