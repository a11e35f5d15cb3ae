"""Turns a scheduled batch into the model's tensors, runs it, and returns the logits of each sequence's last token
(the only logits anyone reads), or in decode steps of each row.

A decode step has one row per token it computes: a sequence's newest token, with speculative decoding the
tokens proposed after it, and every token of a short prompt riding the step (each row attends to its sequence's
blocks up to its own position, so the rows of one sequence are causal among themselves and the step is still a
decode step: same kernels, same graphs). A prefill step of prompts that found a prefix cached runs the same way when
its tokens fit (`as_rows`); in a multimodal engine a row at an image position takes its features from a static
buffer instead of its token's embedding.
Decode steps run with fixed shapes: the rows are padded to a bucket (1, 2, 4, ... rows) and the block tables to
a power-of-two number of blocks; padded rows write and read only the scratch block. On CUDA each (batch, blocks)
shape is captured once as CUDA graphs (GRAPH_PIECES of them, of consecutive layers) and replayed, so a step costs its
kernels' time, not thousands of launches.
On the CPU the same padded path runs eagerly (which is how the tests check it).

A prefill step of fresh prompts (nothing cached, no adapters) of up to `prefill_graph_tokens` tokens in all is padded
the same way to a size of PREFILL_SIZES and replayed from a graph too: eagerly it is bound by the host (on the H200
an 8B model's 257-token prefill took about 45 ms of launches for a few ms of kernels). Its input is the embeddings
(image features already in place) and each prompt's bounds; the padding is one more prompt, written to the scratch
block.

With LoRA slots, every step hands the model its rows' adapters as tiles (backends/llm/lora.py); decode graphs read
them from static buffers like the token ids.
"""
from __future__ import annotations

import bisect
import itertools
import logging
from typing import Callable

import torch

from backends.core.devices import to_device
from backends.llm.attention import AttentionMetadata, decode_kernel
from backends.llm.kv_cache import SCRATCH_BLOCK, BlockManager
from backends.llm.lora import MIXED, LoraSlots, LoraStep, plan_tiles
from backends.llm.model import DecoderModel
from backends.llm.sequence import Sequence

log = logging.getLogger(__name__)

GRAPH_PIECES = 4  # decode graphs captured as this many graphs of consecutive layers, replayed one after the other:
# the GPU starts on the first while the host launches the rest. On the H200 (Llama-3-8B shapes, bf16, one run against
# whole graphs; perf/results/h200/2026-12-05-llm-engine-pieces.md) batch 1 1.05x, 64 x 128/128 1.08x
GRAPH_RAMP = False  # pieces of 1, 2, 4, ... layers instead (the last takes the rest): the GPU starts once one layer's
# kernels are launched, and each later launch has the time of the pieces before it. Alone it costs (H200: batch 1
# 0.93x, 64 x 128/128 0.90x); with overlap_steps, against 4 pieces, the H100 1.14x / 1.10x (one run) and the H200
# either way in three runs (perf/results/h200/README.md, 2026-12-05 afternoon): within the noise
PREFILL_SIZES = (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)  # padding <= 1.5x


def prefill_sizes(max_tokens: int) -> tuple[int, ...]:
    """The padded sizes of prefill graphs up to `max_tokens` (the last one is max_tokens itself)."""
    return (*(size for size in PREFILL_SIZES if size < max_tokens), max_tokens) if max_tokens else ()


def bucket(n: int) -> int:
    """The power of two at or above n."""
    return 1 << (n - 1).bit_length()


def lora_row(seq: Sequence) -> tuple[list[int], list[float]]:
    """The sequence's (slots, weights) padded to MIXED; weight = the adapter's alpha/r times its share."""
    pad = MIXED - len(seq.lora)
    return seq.lora_slots + [0] * pad, [share * adapter.scaling for adapter, share in seq.lora] + [0.0] * pad


def image_features(rows: list[tuple[Sequence, int]]) -> tuple[list[int], torch.Tensor] | None:
    """The decode rows at image positions (a multimodal prompt's uncached part run as rows) and their features
    [rows, hidden]; None when there are none (decoding rows are past every image)."""
    index, features = [], []
    for i, (seq, position) in enumerate(rows):
        places = seq.embed_positions
        if seq.embeds is not None and places and position <= places[-1]:
            k = bisect.bisect_left(places, position)
            if places[k] == position:
                index.append(i)
                features.append(seq.embeds[k])
    return (index, torch.stack(features)) if index else None


def piece_bounds(layers: int) -> list[int]:
    """Where the decode graph's pieces start and end, in layers: GRAPH_PIECES equal ones, or with GRAPH_RAMP each
    twice the one before (a last one shorter than the one before it joins it)."""
    if not GRAPH_RAMP:
        pieces = max(1, min(GRAPH_PIECES, layers))
        return [round(i * layers / pieces) for i in range(pieces + 1)]
    bounds = [0]
    while bounds[-1] < layers:
        end = 2 * bounds[-1] + 1
        bounds.append(layers if layers - end < end - bounds[-1] else end)
    return bounds


class GraphPieces:
    """CUDA graphs replayed in order, as one."""

    def __init__(self, graphs: list[torch.cuda.CUDAGraph]):
        self.graphs = graphs

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: list, blocks: BlockManager, max_batch: int,
                 max_context: int, capture: bool, paged_decode: bool = True, lora: LoraSlots | None = None,
                 prefill_graph_tokens: int = 0, image_rows: bool = False):
        """`max_batch`: the most rows of a decode step (sequences, times their proposals + 1 when speculating);
        `prefill_graph_tokens`: the largest padded prefill (0: prefill runs eagerly); `image_rows`: decode rows may
        be image positions (a multimodal prompt whose prefix was cached runs as rows of a decode step), whose
        embeddings then come from a static buffer of features."""
        self.model, self.kv_cache, self.blocks, self.lora = model, kv_cache, blocks, lora
        self.device = model.embed_tokens.weight.device
        self.decode_kernel = decode_kernel(self.device) if paged_decode else None  # None: gather + SDPA
        self.max_batch, self.max_blocks = bucket(max_batch), bucket(-(-max_context // blocks.block_size))
        self.capture = capture
        # static decode inputs sized for the largest bucket, in one buffer (ids | positions | slots | LoRA rows |
        # LoRA tiles | their number | image rows' mask | block tables): a step fills a host mirror and sends it in one
        # copy; graphs read the device views in place. A step has at most one LoRA tile a row. Two host mirrors, used
        # in turn: a step may be prepared while the one before it is still queued (overlap_steps), its copy not yet
        # made.
        b, pinned = self.max_batch, self.device.type == "cuda"
        self.tiles_at, self.count_at = tiles_at, count_at = 4 * b, (4 + 2 + MIXED) * b
        self.mask_at = count_at + 1
        self.tables_at = self.mask_at + b
        size = self.tables_at + b * self.max_blocks
        self.staged = torch.full((size,), SCRATCH_BLOCK, dtype=torch.int64, device=self.device)
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in self.hosts] if pinned else None  # each mirror's last copy
        self.turn = 0
        self.ids, self.positions, self.slots = self.staged[:b], self.staged[b:2 * b], self.staged[2 * b:3 * b]
        self.lora_perm, self.lora_tiles = self.staged[3 * b:tiles_at], self.staged[tiles_at:count_at].view(b, 2 + MIXED)
        self.lora_tile_count = self.staged[count_at:self.mask_at]
        self.image_mask = self.staged[self.mask_at:self.tables_at]
        self.tables = self.staged[self.tables_at:].view(b, self.max_blocks)
        self.lora_weights = torch.zeros(b, MIXED, device=self.device)  # the tiles' weights, in a float buffer
        self.host_weights = [torch.zeros(b, MIXED, pin_memory=pinned) for _ in self.hosts]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        # fresh prompts: varlen attention over their own keys (an FP8 cache is read back instead, as decode reads it;
        # flash attention takes 16-bit floats)
        dtype = model.embed_tokens.weight.dtype
        self.image_rows = torch.zeros(b, model.args.hidden_size, dtype=dtype, device=self.device) if image_rows \
            else None
        self.varlen = model.kv_cache_dtype == dtype and (self.device.type == "cpu" or dtype.itemsize == 2)
        self.prefill_sizes = prefill_sizes(prefill_graph_tokens) if self.varlen else ()
        if self.prefill_sizes:  # static inputs of the largest padded prefill: embeddings | positions, slots | bounds
            tokens = self.prefill_sizes[-1]
            self.prefill_x = torch.zeros(tokens, model.args.hidden_size, dtype=dtype, device=self.device)
            self.prefill_staged = torch.zeros(2 * tokens, dtype=torch.int64, device=self.device)
            self.prefill_host = torch.zeros(2 * tokens, dtype=torch.int64, pin_memory=pinned)
            self.prefill_bounds = torch.zeros(b + 2, dtype=torch.int32, device=self.device)  # B <= max_batch
            self.prefill_host_bounds = torch.zeros(b + 2, dtype=torch.int32, pin_memory=pinned)
            self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        rows = [s.block_table + [SCRATCH_BLOCK] * (width - len(s.block_table)) for s in seqs]
        return self.tensor(rows, torch.int32)

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """The next `step_tokens` uncached tokens of each sequence (a prompt, a chunk of one, or a decoding
        sequence's newest token); logits [B, vocab] of each sequence's last computed token."""
        ids, positions, slots, last, embed_index, embed_rows = [], [], [], [], [], []
        for seq in seqs:
            end = seq.num_cached + seq.step_tokens
            span = range(seq.num_cached, end)
            if seq.embeds is not None:  # image features replace their placeholders (positions ascend)
                first = bisect.bisect_left(seq.embed_positions, seq.num_cached)
                stop = bisect.bisect_left(seq.embed_positions, end)
                embed_index += [len(ids) + p - seq.num_cached for p in seq.embed_positions[first:stop]]
                embed_rows.append(seq.embeds[first:stop])
            ids += seq.token_ids[seq.num_cached:end]
            positions += span
            slots += [self.blocks.slot(seq, p) for p in span]
            last.append(len(ids) - 1)
        fresh = tuple(s.step_tokens for s in seqs) if all(s.num_cached == 0 for s in seqs) else None
        embeds = (self.tensor(embed_index), torch.cat(embed_rows).to(self.device)) if embed_index else None
        lora = self.lora_step(seqs)
        if fresh and lora is None and self.prefill_sizes and len(seqs) <= self.max_batch:
            if size := next((size for size in self.prefill_sizes if size >= len(ids)), None):
                x = self.model.embed(self.tensor(ids), embeds)
                return self.model.logits(self.prefill_padded(x, positions, slots, fresh, size)[self.tensor(last)])
        # the eager step's per-token metadata (the padded one needs none of it)
        max_query = max(s.step_tokens for s in seqs)
        query_positions = [[*range(s.num_cached, s.num_cached + s.step_tokens), *[0] * (max_query - s.step_tokens)]
                           for s in seqs]
        seq_index = [b for b, s in enumerate(seqs) for _ in range(s.step_tokens)]
        query_index = [i for s in seqs for i in range(s.step_tokens)]
        varlen = (self.tensor([0, *itertools.accumulate(fresh)], torch.int32), max(fresh)) \
            if fresh and self.varlen else None
        meta = AttentionMetadata(self.tensor(slots), self.block_tables(seqs), self.tensor(query_positions),
                                 (self.tensor(seq_index), self.tensor(query_index)),
                                 max(s.num_cached + s.step_tokens for s in seqs), fresh, self.decode_kernel,
                                 tuple((s.step_tokens, s.num_cached + s.step_tokens) for s in seqs), varlen=varlen)
        hidden = self.model(self.tensor(ids), self.tensor(positions), self.kv_cache, meta, embeds, lora)
        return self.model.logits(hidden[self.tensor(last)])

    def as_rows(self, seqs: list[Sequence]) -> bool:
        """Whether a prefill step of these sequences had better run as rows of a decode step (each token a row, on
        CUDA from the decode graphs): when some prompt has a cached prefix (the prefill graphs take fresh prompts
        only; the eager path is bound by the host, about 1 ms a layer on an H200) and the rows fit the graphs."""
        return (any(s.num_cached for s in seqs) and sum(s.step_tokens for s in seqs) <= self.max_batch
                and max(len(s.block_table) for s in seqs) <= self.max_blocks
                and (self.image_rows is not None or all(s.embeds is None for s in seqs)))

    def prefill_padded(self, x: torch.Tensor, positions: list[int], slots: list[int], lengths: tuple[int, ...],
                       size: int) -> torch.Tensor:
        """Hidden states [size, hidden] of fresh prompts (embeddings `x`, their `lengths`) padded to `size` tokens,
        from the static inputs (on CUDA replaying that size's graph); the rows past the prompts are padding."""
        n, tokens = len(positions), len(self.prefill_x)
        host, bounds = self.prefill_host.numpy(), self.prefill_host_bounds.numpy()
        host[:n], host[n:size] = positions, 0
        host[tokens:tokens + n], host[tokens + n:tokens + size] = slots, SCRATCH_BLOCK * self.blocks.block_size
        bounds[:len(lengths) + 1] = [0, *itertools.accumulate(lengths)]
        bounds[len(lengths) + 1:] = size  # the padding, then empty prompts
        self.prefill_staged[:tokens + size].copy_(self.prefill_host[:tokens + size], non_blocking=True)
        self.prefill_bounds.copy_(self.prefill_host_bounds, non_blocking=True)
        self.prefill_x[:n].copy_(x)  # padded rows keep earlier embeddings: finite, and seen by no prompt
        if not self.capture:
            return self.prefill_static(size)
        if size not in self.prefill_graphs:
            self.prefill_graphs[size] = self.record(lambda: self.prefill_static(size))
        graph, hidden = self.prefill_graphs[size]
        graph.replay()
        return hidden

    def prefill_static(self, size: int) -> torch.Tensor:
        tokens = len(self.prefill_x)
        positions, slots = self.prefill_staged[:size], self.prefill_staged[tokens:tokens + size]
        meta = AttentionMetadata(slots, self.tables[:1], positions[:1, None], None, size,
                                 varlen=(self.prefill_bounds, size))
        return self.model.layers_forward(self.prefill_x[:size], positions, self.kv_cache, meta)

    def lora_step(self, seqs: list[Sequence], counts: list[int] | None = None) -> LoraStep | None:
        """The adapters of a step's token rows (`counts` rows a sequence, default its `step_tokens`); None when no
        sequence has any."""
        if self.lora is None or not any(s.lora for s in seqs):
            return None
        counts = counts or [seq.step_tokens for seq in seqs]
        firsts = [0, *itertools.accumulate(counts)][:-1]
        plan = plan_tiles((first, count, *lora_row(seq)) for first, count, seq in zip(firsts, counts, seqs) if seq.lora)
        return LoraStep(self.lora, self.tensor(plan.perm), self.tensor(plan.tiles),
                        self.tensor(plan.weights, torch.float32), self.tensor([len(plan.tiles)]))

    def decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None, rows: list[int] | None = None
               ) -> torch.Tensor:
        """Every uncached token of each sequence (its newest one, a prompt, or more after a rollback in a draft's
        cache), then its `draft_ids`, or the first `rows[i]` of them (a prompt's chunk); logits [rows, vocab], a
        sequence's rows in order. `ids`: the rows' token ids on the device (the host's copy of them is not read), so
        a step can follow the last without a device sync."""
        rows = [(seq, position) for i, seq in enumerate(seqs) for position in range(
            seq.num_cached, seq.num_tokens + len(seq.draft_ids) if rows is None else seq.num_cached + rows[i])]
        widest = max(len(s.block_table) for s in seqs)
        if len(rows) <= self.max_batch and widest <= self.max_blocks:
            return self.decode_padded(rows, bucket(len(rows)), bucket(widest), ids)
        return self.decode_eager(rows, ids)

    @staticmethod
    def row_token(seq: Sequence, position: int) -> int:
        return seq.token_ids[position] if position < seq.num_tokens else seq.draft_ids[position - seq.num_tokens]

    def decode_padded(self, rows: list[tuple[Sequence, int]], batch: int, width: int,
                      ids: torch.Tensor | None = None) -> torch.Tensor:
        n, b = len(rows), self.max_batch
        self.turn ^= 1
        if self.copied is not None and not self.copied[self.turn].query():  # (two steps ago: done, unless steps
            self.copied[self.turn].synchronize()  # are queued deeper than that)
        staging, weights = self.hosts[self.turn], self.host_weights[self.turn]
        host = staging.numpy()  # padded rows: token 0 at position 0, written to and read from the scratch block
        host[:self.tables_at] = 0
        host[:n] = 0 if ids is not None else [self.row_token(s, p) for s, p in rows]
        host[b:b + n] = [p for _, p in rows]
        host[2 * b:2 * b + n] = [self.blocks.slot(s, p) for s, p in rows]
        host[2 * b + n:2 * b + batch] = SCRATCH_BLOCK * self.blocks.block_size
        tables = host[self.tables_at:self.tables_at + batch * self.max_blocks].reshape(batch, self.max_blocks)
        tables[:, :width] = SCRATCH_BLOCK
        for row, (seq, _) in zip(tables, rows):
            row[:len(seq.block_table)] = seq.block_table
        if self.image_rows is not None and (images := image_features(rows)):
            for i in images[0]:
                host[self.mask_at + i] = 1
            self.image_rows[self.tensor(images[0])] = images[1].to(self.image_rows)
        if self.lora is not None:  # rows without adapters (and padded rows) are in no tile
            plan = plan_tiles((i, 1, *lora_row(seq)) for i, (seq, _) in enumerate(rows) if seq.lora)
            tiles = len(plan.tiles)
            host[3 * b:3 * b + len(plan.perm)] = plan.perm
            host[self.tiles_at:self.tiles_at + tiles * (2 + MIXED)] = plan.tiles.ravel()
            host[self.count_at] = tiles
            if tiles:
                weights[:tiles] = torch.from_numpy(plan.weights)
                self.lora_weights[:tiles].copy_(weights[:tiles], non_blocking=True)
        used = self.tables_at + batch * self.max_blocks  # one host-to-device copy (asynchronous from pinned memory)
        self.staged[:used].copy_(staging[:used], non_blocking=True)
        if self.copied is not None:
            self.copied[self.turn].record()
        if ids is not None:
            self.ids[:n].copy_(ids)
        if not self.capture:
            return self.forward_static(batch, width)[:n]
        if (batch, width) not in self.graphs:
            self.graphs[batch, width] = self.capture_graph(batch, width)
        graph, logits = self.graphs[batch, width]
        graph.replay()
        return logits[:n]

    def capture_all(self) -> int:
        """Capture every prefill size and (batch, blocks) bucket now, largest first, so no request pays for a
        capture (or a kernel compile). The static inputs point at the scratch block while capturing. Returns the
        number of graphs."""
        self.ids.zero_()
        self.positions.zero_()
        self.slots.fill_(SCRATCH_BLOCK * self.blocks.block_size)
        self.tables.fill_(SCRATCH_BLOCK)
        if self.prefill_sizes:
            tokens = len(self.prefill_x)
            self.prefill_staged[:tokens].zero_()
            self.prefill_staged[tokens:].fill_(SCRATCH_BLOCK * self.blocks.block_size)
            try:
                for size in reversed(self.prefill_sizes):
                    self.prefill_bounds.fill_(size)
                    self.prefill_bounds[0] = 0
                    self.prefill_graphs[size] = self.record(lambda: self.prefill_static(size))
            except Exception as exc:  # an op that capture refuses: prefill stays eager, a slower path
                log.warning("prefill CUDA graphs unavailable (%s: %s); prefill runs eagerly", type(exc).__name__, exc)
                torch.cuda.synchronize(self.device)
                self.prefill_sizes, self.prefill_graphs = (), {}
        batches = [1 << i for i in range(self.max_batch.bit_length())]
        widths = [1 << i for i in range(self.max_blocks.bit_length())]
        for batch in reversed(batches):  # largest first: the smaller ones that follow reuse its pool memory
            for width in reversed(widths):
                if (batch, width) not in self.graphs:
                    self.graphs[batch, width] = self.capture_graph(batch, width)
        return len(self.graphs) + len(self.prefill_sizes)

    def static_step(self, batch: int, width: int) -> tuple[AttentionMetadata, LoraStep | None]:
        """A decode step's metadata and adapters over the static inputs (new each time: the metadata caches
        per-step tensors, which a capture must compute inside its graph)."""
        meta = AttentionMetadata(self.slots[:batch], self.tables[:batch, :width], self.positions[:batch, None], None,
                                 width * self.blocks.block_size, decode_kernel=self.decode_kernel)
        lora = None if self.lora is None else LoraStep(self.lora, self.lora_perm[:batch], self.lora_tiles[:batch],
                                                       self.lora_weights[:batch], self.lora_tile_count)
        return meta, lora

    def embed_static(self, batch: int) -> torch.Tensor:
        """A decode step's input embeddings from the static inputs: the rows' tokens', or their image features."""
        x = self.model.embed(self.ids[:batch])
        if self.image_rows is None:
            return x
        return torch.where(self.image_mask[:batch, None] != 0, self.image_rows[:batch], x)

    def forward_static(self, batch: int, width: int) -> torch.Tensor:
        meta, lora = self.static_step(batch, width)
        x = self.model.layers_forward(self.embed_static(batch), self.positions[:batch], self.kv_cache, meta, lora)
        return self.model.logits(x)

    def capture_graph(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph | GraphPieces, torch.Tensor]:
        bounds = piece_bounds(len(self.model.layers))
        pieces = len(bounds) - 1
        if pieces <= 1:
            return self.record(lambda: self.forward_static(batch, width))
        # piece i runs layers bounds[i]..bounds[i + 1]; the first also embeds, the last also computes the logits. A
        # piece's output (and the first's metadata and rotary tables) is the next one's input: `held` keeps the
        # tensors of the last call, the captured ones
        model, held = self.model, {}

        def piece(i: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                if i == 0:
                    held["step"], held["rope"] = self.static_step(batch, width), model.rope(self.positions[:batch])
                x = self.embed_static(batch) if i == 0 else held[i - 1]
                x = held[i] = model.run_layers(x, held["rope"], self.kv_cache, *held["step"], bounds[i], bounds[i + 1])
                return model.logits(model.norm(x)) if i == pieces - 1 else x
            return run

        recorded = [self.record(piece(i)) for i in range(pieces)]
        return GraphPieces([graph for graph, _ in recorded]), recorded[-1][1]

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream (this also runs the current step: its cache writes repeat identically on
        replay), then record the step into a graph sharing one memory pool with the others."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        return graph, out

    def decode_eager(self, rows: list[tuple[Sequence, int]], ids: torch.Tensor | None = None) -> torch.Tensor:
        seqs = [seq for seq, _ in rows]
        positions = [p for _, p in rows]
        meta = AttentionMetadata(self.tensor([self.blocks.slot(s, p) for s, p in rows]), self.block_tables(seqs),
                                 self.tensor([[p] for p in positions]), None, max(positions) + 1,
                                 decode_kernel=self.decode_kernel)
        lora = self.lora_step(seqs, [1] * len(rows))
        ids = self.tensor([self.row_token(s, p) for s, p in rows]) if ids is None else ids
        embeds = None if (images := image_features(rows)) is None else (self.tensor(images[0]), images[1].to(self.device))
        hidden = self.model(ids, self.tensor(positions), self.kv_cache, meta, embeds, lora)
        return self.model.logits(hidden)
