"""Turns a scheduled batch into the model's tensors, runs it, and returns the logits of each sequence's last token
(the only logits anyone reads)."""
from __future__ import annotations

import torch

from backends.llm.attention import AttentionMetadata
from backends.llm.kv_cache import BlockManager
from backends.llm.model import DecoderModel
from backends.llm.sequence import Sequence


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: list, blocks: BlockManager):
        self.model, self.kv_cache, self.blocks = model, kv_cache, blocks
        self.device = model.embed_tokens.weight.device

    def tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32)

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Every not-yet-cached token of each sequence; logits [B, vocab] of each sequence's last token."""
        ids, positions, slots, seq_index, query_index, last = [], [], [], [], [], []
        max_query = max(s.num_tokens - s.num_cached for s in seqs)
        query_positions = []
        for b, seq in enumerate(seqs):
            span = range(seq.num_cached, seq.num_tokens)
            ids += seq.token_ids[seq.num_cached:]
            positions += span
            slots += [self.blocks.slot(seq, p) for p in span]
            seq_index += [b] * len(span)
            query_index += range(len(span))
            query_positions.append(list(span) + [0] * (max_query - len(span)))
            last.append(len(ids) - 1)
        meta = AttentionMetadata(self.tensor(slots), self.block_tables(seqs), self.tensor(query_positions),
                                 (self.tensor(seq_index), self.tensor(query_index)),
                                 max(s.num_tokens for s in seqs))
        hidden = self.model(self.tensor(ids), self.tensor(positions), self.kv_cache, meta)
        return self.model.logits(hidden[self.tensor(last)])

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """The newest token of each sequence; logits [B, vocab]."""
        positions = [s.num_tokens - 1 for s in seqs]
        meta = AttentionMetadata(self.tensor([self.blocks.slot(s, p) for s, p in zip(seqs, positions)]),
                                 self.block_tables(seqs), self.tensor([[p] for p in positions]), None,
                                 max(s.num_tokens for s in seqs))
        hidden = self.model(self.tensor([s.token_ids[-1] for s in seqs]), self.tensor(positions), self.kv_cache, meta)
        return self.model.logits(hidden)
