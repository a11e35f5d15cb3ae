"""Next-token choice per sequence: greedy, or temperature / top-k / top-p sampling from the sequence's own seeded
generator (so a seeded request draws the same tokens whatever it is batched with)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from backends.llm.sequence import Sequence


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # EOS is ignored until this many tokens were produced

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> list[int | Exception]:
    """logits: [B, vocab] float32 for the last position of each sequence. A row whose sampling fails gets its
    exception instead of a token: it belongs to that sequence alone."""
    early = [row for row, seq in enumerate(seqs) if len(seq.output_ids) < seq.sampling.min_tokens]
    if eos_ids and early:  # EOS is not a choice before min_tokens (one indexing kernel for the batch)
        logits[torch.tensor(early, device=logits.device)[:, None], torch.tensor(eos_ids, device=logits.device)] = \
            float("-inf")
    tokens = logits.argmax(dim=-1)
    failed: dict[int, Exception] = {}
    sampled = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
    if sampled:
        tokens = tokens.clone()
        for i in sampled:
            try:
                tokens[i] = _sample_row(logits[i], seqs[i])
            except Exception as e:
                failed[i] = e
    chosen: list[int | Exception] = tokens.tolist()  # one device sync for the whole batch
    for i, error in failed.items():
        chosen[i] = error
    return chosen


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
