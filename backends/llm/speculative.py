"""Speculative decoding: a cheap proposer guesses the next tokens, the model checks them all in one step.

A decode step with speculation gives each sequence its newest token plus up to k proposed ones; the model scores all
k + 1 positions in one decode step (a row per position, each attending to its sequence's cache up to itself: the same
kernels and CUDA graphs as any decode step), and `verify` keeps the longest run of proposals the model agrees with
plus one token of the model's own, so every step still adds at least one token. Rejected positions are forgotten by
bookkeeping alone: their cache slots lie past the sequence's cached length and are overwritten later, and the blocks
they took go back to the pool (`BlockManager.shrink`).

The output is exactly what the model alone would produce: greedy rows keep the model's argmax path token for token;
sampled rows use the rejection rule of Leviathan et al. / Chen et al. (accept a proposal d with probability
min(1, p(d) / q(d)), else draw from the normalised max(0, p - q)), p and q after the same temperature, top-k and top-p.

Proposers: prompt lookup (`NgramProposer`: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens; no model, q is a point mass) and a small draft model with its own paged KV cache (`DraftProposer`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backends.llm.kv_cache import BlockManager, allocate_kv_cache
from backends.llm.model import DecoderModel
from backends.llm.runner import ModelRunner
from backends.llm.sampling import forbid, generator, probabilities
from backends.llm.sequence import Sequence


@dataclass
class Draft:
    """A sequence's proposed tokens and, from a draft model that sampled them, the distributions they came from."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab]; None: proposed deterministically (a point mass)


def next_length(current: int, proposed: int, accepted: int, most: int) -> int:
    """Adaptive proposal length (the heuristic schedule of Hugging Face's assisted generation): two more after a
    step that accepted every proposal, one fewer after one that did not; between 1 and `most`."""
    if proposed == 0:
        return current
    return min(most, current + 2) if accepted == proposed else max(1, current - 1)


def mask_early_eos(logits: torch.Tensor, seq: Sequence, eos_ids: tuple[int, ...]) -> None:
    """Rows [k + 1, vocab] of one sequence's step: EOS is not a choice at a position before its min_tokens."""
    early = seq.sampling.min_tokens - len(seq.output_ids)
    if eos_ids and early > 0:
        forbid(logits, list(range(min(early, len(logits)))), eos_ids)


def verify_greedy(draft: Draft, best: list[int]) -> list[int]:
    """The tokens a greedy step adds: the proposals up to the first that differs from the model's argmax `best`
    ([k + 1]: after the newest token, then after each proposal), then the model's own token there."""
    accepted = next((i for i, (d, b) in enumerate(zip(draft.tokens, best)) if d != b), len(draft.tokens))
    return best[:accepted + 1]


def verify_sampled(logits: torch.Tensor, seq: Sequence, draft: Draft) -> list[int]:
    """The tokens a sampled step adds to `seq`: the accepted prefix of the draft, then one token drawn as the rule
    says. logits [k + 1, vocab]: row i scores the token after the i-th proposal (row 0: after the newest token)."""
    k = len(draft.tokens)
    p = probabilities(logits, [seq.sampling] * (k + 1))
    if not p.isfinite().all():
        raise RuntimeError("sampling failed: the model's probabilities are not finite")
    drafts = torch.tensor([draft.tokens], device=p.device)
    q = None if draft.probs is None else draft.probs[None]
    uniforms = torch.rand(1, k + 1, device=p.device,
                          generator=generator(seq, p.device) if seq.sampling.seed is not None else None)
    accepted, token = accept(p[None], q, drafts, uniforms)
    n = int(accepted[0])
    return draft.tokens[:n] + [int(token[0])]


def accept(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, uniforms: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule over R independent rows: (accepted proposals [R], the token that follows them [R]).

    p [R, k + 1, vocab] the model's distributions; q [R, k, vocab] the proposer's (None: each proposal was certain);
    drafts [R, k]; uniforms [R, k + 1] in [0, 1): one per proposal, and the last for drawing the final token by
    inverse CDF (so seeded rows take all their randomness from their own generator)."""
    rows, k = drafts.shape
    index = torch.arange(rows, device=p.device)
    p_draft = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, drafts[..., None])[..., 0]
    agree = uniforms[:, :k] * q_draft < p_draft  # u < p/q without dividing by a zero q
    accepted = agree.int().cumprod(1).sum(1)
    final = p[index, accepted]
    rejected = accepted < k
    at = accepted.clamp(max=k - 1)
    if q is None:  # max(0, p - point mass at d), normalised: p without d
        residual = final.scatter(1, drafts[index, at][:, None], 0.0)
    else:
        residual = (final - q[index, at]).clamp(min=0.0)
    final = torch.where(rejected[:, None], residual, final)
    cdf = final.cumsum(1)
    token = torch.searchsorted(cdf, uniforms[:, k:] * cdf[:, -1:], right=True)[:, 0].clamp(max=p.shape[-1] - 1)
    return accepted, token


class NgramProposer:
    """Prompt lookup: after the latest earlier occurrence of the sequence's last n tokens (n from `longest` down to
    `shortest`), the tokens that followed it. Pays where outputs repeat their context (code edits, quoting, RAG)."""

    def __init__(self, shortest: int, longest: int):
        self.shortest, self.longest = shortest, longest

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[Draft]:
        return [Draft(self.lookup(np.asarray(seq.token_ids), k) if k else []) for seq, k in zip(seqs, lengths)]

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        for n in range(min(self.longest, len(tokens) - 1), self.shortest - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(1))
            if hits.size:
                start = hits[-1] + n
                return tokens[start:start + k].tolist()
        return []

    def forget(self, seq: Sequence) -> None:
        pass


class DraftProposer:
    """A small model with the same tokenizer proposes by decoding k tokens ahead. It keeps its own paged KV cache
    per sequence (a shadow `Sequence` holding the target's tokens, then its proposals); what the target rejected is
    dropped from it by bookkeeping, like the target's, so each step computes only the tokens it has not seen."""

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_batch: int, most: int,
                 max_context: int, capture: bool):
        args = model.args
        self.model, self.most = model, most
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        cache = allocate_kv_cache(args.num_hidden_layers, num_blocks, block_size, args.num_key_value_heads,
                                  args.head_dim, model.kv_cache_dtype, model.embed_tokens.weight.device)
        self.runner = ModelRunner(model, cache, self.blocks, max_batch * (1 + most), max_context, capture)
        self.shadows: dict[int, Sequence] = {}

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[Draft]:
        """Up to `lengths[i]` tokens for each sequence. The draft's steps follow each other on the device: each
        step's tokens feed the next one there, and the host reads them all once at the end."""
        drafts = [Draft([]) for _ in seqs]
        work = [(seq, self._shadow(seq), k, draft) for seq, k, draft in zip(seqs, lengths, drafts) if k]
        work = [item for item in work if self._room(item[1], item[2])]
        if not work:
            return drafts
        steps: list[tuple[list, torch.Tensor]] = []  # (the items that drew, their tokens on the device) per step
        logits = self._catch_up([shadow for _, shadow, _, _ in work])
        while True:
            tokens, qs = self._draw(logits, [seq for seq, _, _, _ in work])
            steps.append((work, tokens))
            for (_, shadow, _, draft), q in zip(work, qs):
                shadow.num_cached = shadow.num_tokens
                shadow.output_ids.append(0)  # its token is filled in below, once the host has it
                draft.tokens.append(0)
                if q is not None:
                    draft.probs = q if draft.probs is None else torch.cat([draft.probs, q])
            keep = [i for i, item in enumerate(work) if len(item[3].tokens) < item[2]]
            if not keep:
                break
            work = [work[i] for i in keep]
            logits = self.runner.decode([shadow for _, shadow, _, _ in work],
                                        ids=tokens[torch.tensor(keep, device=tokens.device)])
        values = iter(torch.cat([tokens for _, tokens in steps]).tolist())  # the one device sync
        for step, (items, _) in enumerate(steps):  # an item draws in every step from the first until it is done
            for _, shadow, _, draft in items:
                draft.tokens[step] = shadow.output_ids[step] = next(values)
        return drafts

    def _catch_up(self, shadows: list[Sequence]) -> torch.Tensor:
        """Logits [len(shadows), vocab] after each shadow's last token, computing the tokens its cache lacks: the
        last accepted proposals and the model's token as a decode step (a few rows each), a new prompt as a
        prefill."""
        new = [i for i, shadow in enumerate(shadows) if shadow.num_tokens - shadow.num_cached > 1 + self.most]
        rest = [i for i in range(len(shadows)) if i not in new]
        logits = [None] * len(shadows)
        if new:
            for i, row in zip(new, self.runner.prefill([shadows[i] for i in new])):
                logits[i] = row
        if rest:
            rows = self.runner.decode([shadows[i] for i in rest])
            last = torch.tensor([shadows[i].num_tokens - shadows[i].num_cached for i in rest]).cumsum(0) - 1
            for i, row in zip(rest, rows[last.to(rows.device)]):
                logits[i] = row
        return torch.stack(logits)

    def _shadow(self, seq: Sequence) -> Sequence:
        """The draft's view of `seq` now: its tokens, the draft's cache cut back to the first one it got wrong."""
        tokens = seq.token_ids
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = Sequence(tokens, seq.sampling, seq.request_id)
            return shadow
        seen = shadow.token_ids  # the target's tokens when it last proposed, then its proposals
        agree = len(shadow.prompt_ids)
        while agree < min(shadow.num_cached, len(tokens)) and seen[agree] == tokens[agree]:
            agree += 1
        shadow.prompt_ids, shadow.output_ids = tokens, []
        shadow.num_cached = min(shadow.num_cached, agree, len(tokens) - 1)  # its last token: computed again
        self.blocks.shrink(shadow, shadow.num_cached)
        return shadow

    def _room(self, shadow: Sequence, k: int) -> bool:
        """Blocks for its tokens and k proposals (the last one is never computed); False: it proposes nothing."""
        need = shadow.num_tokens + k - 1
        if not self.blocks.can_hold(shadow, need):
            return False
        self.blocks.grow(shadow, need)
        shadow.step_tokens = shadow.num_tokens - shadow.num_cached
        return True

    @staticmethod
    def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The draft's next token for each sequence (logits [B, vocab]) on the device, without a sync: its argmax
        for greedy ones, else a draw from its distribution q (returned too, [1, vocab]: the rejection rule needs
        it; where q is not finite, the argmax and a point mass there, which keeps the rule exact)."""
        tokens = logits.argmax(-1)
        qs: list[torch.Tensor | None] = [None] * len(seqs)
        for i, seq in enumerate(seqs):
            if seq.sampling.greedy:
                continue
            q = probabilities(logits[i:i + 1], [seq.sampling])
            point = torch.nn.functional.one_hot(tokens[i:i + 1], logits.shape[-1]).to(q.dtype)
            q = torch.where(q.isfinite().all(), q, point)
            qs[i] = q
            tokens[i] = torch.multinomial(q[0], 1, generator=generator(seq, q.device)
                                          if seq.sampling.seed is not None else None)[0]
        return tokens, qs

    def forget(self, seq: Sequence) -> None:
        if (shadow := self.shadows.pop(seq.seq_id, None)) is not None:
            self.blocks.release(shadow)
