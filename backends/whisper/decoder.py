"""Whisper's decoder over a fixed set of slots, one token per slot per step, each slot at its own position: what
lets clips join and leave a running batch between steps (continuous batching).

Every slot owns a row of preallocated caches: the cross-attention keys/values of its clip's encoder output, written
once when the clip joins, and the self-attention keys/values of the tokens it fed so far. A step runs rows 0..n-1
(n: one past the highest slot in use; free slots below it compute garbage in their own rows, which nobody reads and
the next clip there overwrites from position 0). Self-attention covers the cache's first entries up to a span (64,
128, 256, ... `max_positions`) that holds every row's position, under a mask of the slot's own positions, so a
step's shapes depend only on its rows and span, and it is replayed from a CUDA graph per span and number of rows:
powers of two up to 8, then multiples of 8 (ROW_STEP; backends.core.cuda_graphs). A joining clip takes the lowest
free slot, and the engine moves a clip from a high slot into a free one below (`move`) when that lets a step run a
smaller graph, so the rows in use stay low. The step returns three greedy choices per row, so only 3 integers per
row cross back to the host: the language token (detect_language's rule: the highest logit among language tokens,
before suppression), the next token under suppress_tokens, and the same for the first generated token, when
begin_suppress_tokens apply too.

A step is hundreds of small kernels (at one row an H100 took 3.4 ms, at 64 rows 10.2 ms from CUDA graphs:
perf/results/h100/2026-12-07e-whisper-steps.md), so with `fused` (the default) self-attention's q, k and v come from one
projection and each residual add runs with the next LayerNorm in one kernel (compiled on a GPU), as in the fused
encoder (backends.whisper.encoder): five kernels fewer a layer, the same arithmetic.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from backends.core.cuda_graphs import GraphedBatches, batch_sizes, try_graphs
from backends.whisper.encoder import add_norm

# graphs of 8, 16, 24, ... rows above 8: a step reads every row's cross-attention keys and values (245 MB a row at
# large-v3's shapes, 64 rows 15.7 GB) and self-attention cache (73 MB), so with powers of two 33 rows in use would
# read 64 rows' worth
ROW_STEP = 8
# self-attention spans: a row's self-attention cache is 73 MB at large-v3's shapes (448 positions), while clips of a
# few seconds end within 100 tokens
FIRST_SPAN = 64


def residual_norm(hidden: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after `update` and its LayerNorm (the next sublayer's input); a function of its own, so
    that its compiled kernels are cached apart from the encoder's."""
    return add_norm(hidden, update, weight, bias, eps, None)


class SlotDecoder:
    def __init__(self, model, slots: int, graphs: bool, fused: bool = True):
        """`model`: a WhisperForConditionalGeneration (eval, on its device and dtype); `fused`: see the module's
        docstring."""
        config, gen = model.config, model.generation_config
        self.model, self.decoder, self.slots = model, model.model.decoder, slots
        self.heads, self.head_dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
        self.max_positions = config.max_target_positions
        device, dtype = model.device, model.dtype
        self.device = device
        frames = config.max_source_positions
        layers = len(self.decoder.layers)
        # one tensor each for all layers (self_kv, cross_kv: its per-layer views), so that moving a slot is two
        # copies, not two a layer; zeros, not empty: masked entries still enter attention's weighted sum (as 0 x
        # value), so no NaN may sit there
        self.self_cache = torch.zeros(layers, 2, slots, self.heads, self.max_positions, self.head_dim, dtype=dtype,
                                      device=device)
        self.cross_cache = torch.zeros(layers, 2, slots, self.heads, frames, self.head_dim, dtype=dtype, device=device)
        self.self_kv, self.cross_kv = list(self.self_cache), list(self.cross_cache)
        self.suppress = torch.tensor(gen.suppress_tokens or [], dtype=torch.long, device=device)
        self.begin_suppress = torch.tensor(gen.begin_suppress_tokens or [], dtype=torch.long, device=device)
        self.language_ids = torch.tensor(sorted(gen.lang_to_id.values()), device=device)
        self.positions = torch.arange(self.max_positions, device=device)
        # self-attention's q, k and v in one projection (k has no bias: zeros in its place), made once: a copy of
        # the weights (large-v3: 315 MB)
        self.qkv = [(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                     torch.cat([a.q_proj.bias, torch.zeros_like(a.q_proj.bias), a.v_proj.bias]))
                    for a in (layer.self_attn for layer in self.decoder.layers)] if fused else None
        self.residual_norm = torch.compile(residual_norm, dynamic=True) if fused and device.type == "cuda" \
            else residual_norm
        self.sizes = batch_sizes(slots, ROW_STEP)
        self.spans = [span for span in (FIRST_SPAN << i for i in range(self.max_positions.bit_length()))
                      if span < self.max_positions] + [self.max_positions]
        self.graphs = self._capture() if graphs and device.type == "cuda" else None

    def _capture(self) -> dict[int, GraphedBatches] | None:
        """A step's graphs for each span (None, said in the log, when one cannot be captured: steps run op by
        op)."""
        graphs = {}
        for span in self.spans:
            graphs[span] = try_graphs(functools.partial(self._step, span=span), [(), ()], [torch.long, torch.long],
                                      self.device, self.slots, step=ROW_STEP)
            if graphs[span] is None:
                return None
        return graphs

    def rows(self, used: int) -> int:
        """The rows a step computes when `used` rows are asked for: the smallest graph that holds them when steps
        run from CUDA graphs, else `used`."""
        return next(size for size in self.sizes if size >= used) if self.graphs else used

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d_model] -> [B, heads, T, head_dim]"""
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def _add_norm(self, x: torch.Tensor, update: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        return self.residual_norm(x, update, norm.weight, norm.bias, norm.eps)

    def _self_qkv(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Layer i's self-attention q, k and v of `h` [rows, 1, d_model], each [rows, heads, head_dim]."""
        rows = h.shape[0]
        if self.qkv is not None:
            return F.linear(h, *self.qkv[i]).view(rows, 3, self.heads, self.head_dim).unbind(1)
        a = self.decoder.layers[i].self_attn
        return tuple(proj(h).view(rows, self.heads, self.head_dim) for proj in (a.q_proj, a.k_proj, a.v_proj))

    @torch.inference_mode()
    def join(self, slots: torch.Tensor, encoded: torch.Tensor) -> None:
        """Clips' encoder outputs [len(slots), frames, d_model] into the cross-attention caches of `slots` (indices
        on the device)."""
        for layer, kv in zip(self.decoder.layers, self.cross_kv):
            kv[0].index_copy_(0, slots, self._heads(layer.encoder_attn.k_proj(encoded)))
            kv[1].index_copy_(0, slots, self._heads(layer.encoder_attn.v_proj(encoded)))

    @torch.inference_mode()
    def move(self, source: int, target: int, positions: int) -> None:
        """A clip's caches from slot `source` into the free slot `target` (its first `positions` self-attention
        entries: the rest are masked), on the current stream, so ordered before the next step."""
        self.cross_cache[:, :, target].copy_(self.cross_cache[:, :, source])
        self.self_cache[:, :, target, :, :positions].copy_(self.self_cache[:, :, source, :, :positions])

    @torch.inference_mode()
    def step(self, tokens: list[int], positions: list[int]) -> list[list[int]]:
        """Feed `tokens[i]` at `positions[i]` to slot i (i < len(tokens)); per row [language, next, first next]."""
        ids = torch.tensor(tokens, device=self.device)
        at = torch.tensor(positions, device=self.device)
        span = next(span for span in self.spans if span > max(positions))
        (choices,) = self.graphs[span](ids, at) if self.graphs else (self._step(ids, at, span),)
        return choices.tolist()

    def _step(self, ids: torch.Tensor, at: torch.Tensor, span: int) -> torch.Tensor:
        """ids, at: [rows] (every position below `span`) -> [rows, 3] greedy choices (see the module's
        docstring)."""
        rows = ids.shape[0]
        index = torch.arange(rows, device=ids.device)
        mask = (self.positions[:span] <= at[:, None])[:, None, None, :]  # [rows, 1, 1, span]
        x = (self.decoder.embed_tokens(ids) + self.decoder.embed_positions.weight[at])[:, None]  # [rows, 1, d]
        layers = self.decoder.layers
        h = layers[0].self_attn_layer_norm(x)
        for i, (layer, kv, cross) in enumerate(zip(layers, self.self_kv, self.cross_kv)):
            q, k, v = self._self_qkv(i, h)
            keys, values = kv[0, :rows, :, :span], kv[1, :rows, :, :span]
            keys[index, :, at], values[index, :, at] = k, v
            attn = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask)
            x, h = self._add_norm(x, layer.self_attn.out_proj(attn.transpose(1, 2).flatten(2)),
                                  layer.encoder_attn_layer_norm)
            attn = F.scaled_dot_product_attention(self._heads(layer.encoder_attn.q_proj(h)), cross[0, :rows],
                                                  cross[1, :rows])
            x, h = self._add_norm(x, layer.encoder_attn.out_proj(attn.transpose(1, 2).flatten(2)),
                                  layer.final_layer_norm)
            following = layers[i + 1].self_attn_layer_norm if i + 1 < len(layers) else self.decoder.layer_norm
            x, h = self._add_norm(x, layer.fc2(layer.activation_fn(layer.fc1(h))), following)
        logits = self.model.proj_out(h[:, 0]).float()
        language = self.language_ids[logits[:, self.language_ids].argmax(-1)]
        logits = logits.index_fill(-1, self.suppress, -torch.inf)
        first = logits.index_fill(-1, self.begin_suppress, -torch.inf).argmax(-1)
        return torch.stack([language, logits.argmax(-1), first], dim=1)
