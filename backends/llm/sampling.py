"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling from the sequence's own seeded
generator (so a seeded request draws the same tokens whatever it is batched with)."""
from __future__ import annotations

import torch

from backends.llm.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[int]:
    """logits: [B, vocab] float32 for the last position of each sequence."""
    for row, seq in enumerate(seqs):  # EOS is not a choice before min_tokens
        if eos_ids and len(seq.output_ids) < seq.sampling.min_tokens:
            logits[row, list(eos_ids)] = float("-inf")
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
    if sampled:
        tokens = tokens.clone()
        for i in sampled:
            tokens[i] = _sample_row(logits[i], seqs[i])
    return tokens.tolist()


def _sample_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.sampling
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = logits.sort(descending=True)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) >= params.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if seq.generator is None:
        seq.generator = torch.Generator(device=logits.device)
        if params.seed is not None:
            seq.generator.manual_seed(params.seed)
        else:
            seq.generator.seed()
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=seq.generator)[0]
