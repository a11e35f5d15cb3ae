"""transformers' greedy tokens for a checkpoint: the reference the LLM engine's tests hold it to; and running an engine
with a cancellation midway. No server imports, so the engine's tests can also run alone on a GPU host."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def transformers_greedy(checkpoint: Path) -> Callable[[str, int], list[int]]:
    """greedy(prompt, max_tokens) -> generated token ids, without a final EOS (the engine does not return it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def greedy(prompt: str, max_tokens: int) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.input_ids.shape[1]:]
        out = out.tolist()
        return out[:-1] if out and out[-1] == tokenizer.eos_token_id else out
    return greedy


def run_cancelling(engine, cancelled, at_step: int | None) -> None:
    """Step `engine` until it has no work, cancelling the sequence `cancelled` after step `at_step` (None: never)."""
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == at_step:
            engine.cancel(cancelled)
