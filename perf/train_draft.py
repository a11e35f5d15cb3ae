"""python -m perf.train_draft CHECKPOINT OUT --layers N: a draft model for speculative decoding, distilled from the
model on its own answers (a GPU takes minutes; the CPU far longer).

The draft starts as the model's first N layers with its embeddings, final norm and LM head (build_engines.draft); the
embeddings (tied to the head in SmolLM2) stay frozen, the layers and the norm learn to match the model's next-token
distributions (KL(model || draft) at every position) over the model's answers to varied requests: greedy ones and
sampled ones (temperature 0.8), made by our engine. Saved as a Hugging Face checkpoint with the model's tokenizer.
"""
from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch

from build_engines.draft import truncated_draft

REQUESTS = Path(__file__).resolve().parents[1] / "build_engines" / "data" / "calibration_prompts.txt"
TOPICS = ["volcanoes", "the stock market", "honeybees", "a chess opening", "Python decorators", "the Roman empire",
          "climate change", "a bicycle", "black holes", "bread baking", "the immune system", "electric cars",
          "jazz music", "password security", "the water cycle", "a job interview", "photosynthesis", "the internet",
          "marathon training", "ancient Egypt", "machine learning", "coffee", "earthquakes", "a budget spreadsheet",
          "the moon landing", "vaccines", "recycling", "sleep", "the French language", "a small garden"]
TASKS = ["Explain {} to a ten-year-old.", "Write a short poem about {}.", "List three facts about {}.",
         "What are the pros and cons of {}?", "Summarize the history of {} in a paragraph.",
         "Give me practical advice about {}.", "Describe {} in two sentences.", "Write a short story involving {}.",
         "How does {} work?", "Write an email to a friend about {}."]


def training_requests() -> list[str]:
    """Varied requests: every task about every topic above, the demo adapters' questions and the first half of the
    calibration requests (the second half is held out for the benchmark, perf.speculative)."""
    from build_engines.lora import HELD_OUT, QUESTIONS, SEA_QUESTIONS

    lines = [line for line in REQUESTS.read_text().splitlines() if line.strip()]
    return [t.format(topic) for topic in TOPICS for t in TASKS] + QUESTIONS + SEA_QUESTIONS + HELD_OUT + \
        lines[:len(lines) // 2]


def answers(checkpoint: Path, requests: list[str], samples: int, tokens: int, device: str) -> list[list[int]]:
    """Token ids of chat prompt + answer: one greedy and `samples` sampled answers per request, by our engine."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams

    engine = LLMEngine(checkpoint, EngineConfig(dtype="bf16" if device == "cuda" else "fp32", device=device,
                                                kv_cache_memory_mb=2048 if device == "cuda" else 256))
    chats = [engine.tokenizer.apply_chat_template([{"role": "user", "content": r}], add_generation_prompt=True,
                                                  tokenize=False) for r in requests]
    seqs = engine.generate(chats, SamplingParams(max_tokens=tokens))
    for i in range(samples):
        seqs += [engine.add(chat, SamplingParams(max_tokens=tokens, temperature=0.8, seed=1000 * i + j))
                 for j, chat in enumerate(chats)]
        while engine.has_work:
            engine.step()
    return [seq.prompt_ids + seq.output_ids for seq in seqs]


def distill(checkpoint: Path, out: Path, layers: int, steps: int = 1000, batch: int = 16, lr: float = 5e-4,
            samples: int = 2, tokens: int = 192, device: str = "cuda", seed: int = 0) -> dict[str, float]:
    """Train the draft; returns {"kl_start", "kl_end", "seconds", "sequences"}."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    start = time.perf_counter()
    data = answers(checkpoint, training_requests(), samples, tokens, device)
    truncated_draft(checkpoint, out, layers)
    teacher = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).to(device).eval()
    student = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).train()
    student.get_input_embeddings().weight.requires_grad_(False)  # shared with the model (and tied to the head)
    if not student.config.tie_word_embeddings:
        student.get_output_embeddings().weight.requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) *
                                                 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rng = random.Random(seed)
    losses = []
    for step in range(steps):
        chosen = rng.sample(data, min(batch, len(data)))
        width = max(map(len, chosen))
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        mask = torch.zeros(len(chosen), width, dtype=torch.bool)
        for row, seq in enumerate(chosen):
            ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), True
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            target = teacher(ids, attention_mask=mask).logits.float().log_softmax(-1)[mask]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = student(ids, attention_mask=mask).logits
        loss = torch.nn.functional.kl_div(logits.float().log_softmax(-1)[mask], target, log_target=True,
                                          reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"draft step {step}: KL {losses[-1]:.3f}", flush=True)
    student.to(torch.bfloat16).save_pretrained(out)
    return {"kl_start": sum(losses[:10]) / min(10, len(losses)), "kl_end": sum(losses[-10:]) / min(10, len(losses)),
            "seconds": time.perf_counter() - start, "sequences": len(data)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    print(distill(args.checkpoint, args.out, args.layers, args.steps, device=args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
