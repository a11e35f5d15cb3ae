"""Logits of every position of whole sequences (teacher forcing): how quantized models are compared with the model
they came from. One sequence at a time through the model's own paged attention, over a cache that holds just it."""
from __future__ import annotations

import torch

from backends.llm.attention import AttentionMetadata
from backends.llm.kv_cache import allocate_kv_cache
from backends.llm.model import DecoderModel


def whole_sequence(n: int, block_size: int, device) -> tuple[torch.Tensor, AttentionMetadata, int]:
    """(positions, metadata, blocks) for a prefill of one sequence of n tokens over a cache of its own blocks."""
    blocks = -(-n // block_size)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(positions, torch.arange(blocks, device=device, dtype=torch.int32)[None], positions[None],
                             (torch.zeros(n, dtype=torch.int64, device=device), positions), n, (n,))
    return positions, meta, blocks


@torch.inference_mode()
def sequence_logits(model: DecoderModel, ids: list[int] | torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """float32 [len(ids), vocab]: row i scores the token after ids[i]."""
    device = model.embed_tokens.weight.device
    ids = torch.as_tensor(ids, device=device)
    args = model.args
    positions, meta, blocks = whole_sequence(len(ids), block_size, device)
    cache = allocate_kv_cache(args.num_hidden_layers, blocks, block_size, args.num_key_value_heads, args.head_dim,
                              model.kv_cache_dtype, device)
    return model.logits(model(ids, positions, cache, meta))


class LayerStates:
    """The hidden states of whole sequences between decoder layers, for work done one layer at a time (GPTQ's
    calibration): `run(i)` passes them through layer i (its hooks see the inputs), `advance(i)` keeps the outputs."""

    def __init__(self, model: DecoderModel, prompts: list[list[int]], block_size: int = 16):
        self.model = model
        device = model.embed_tokens.weight.device
        args = model.args
        self.items = []
        with torch.inference_mode():
            for ids in prompts:
                ids = torch.as_tensor(ids, device=device)
                positions, meta, blocks = whole_sequence(len(ids), block_size, device)
                cache = allocate_kv_cache(1, blocks, block_size, args.num_key_value_heads, args.head_dim,
                                          model.kv_cache_dtype, device)[0]  # one layer's, reused by each in turn
                self.items.append([model.embed_tokens(ids), model.cos[positions], model.sin[positions], cache, meta])

    @torch.inference_mode()
    def run(self, i: int) -> list[torch.Tensor]:
        layer = self.model.layers[i]
        return [layer(x, cos, sin, cache, meta) for x, cos, sin, cache, meta in self.items]

    def advance(self, i: int) -> None:
        for item, out in zip(self.items, self.run(i)):
            item[0] = out
