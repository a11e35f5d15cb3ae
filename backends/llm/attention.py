"""Attention over the paged KV cache.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads, head_dim]; a sequence's keys live in
the blocks its block table lists, in order. Every step first writes the new tokens' keys and values into their slots,
then each query attends to its sequence's cached keys up to its own position: one code path for prefill (many
queries per sequence, possibly after a cached prefix) and decode (one query per sequence).

With an FP8 cache (per-layer key and value scales given), new keys and values are stored as E4M3 bytes; reading
them back, the key scale is folded into the queries and the value scale into the output, so the gathered cache is
only converted, never rescaled.

Decode steps on a GPU run the Triton kernel of paged_decode.py, which reads the blocks in place, when the step's
metadata carries it; elsewhere they gather the blocks and run PyTorch's scaled_dot_product_attention (the kernel's
reference in the tests). Prompts with nothing cached attend over their own new keys and values (`varlen`: the
sequences' bounds as a device tensor, so the step can be a CUDA graph): flash attention's variable-length kernel on
a GPU, causal SDPA one prompt at a time elsewhere; with an FP8 cache they read their keys back from it
(`fresh_lengths`) as decode steps will. A prefill after cached tokens runs `by_sequence` (the runner gives each
sequence's span). The padded, masked form of the same attention, taken when no spans are given, is kept as
`by_sequence`'s reference in the tests.
"""
from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from backends.llm.fp8 import FP8, quantize

KVScales = tuple[torch.Tensor, torch.Tensor]  # (key scale, value scale) of an FP8 cache


@dataclass
class AttentionMetadata:
    """Where the tokens of one step go and what they attend to. B sequences, T new tokens in all."""

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with the scratch block (masked out by positions)
    query_positions: torch.Tensor  # [B, max_query_len] position of each query, padded with 0
    token_index: tuple[torch.Tensor, torch.Tensor] | None  # (seq, query) of each of the T tokens; None: decode
    max_context_len: int  # longest sequence in the cache after this step
    fresh_lengths: tuple[int, ...] | None = None  # prefill where no sequence had anything cached: their lengths
    decode_kernel: Callable | None = None  # paged_decode.paged_decode_attention for decode steps (see decode_kernel)
    spans: tuple[tuple[int, int], ...] | None = None  # prefill: (new tokens, context length) of each sequence
    varlen: tuple[torch.Tensor, int] | None = None  # fresh prompts: ([B + 1] int32 bounds in the step's tokens, an
    # upper bound of their lengths); the bounds may end with empty sequences
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _lengths: torch.Tensor | None = field(default=None, repr=False)
    _parts: dict = field(default_factory=dict, repr=False)  # per-step pieces every layer shares (see by_sequence)

    def context_lengths(self) -> torch.Tensor:
        """[B] int32: how many cached keys each decode query sees (its position + 1); once per step."""
        if self._lengths is None:
            self._lengths = (self.query_positions[:, 0] + 1).int()
        return self._lengths

    def mask(self, length: int) -> torch.Tensor:
        """[B, 1, max_query, length]: which of the first `length` cached keys each query sees (causal, and in the
        cache). Every layer asks the same, so it is made once per step."""
        if self._mask is None or self._mask.shape[-1] != length:
            key_positions = torch.arange(length, device=self.query_positions.device)
            self._mask = key_positions[None, None, None, :] <= self.query_positions[:, None, :, None]
        return self._mask


@functools.cache
def decode_kernel(device: torch.device) -> Callable | None:
    """The Triton paged decode kernel where it runs (a CUDA device with Triton), else None."""
    if device.type != "cuda":
        return None
    try:
        from backends.llm.paged_decode import paged_decode_attention
    except ImportError:
        return None
    return paged_decode_attention


def readable(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered keys or values in `dtype`: an FP8 cache's bytes converted (its scales are applied by the caller)."""
    return cached.view(FP8).to(dtype) if cached.dtype == torch.uint8 else cached


@functools.cache
def _flash_varlen() -> tuple[Callable, dict]:
    """torch's variable-length flash attention and its causal argument (is_causal before torch 2.11, then a window)."""
    from torch.nn.attention.varlen import varlen_attn

    causal = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else \
        {"window_size": (-1, 0)}
    return varlen_attn, causal


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor, max_len: int
                  ) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens, sequences one after another in q [T, heads, dim] and
    k, v [T, kv_heads, dim] between `bounds`; one kernel on a GPU (no host sync, so it can be captured)."""
    if q.is_cuda:
        attend, causal = _flash_varlen()
        return attend(q, k, v, bounds, bounds, max_len, max_len, **causal)
    out, edges = torch.empty_like(q), bounds.tolist()
    for start, end in zip(edges, edges[1:]):
        if end > start:
            out[start:end] = F.scaled_dot_product_attention(
                *(t[None, start:end].transpose(1, 2) for t in (q, k, v)), is_causal=True,
                enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1)
    return out


def write_kv(kv: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
             scales: KVScales | None = None) -> None:
    k_cache, v_cache = kv
    if scales is not None:
        k, v = quantize(k, scales[0]).view(torch.uint8), quantize(v, scales[1]).view(torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def paged_attention(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scales: KVScales | None = None) -> torch.Tensor:
    """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
    if scales is None:
        return _paged_attention(q, kv, meta)
    return _paged_attention(q * scales[0].to(q.dtype), kv, meta) * scales[1].to(q.dtype)


def _paged_attention(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
    k_cache, v_cache = kv
    if meta.token_index is None and meta.decode_kernel is not None:
        return meta.decode_kernel(q.view(len(meta.block_tables), -1, q.shape[-1]), k_cache, v_cache,
                                  meta.block_tables, meta.context_lengths()).view(q.shape)
    if meta.token_index is not None and meta.fresh_lengths is None and meta.spans is not None:
        return by_sequence(q, k_cache, v_cache, meta)
    batch, max_query = meta.query_positions.shape
    blocks = meta.block_tables[:, :-(-meta.max_context_len // k_cache.shape[1])]
    keys = k_cache[blocks].flatten(1, 2).transpose(1, 2)  # [B, kv_heads, L, head_dim]
    values = v_cache[blocks].flatten(1, 2).transpose(1, 2)
    keys, values = readable(keys, q.dtype), readable(values, q.dtype)
    gqa = keys.shape[1] != q.shape[1]
    if meta.fresh_lengths is not None:
        # prompts with nothing cached: each is plain causal attention over its own tokens, which SDPA runs as flash
        # attention on a GPU (no mask, no padding); their tokens follow each other in q
        outs, start = [], 0
        for i, n in enumerate(meta.fresh_lengths):
            query = q[start:start + n].view(1, n, *q.shape[1:]).transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(query, keys[i:i + 1, :, :n], values[i:i + 1, :, :n],
                                                       is_causal=True, enable_gqa=gqa)[0].transpose(0, 1))
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    mask = meta.mask(keys.shape[2])
    if meta.token_index is None:
        # decode: the query heads sharing a KV head become that head's queries, [B, kv_heads, group, head_dim], so
        # no kernel expands the keys and values to every query head (what enable_gqa costs outside flash)
        queries = q.view(batch, keys.shape[1], -1, q.shape[-1])
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask).reshape(q.shape)
    queries = q.new_zeros(batch, max_query, *q.shape[1:])
    queries[meta.token_index] = q
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask,
                                         enable_gqa=gqa).transpose(1, 2)
    return out[meta.token_index]


def by_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
    """A prefill after cached tokens (a prompt chunk, a cached prefix, or a step mixing prompt chunks with decoding
    sequences) without padding every sequence to the longest: the one-token sequences together as a decode step,
    each longer one over its own keys, causal from the bottom right (its queries are the last of its context)."""
    parts = meta._parts
    if not parts:  # the same for every layer of the step: made once
        starts = [0, *itertools.accumulate(n for n, _ in meta.spans)]
        singles = [i for i, (n, _) in enumerate(meta.spans) if n == 1]
        if singles:
            index = torch.tensor(singles).to(q.device, non_blocking=True)
            parts["rows"] = torch.tensor([starts[i] for i in singles]).to(q.device, non_blocking=True)
            parts["decode"] = AttentionMetadata(meta.slot_mapping, meta.block_tables[index],
                                                meta.query_positions[index, :1], None,
                                                max(meta.spans[i][1] for i in singles), decode_kernel=meta.decode_kernel)
        parts["chunks"] = [(i, starts[i], n, length, torch.ones(n, length, dtype=torch.bool, device=q.device).tril(
            diagonal=length - n)) for i, (n, length) in enumerate(meta.spans) if n > 1]
    out = torch.empty_like(q)
    if "rows" in parts:
        out[parts["rows"]] = _paged_attention(q[parts["rows"]], (k_cache, v_cache), parts["decode"])
    block_size = k_cache.shape[1]
    for i, start, n, length, mask in parts["chunks"]:
        blocks = meta.block_tables[i, :-(-length // block_size)]
        keys, values = (readable(cache[blocks].flatten(0, 1)[:length].transpose(0, 1), q.dtype)
                        for cache in (k_cache, v_cache))
        if keys.shape[0] != q.shape[1]:  # GQA: SDPA's efficient kernels take a mask only with equal head counts
            keys, values = (t.repeat_interleave(q.shape[1] // t.shape[0], dim=0) for t in (keys, values))
        # 4-D inputs: with 3-D ones SDPA falls back to its math path (fp32 scores, hundreds of us of host time)
        out[start:start + n] = F.scaled_dot_product_attention(q[None, start:start + n].transpose(1, 2), keys[None],
                                                              values[None], attn_mask=mask)[0].transpose(0, 1)
    return out
