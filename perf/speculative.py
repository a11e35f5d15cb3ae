"""python -m perf.speculative: speculative decoding against plain decoding on one engine, in one run.

--checkpoint DIR (a trained model, e.g. SmolLM2): greedy answers to held-out chat requests (the second half of
  build_engines/data/calibration_prompts.txt) and to requests that quote their prompt, at batch 1 (one request at a
  time) and batch 8 (eight at once), with no speculation, prompt lookup, and each draft of --draft (or one distilled
  in the run: --train-draft LAYERS, perf.train_draft): output tokens/s (prefills included), acceptance (accepted /
  proposed), mean accepted proposals per verify step, and whether the answers equal the plain engine's.
--random-init llama-3-8b: no trained pair of these shapes exists here, so the draft's agreement with the model is set
  by construction: a real random draft (2 layers of hidden 2048, tied embeddings: about 1/20 of the bytes the model
  reads a token) proposes and the model verifies as always, but the check keeps each proposal with probability a
  until the first it refuses (ConstructedAcceptance). Tokens/s at batch 1 against a, and at a = 0.8 by batch size
  with and without speculation (where it stops paying).
All rows of one table come from one engine (the proposer is switched between rounds), so they share weights, KV cache
and CUDA graphs.
"""
from __future__ import annotations

import argparse
import gc
import random
import socket
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from backends.llm.engine import EngineConfig, EngineStats, LLMEngine
from backends.llm.sampling import SamplingParams
from backends.llm.speculative import Draft
from perf.llm_engine import LLAMA_3_8B, copy_bandwidth, load_reference, prompts, sync
from perf.report import hardware_line, write_table
from perf.train_draft import REQUESTS, distill

QUOTING = [  # requests whose answers repeat their prompt: where prompt lookup pays
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
    "Copy this list and put a dash before each item: apples, bread, milk, eggs, butter, cheese, rice, tea.",
    "Fix the spelling in this sentence and write it out again: Teh wether is nice tody and we will go to teh park.",
    "Rewrite this code with four-space indentation:\ndef add(a, b):\n  total = a + b\n  return total",
]
DRAFT_8B = dict(LLAMA_3_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=16,
                num_key_value_heads=8, tie_word_embeddings=True)
TINY = dict(LLAMA_3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)  # the code path on a CPU
SHAPES = {"llama-3-8b": (LLAMA_3_8B, DRAFT_8B), "tiny": (TINY, dict(TINY, hidden_size=32, num_hidden_layers=1,
                                                                       tie_word_embeddings=True))}


def timed_rounds(engine: LLMEngine, requests: list, batch: int, sampling: SamplingParams
                 ) -> tuple[float, list[list[int]], EngineStats]:
    """(output tokens/s, each request's tokens, the engine's counters) for the requests in groups of `batch`."""
    engine.stats = EngineStats()
    outputs = []
    sync(engine.device)
    start = time.perf_counter()
    for i in range(0, len(requests), batch):
        seqs = [engine.add(r, sampling) for r in requests[i:i + batch]]
        while engine.has_work:
            engine.step()
        outputs += [s.output_ids for s in seqs]
    sync(engine.device)
    return sum(map(len, outputs)) / (time.perf_counter() - start), outputs, engine.stats


def acceptance(stats: EngineStats) -> tuple[str, str]:
    if not stats.proposed_tokens:
        return "", ""
    return f"{stats.accepted_tokens / stats.proposed_tokens:.2f}", f"{stats.accepted_tokens / stats.speculated:.2f}"


def trained_model(args, device: torch.device) -> tuple[list[str], list[list[str]], list[str]]:
    checkpoint = args.checkpoint
    drafts = list(args.draft)
    notes = []
    if args.train_draft:
        out = Path(tempfile.mkdtemp(prefix="draft-"))
        found = distill(checkpoint, out, args.train_draft, args.train_steps, device=device.type)
        drafts.append(out)
        notes.append(f"Draft distilled in this run (perf.train_draft): the model's first {args.train_draft} layers, "
                     f"{args.train_steps} steps over {found['sequences']} of the model's answers, KL "
                     f"{found['kl_start']:.2f} -> {found['kl_end']:.2f}, {found['seconds']:.0f} s including making "
                     "the answers.")
    config = dict(dtype=args.dtype, device=str(device), max_batch=8, speculative_max_batch=8, speculative="ngram",
                  kv_cache_memory_mb=4096 if device.type == "cuda" else 256, prefix_caching=False,
                  num_speculative_tokens=args.tokens)
    engines = {"none": LLMEngine(checkpoint, EngineConfig(**config))}
    engines["prompt lookup"], ngram = engines["none"], engines["none"].proposer
    for draft in drafts:
        engines[f"draft {Path(draft).name}"] = LLMEngine(checkpoint, EngineConfig(**{
            **config, "speculative": "draft", "draft_model": str(draft)}))
    lines = [line for line in REQUESTS.read_text().splitlines() if line.strip()]
    tokenizer = engines["none"].tokenizer
    sets = {"held-out chat requests": lines[len(lines) // 2:len(lines) // 2 + args.requests], "quoting": QUOTING}
    chats = {name: [tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                                  tokenize=False) for r in requests] for name, requests in sets.items()}
    sampling = SamplingParams(max_tokens=args.output_tokens)
    for engine in engines.values():  # warm-up: kernels compiled, graphs used once
        timed_rounds(engine, chats["quoting"][:2], 2, SamplingParams(max_tokens=8))
    rows = []
    for name, requests in chats.items():
        alone = {}  # the plain engine's answers by batch size
        for batch in (1, 8):
            plain = None
            for label, engine in engines.items():
                if label in ("none", "prompt lookup"):  # one engine, its proposer switched
                    engine.proposer = ngram if label == "prompt lookup" else None
                tokens_s, outputs, stats = timed_rounds(engine, requests, batch, sampling)
                plain = plain or (tokens_s, outputs)
                alone.setdefault(batch, outputs)
                same = sum(a == b for a, b in zip(outputs, plain[1]))
                rows.append([name, batch, label, f"{tokens_s:.1f}", f"{tokens_s / plain[0]:.2f}", *acceptance(stats),
                             f"{stats.decode_steps / max(1, sum(map(len, outputs))):.2f}", f"{same}/{len(outputs)}"])
                print(" | ".join(map(str, rows[-1])), flush=True)
        notes.append(f"{name}: the plain engine's answers at batch 8 equal its answers at batch 1 for "
                     f"{sum(a == b for a, b in zip(alone[1], alone[8]))}/{len(requests)} requests (in {args.dtype}, "
                     "steps of other shapes round differently; a near tie can turn a greedy answer).")
    header = ["requests", "batch", "proposer", "output tokens/s", "of none", "acceptance", "accepted per verify step",
              "steps per token", "answers equal to none's"]
    notes += [f"Model {checkpoint}, {args.dtype} on {device}; greedy, up to {args.output_tokens} tokens an answer; "
              f"at most {args.tokens} proposals a step (adaptive); prompt lookup of 1-4 tokens."]
    return header, rows, notes


class ConstructedAcceptance:
    """In place of the engine's greedy check (`verify_greedy`): each proposal is kept with probability `rate` until
    the first refused, whatever the model computed; then the model's own token. The draft and the verify step run
    as they always do, so their cost is real; only the agreement is set."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate, self.rng = rate, random.Random(seed)

    def __call__(self, draft: Draft, best: list[int]) -> list[int]:
        kept = 0
        while kept < len(draft.tokens) and self.rng.random() < self.rate:
            kept += 1
        return draft.tokens[:kept] + [best[kept]]


def by_construction(args, device: torch.device) -> tuple[list[str], list[list[str]], list[str]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes, draft_shapes = SHAPES[args.random_init]
    checkpoint, reference, weights = load_reference(args, device, torch.bfloat16, shapes)
    del reference
    draft_dir = Path(tempfile.mkdtemp(prefix="draft-"))
    config = AutoConfig.for_model(**draft_shapes)
    with torch.device(device):
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in draft.parameters():
            param.normal_(0, 0.02)
    draft.save_pretrained(draft_dir)
    draft_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
    del draft
    biggest = max(args.batches)
    engine = LLMEngine(checkpoint, EngineConfig(
        dtype=args.dtype, device=str(device), max_batch=biggest, graph_max_context=1024, speculative="draft",
        draft_model=str(draft_dir), speculative_max_batch=biggest, num_speculative_tokens=args.tokens,
        speculative_schedule="fixed", prefix_caching=False, kv_cache_memory_mb=16384 if device.type == "cuda" else 512),
        weights)
    model_bytes = sum(p.numel() * p.element_size() for n, p in engine.model.named_parameters()
                      if n != "embed_tokens.weight")
    vocab = engine.model.args.vocab_size
    requests = prompts(biggest, args.input_tokens, vocab, seed=2)
    sampling = SamplingParams(max_tokens=args.output_tokens, min_tokens=args.output_tokens)
    drafter = engine.proposer
    timed_rounds(engine, requests[:2], 2, SamplingParams(max_tokens=8))  # warm-up
    rows = []

    def measure(batch: int, rate: float | None, plain: float | None) -> float:
        engine.proposer = None if rate is None else drafter
        with mock.patch("backends.llm.engine.verify_greedy", ConstructedAcceptance(rate or 0.0)):
            tokens_s, _, stats = timed_rounds(engine, requests[:max(batch, args.batch1_requests if batch == 1
                                                                     else 0)], batch, sampling)
        rows.append([batch, "none" if rate is None else f"{rate:.1f}", *acceptance(stats), f"{tokens_s:.1f}",
                     "" if plain is None else f"{tokens_s / plain:.2f}"])
        print(" | ".join(map(str, rows[-1])), flush=True)
        return tokens_s

    plain_1 = measure(1, None, None)
    for rate in args.rates:
        measure(1, rate, plain_1)
    for batch in args.batches[1:]:
        plain = measure(batch, None, None)
        measure(batch, args.sweep_rate, plain)
    header = ["batch", "agreement by construction", "acceptance measured", "accepted per verify step",
              "output tokens/s", "of none"]
    notes = [f"Model: {args.random_init} shapes, random {args.dtype} weights ({model_bytes / 1e9:.2f} GB read a "
             "token); "
             f"draft: {draft_shapes['num_hidden_layers']} layers of hidden {draft_shapes['hidden_size']} with tied "
             f"embeddings ({draft_bytes / 1e9:.2f} GB, "
             f"{draft_bytes / model_bytes:.3f} of the model), the agreement set as the module docstring says; "
             f"{args.tokens} proposals a step (fixed); requests of {args.input_tokens} random tokens, "
             f"{args.output_tokens} out (forced); batch 1 over {args.batch1_requests} requests one after another.",
             "With random weights the model's greedy choices carry no meaning, so the agreement is set in the "
             "check itself (ConstructedAcceptance); the measured acceptance also counts proposals cut at the end of "
             "an answer."]
    del engine
    gc.collect()
    return header, rows, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.speculative", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path)
    source.add_argument("--random-init", choices=sorted(SHAPES))
    parser.add_argument("--draft", type=Path, nargs="*", default=[], help="draft checkpoints (trained model)")
    parser.add_argument("--train-draft", type=int, metavar="LAYERS", help="distil a draft of LAYERS layers first")
    parser.add_argument("--train-steps", type=int, default=1000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--tokens", type=int, default=4, help="most proposals a step")
    parser.add_argument("--requests", type=int, default=16, help="held-out chat requests (trained model)")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--batch1-requests", type=int, default=16)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8, 0.9])
    parser.add_argument("--sweep-rate", type=float, default=0.8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--scenario", default=None)
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    header, rows, notes = by_construction(args, device) if args.random_init else trained_model(args, device)
    notes.append(f"Device copy bandwidth in this run: {bandwidth / 1e9:.1f} GB/s.")
    scenario = args.scenario or f"speculative-{args.random_init or args.checkpoint.name}"
    path = write_table(args.results / args.host, scenario, header, rows, hardware_line("n/a (in-process)"), notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
