"""LLMEngine: continuous batching over a paged KV cache. One step = schedule, run, postprocess.

    engine = LLMEngine(checkpoint_dir, EngineConfig(dtype="bf16"))
    seq = engine.add("Hello", SamplingParams(max_tokens=32))
    while engine.has_work:
        for s in engine.step():          # sequences that produced a token this step
            print(pending_text(s), end="")

The engine is not thread-safe: one loop owns it (the Triton adapter's background thread), and other threads hand
it requests through that loop.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from backends.core.devices import DTYPES, resolve_device, to_device
from backends.core.errors import InvalidInput
from backends.core.params import bounded, choice, device
from backends.core.qos import QosParams, QosPolicy, Ticket
from backends.llm.attention import AttentionMetadata
from backends.llm.detokenizer import append_text, flush_text
from backends.llm.adapter_cache import AUTO, AdapterCache
from backends.llm.adapters import LoraAdapter
from backends.llm.kv_cache import BlockManager, allocate_kv_cache, kv_bytes_per_block
from backends.llm.lora import LoraSlots
from backends.llm.model import DecoderModel, load_model
from backends.llm.runner import ModelRunner
from backends.llm.sampling import Drawn, SamplingParams, chosen, draw, sample
from backends.llm.scheduler import Scheduler
from backends.llm.sequence import Sequence, Status
from backends.llm.speculative import (Draft, DraftProposer, NgramProposer, mask_early_eos, next_length,
                                      verify_greedy, verify_sampled)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig(QosParams):
    """The engine's settings; also the `mm_llm` backend's model-config parameters (build_engines writes them)."""

    dtype: str = choice("bf16", *(d for d in DTYPES if d != "bf16"))
    device: str = device()  # auto: cuda when available
    block_size: int = bounded(16, 1)
    max_batch: int = bounded(64, 1)  # sequences running at once
    max_prefill_tokens: int = bounded(8192, 1)  # prompt tokens in one prefill step (one longer prompt still runs alone)
    max_model_len: int | None = bounded(None, 1)  # prompt + output; default: the checkpoint's max_position_embeddings
    kv_cache_memory_mb: int | None = bounded(None, 1)  # default: 256 MiB on CPU; on GPU what gpu_memory_utilization leaves
    kv_cache_blocks: int | None = bounded(None, 1)  # an exact block count instead of a memory budget
    gpu_memory_utilization: float = bounded(0.9, 0, 1, low_open=True)
    cuda_graphs: bool = True  # decode steps replay CUDA graphs (CUDA only)
    graph_max_context: int = bounded(4096, 1)  # longest context a graph covers; longer decode steps run eagerly
    prefill_graph_tokens: int = bounded(2048, 0)  # prefill steps of fresh prompts up to this many tokens replay CUDA
    # graphs (padded by up to 1.5x; longer ones are bound by their kernels, not the host); 0: prefill runs eagerly
    compile_kernels: bool = True  # torch.compile the elementwise kernels (norms, rotary, SiLU): CUDA only
    prefix_caching: bool = True  # full KV blocks shared between requests with the same prefix (kv_cache.py)
    chunk_tokens: int | None = bounded(None, 1)  # chunked prefill: while sequences decode, a step computes at most
    # this many tokens, theirs and chunks of new prompts; unset (default until prefill steps run from CUDA graphs:
    # measured no faster, README): a new prompt prefills whole in a step of its own
    prompt_rows: int = bounded(32, 0)  # a decode step also computes up to this many prompt tokens in rows its CUDA
    # graph has spare: a prompt that fits joins it whole instead of a prefill step of its own; 0: never
    overlap_steps: bool | None = None  # launch the next decode step before this one's tokens are back (no prompt
    # waiting), else as soon as they are, before their text is decoded: the GPU runs while the host works. Unset: on
    # a GPU (Llama-3-8B shapes, bf16, H100, since the EOS mask no longer waits for the stream: 64 x 128/128
    # 1.13-1.20x, batch 1 1.04-1.08x in two runs; README), off on the CPU, where a step is done when launched and
    # there is nothing to overlap
    qos_lower_rides: bool = False  # while a higher QoS class runs, lower-class text prompts start only in decode
    # steps, in chunks of prompt_rows (decode graphs get that many more rows), never by a prefill step that holds the
    # higher class up; off: they start within qos_lower_share (not yet measured on a GPU: README, QoS)
    qos_lower_share: float = bounded(0.1, 0, 1, low_open=True)  # while a higher QoS class runs, prompts of lower
    # classes (that cannot ride decode steps: qos_lower_rides) start in at most this share of the engine's time (1:
    # no limit; overdue ones always start). 0.1 since 12-06: the high class's p99 at 2x capacity 1.08x its light
    # p99 against 2.30x with 0.25 (perf.qos on an H100, two runs of one lease; the low class 18% fewer done at 2x)
    qos_lower_tokens: int | None = bounded(2048, 1)  # and in steps of at most this many prompt tokens (a longer
    # prompt alone); unset: max_prefill_tokens
    qos_lower_step_ms: float = bounded(25.0, 0)  # and of at most the prompt tokens that recent prefill steps computed
    # in this time: how long one such step holds the higher class up (0: no such cap). H200, side by side at 2x
    # capacity: the high class's p99 361.6 ms against 1,684 without it, and more low requests served (README, QoS)
    decode_attention: str = choice("paged", "gather")  # paged: the Triton kernel reading KV blocks in place (CUDA);
    # gather: copy each sequence's blocks, then SDPA (the reference; what runs on the CPU)
    decode_linear: str = choice("gemv", "library")  # gemv: one-token steps run their linear layers as the Triton
    # kernels of gemv.py, the norms, SiLU * up and residual adds around them fused (CUDA); library: cuBLAS
    # (torch._scaled_mm for FP8) and separate kernels, what larger steps and the CPU run
    max_loras: int = bounded(0, 0)  # LoRA adapters on the device at once (slots shared by a step); 0: LoRA off
    max_lora_rank: int = bounded(16, 1)  # adapters of higher rank are refused; lower ranks are padded
    max_cpu_loras: int | None = bounded(None, 1)  # adapters kept on the host (default 4 x max_loras)
    lora_root: str = "adapters"  # folder of PEFT adapter folders (+ an optional router); relative: to the model folder
    response_threads: int = bounded(2, 1)  # served models: threads sending the streams' responses (core/outbox.py)
    speculative: str = choice("off", "ngram", "draft")  # speculative decoding's proposer (speculative.py): prompt
    # lookup, or a small draft model with the same tokenizer (draft_model)
    num_speculative_tokens: int = bounded(4, 1, 16)  # most tokens proposed for a sequence in one step
    speculative_schedule: str = choice("adaptive", "fixed")  # adaptive: per sequence, by what it accepted
    prompt_lookup_min: int = bounded(1, 1)  # ngram: the shortest and longest suffix looked up in the context
    prompt_lookup_max: int = bounded(4, 1)
    draft_model: str = "draft"  # draft: its checkpoint folder; relative: to the model folder
    speculative_max_batch: int = bounded(8, 1)  # decode steps of more sequences run without speculation (it pays
    # where a step is bound by reading the weights, not by compute)


@dataclass
class Launched:
    """A step on its way: what was scheduled, and its logits (or verified tokens, or the error it raised)."""
    seqs: list[Sequence]
    is_prefill: bool
    expired: list[Sequence]
    started: float
    done: list[int] = field(default_factory=list)  # the sequences that get a token (not prompt chunks)
    decoding: int = 0  # sequences adding their newest token
    lower: bool = False  # it started lower-class prompts beside a higher class (the QoS share, Scheduler.yielded)
    prompt_tokens: int = 0  # prompt tokens it computes
    logits: torch.Tensor | None = None
    tokens: list[list[int] | Exception] | None = None
    drawn: Drawn | None = None  # every row's token, drawn on the device for the step launched after it
    error: Exception | None = None


class StepFailed(RuntimeError):
    """The model step itself failed; `seqs` are the sequences that were in it (the caller decides their fate)."""

    def __init__(self, seqs: list[Sequence]):
        super().__init__(f"a step of {len(seqs)} sequences failed")
        self.seqs = seqs


@dataclass
class EngineStats:
    prefill_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (chunks, recomputed prompts, and those riding decode steps)
    prefill_seconds: float = 0.0  # wall time of prefill steps (chunked prefill's mixed steps too)
    decode_steps: int = 0
    decode_seconds: float = 0.0  # wall time of decode steps (short prompts riding them too)
    decode_tokens: int = 0  # sum of decode batch sizes
    max_decode_batch: int = 0
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    speculated: int = 0  # sequence-steps that verified proposals
    proposed_tokens: int = 0
    accepted_tokens: int = 0


def is_multimodal(checkpoint: Path) -> bool:
    """Whether the checkpoint is a vision-language model's (its prompts carry image features)."""
    config = checkpoint / "config.json"
    return config.exists() and "vision_config" in json.loads(config.read_text())


class LLMEngine:
    def __init__(self, checkpoint: Path, config: EngineConfig = EngineConfig(), weights=None):
        """`weights`: (name, tensor) pairs instead of the checkpoint's safetensors (see model.load_model)."""
        from transformers import AutoTokenizer, GenerationConfig

        self.config = config
        self.device = resolve_device(config.device)
        self.overlap = self.device.type == "cuda" if config.overlap_steps is None else config.overlap_steps
        self.dtype = DTYPES[config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.model = load_model(checkpoint, self.dtype, self.device, weights,
                                compile_kernels=config.compile_kernels and self.device.type == "cuda",
                                gemv=config.decode_linear == "gemv")
        args = self.model.args
        # rows of the widest decode step: its sequences (and lower-class prompt chunks riding it), or with
        # speculation each sequence with its proposals
        self.decode_rows = max(config.max_batch + (config.prompt_rows if config.qos_lower_rides else 0),
                               config.speculative_max_batch * (1 + config.num_speculative_tokens)
                               if config.speculative != "off" else 0)
        self.max_model_len = min(config.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        # the longest text a prompt that fits the context can be: every token its vocabulary's longest, 4 UTF-8
        # bytes a character; longer text is refused before it is tokenized
        self.max_prompt_bytes = self.max_model_len * 4 * max(map(len, self.tokenizer.get_vocab()), default=1)
        eos = set(args.eos_token_ids)
        if (Path(checkpoint) / "generation_config.json").exists():
            generation_eos = GenerationConfig.from_pretrained(checkpoint).eos_token_id
            eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos] if generation_eos
                       is not None else [])
        self.eos_ids = tuple(sorted(eos))
        self.adapters = None  # LoRA: device slots first, so the KV budget counts them
        if config.max_loras:
            slots = LoraSlots(args, config.max_loras, config.max_lora_rank, self.dtype, self.device)
            self.adapters = AdapterCache(Path(checkpoint) / config.lora_root, args, slots,
                                         config.max_cpu_loras or 4 * config.max_loras)
            log.info("LoRA: %d device slots of rank %d (%.0f MiB), adapters from %s", config.max_loras,
                     config.max_lora_rank, slots.nbytes / 2**20, self.adapters.root)
        per_block = kv_bytes_per_block(args.num_hidden_layers, config.block_size, args.num_key_value_heads,
                                       args.head_dim, self.model.kv_cache_dtype)
        draft = self._load_draft(Path(checkpoint)) if config.speculative == "draft" else None
        if draft is not None:  # the draft's cache holds as many tokens as the model's: it shares the budget
            per_block += kv_bytes_per_block(draft.args.num_hidden_layers, config.block_size,
                                            draft.args.num_key_value_heads, draft.args.head_dim, draft.kv_cache_dtype)
        capture = config.cuda_graphs and self.device.type == "cuda"
        self.prefill_graph_tokens = min(config.prefill_graph_tokens, config.max_prefill_tokens) if capture else 0
        num_blocks = config.kv_cache_blocks or self._kv_budget() // per_block - 1  # one goes to the scratch block
        self.blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching)
        self.kv_cache = allocate_kv_cache(args.num_hidden_layers, num_blocks, config.block_size,
                                          args.num_key_value_heads, args.head_dim, self.model.kv_cache_dtype,
                                          self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.blocks, self.decode_rows,
                                  min(config.graph_max_context, self.max_model_len),
                                  capture=capture,
                                  paged_decode=config.decode_attention == "paged",
                                  lora=self.adapters and self.adapters.slots,
                                  prefill_graph_tokens=self.prefill_graph_tokens,
                                  image_rows=is_multimodal(Path(checkpoint)))
        self.scheduler = Scheduler(self.blocks, config.max_batch, config.max_prefill_tokens,
                                   chunk_tokens=config.chunk_tokens, adapters=self.adapters,
                                   lower_share=config.qos_lower_share, lower_tokens=config.qos_lower_tokens,
                                   prompt_rows=config.prompt_rows, lower_rides=config.qos_lower_rides,
                                   max_rows=self.decode_rows, lower_step_s=config.qos_lower_step_ms / 1e3)
        self.qos = QosPolicy(config)
        self.proposer = None
        if config.speculative == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif draft is not None:
            self.proposer = DraftProposer(draft, num_blocks, config.block_size, config.speculative_max_batch,
                                          config.num_speculative_tokens,
                                          min(config.graph_max_context, self.max_model_len),
                                          capture=self.runner.capture)
        if self.runner.capture:
            before = torch.cuda.memory_reserved(self.device)
            with torch.inference_mode():
                count = self.runner.capture_all()
                if isinstance(self.proposer, DraftProposer):
                    count += self.proposer.runner.capture_all()
            log.info("captured %d CUDA graphs, prefill and decode (%.2f GiB more reserved)", count,
                     (torch.cuda.memory_reserved(self.device) - before) / 2**30)
        self.stats = EngineStats()
        self.pending: Launched | None = None  # the step launched ahead (overlap_steps)
        self.completed_at = 0.0  # when the last step's tokens came back (a step launched earlier is timed from then)
        log.info("LLM engine: %s %s on %s, %d KV blocks of %d tokens (%.0f MiB, %s)", args.model_type, config.dtype,
                 self.device, num_blocks, config.block_size, num_blocks * per_block / 2**20,
                 str(self.model.kv_cache_dtype).removeprefix("torch."))

    def _load_draft(self, checkpoint: Path) -> DecoderModel:
        path = checkpoint / self.config.draft_model
        if not (path / "config.json").is_file():
            raise ValueError(f"speculative 'draft': no draft checkpoint at {path} (draft_model)")
        draft = load_model(path, self.dtype, self.device,
                           compile_kernels=self.config.compile_kernels and self.device.type == "cuda",
                           gemv=self.config.decode_linear == "gemv")
        if draft.args.vocab_size != self.model.args.vocab_size:
            raise ValueError(f"the draft model at {path} has a vocabulary of {draft.args.vocab_size} tokens, the "
                             f"model {self.model.args.vocab_size}: a draft must share the model's tokenizer")
        log.info("speculative decoding: draft %s (%d layers, hidden %d)", path, draft.args.num_hidden_layers,
                 draft.args.hidden_size)
        return draft

    def _kv_budget(self) -> int:
        if self.config.kv_cache_memory_mb:
            return self.config.kv_cache_memory_mb * 2**20
        if self.device.type != "cuda":
            return 256 * 2**20
        decode, prefill = self._measure_step_memory()
        # the graphs keep one shared pool, at least as large as the largest graph (captured first; twice that leaves
        # room for fragmentation), a prefill graph's step taken as its share of the measured prefill; longer
        # prefill steps and eager decode steps allocate their temporaries outside it
        tokens = min(self.config.max_prefill_tokens, self.max_model_len)
        graphs = max(decode, prefill * self.prefill_graph_tokens // tokens)
        reserve = prefill + (2 * graphs if self.config.cuda_graphs else decode)
        free, total = torch.cuda.mem_get_info(self.device)
        log.info("measured step memory: decode %.2f GiB, prefill %.2f GiB", decode / 2**30, prefill / 2**30)
        return int(free - (1 - self.config.gpu_memory_utilization) * total - reserve)

    @torch.inference_mode()
    def _measure_step_memory(self) -> tuple[int, int]:
        """Peak bytes of the largest decode step (the widest graph bucket) and of a max_prefill_tokens prefill, each
        run once eagerly over a one-block cache that every block table points at (the temporaries' sizes depend on
        the shapes, not on what the blocks hold)."""
        args, block = self.model.args, self.config.block_size
        cache = allocate_kv_cache(args.num_hidden_layers, 1, block, args.num_key_value_heads, args.head_dim,
                                  self.model.kv_cache_dtype, self.device)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = 1 << (self.decode_rows - 1).bit_length()
        width = 1 << (-(-min(self.config.graph_max_context, self.max_model_len) // block) - 1).bit_length()
        tokens = min(self.config.max_prefill_tokens, self.max_model_len)
        span = torch.arange(tokens, device=self.device)
        steps = [  # (ids, positions, metadata) of the largest decode step, then of the largest prefill
            (zeros(batch), zeros(batch), AttentionMetadata(zeros(batch), zeros(batch, width).int(), zeros(batch, 1),
                                                           None, width * block)),
            (zeros(tokens), span, AttentionMetadata(zeros(tokens), zeros(1, -(-tokens // block)).int(), span[None],
                                                    (zeros(tokens), span), tokens, (tokens,)))]
        peaks = []
        for ids, positions, meta in steps:
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.model.logits(self.model(ids, positions, cache, meta)[-1:])
            torch.cuda.synchronize(self.device)
            peaks.append(torch.cuda.max_memory_allocated(self.device) - base)
        del cache, steps
        torch.cuda.empty_cache()
        return peaks[0], peaks[1]

    # --- requests -------------------------------------------------------------------------------------------
    def add(self, prompt: str | list[int], sampling: SamplingParams, request_id: str = "", ticket: Ticket | None = None,
            embeds: torch.Tensor | None = None, placeholder_id: int | None = None, embeds_key: bytes | None = None,
            fault: str | None = None, lora: tuple[tuple[LoraAdapter, float], ...] = ()) -> Sequence:
        """Queue a request; raises InvalidInput when it cannot fit the context or the KV cache.
        `embeds` [n, hidden] replace the embeddings of the n prompt tokens equal to `placeholder_id` (image features
        at the image placeholders, as the prompt was expanded for them); `embeds_key` names them for the prefix
        cache (e.g. a digest of the image file; default: a digest of `embeds` itself). `lora`: the request's
        adapters and their shares (`choose_adapters`). `ticket`: its QoS class and place in the queue (default: the
        default class, no timeout); its cost score is set here, from the prompt's text and image tokens."""
        if lora and self.adapters is None:
            raise InvalidInput("this model serves no LoRA adapters (its max_loras is 0)")
        if len(lora) > self.config.max_loras:  # it could never be admitted
            raise InvalidInput(f"the request mixes {len(lora)} adapters; this model has {self.config.max_loras} "
                               "LoRA slot(s)")
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidInput("the prompt has no tokens")
        positions = tuple(i for i, token in enumerate(ids) if token == placeholder_id) if embeds is not None else ()
        if embeds is not None and len(positions) != embeds.shape[0]:
            raise InvalidInput(f"the prompt has {len(positions)} image placeholder tokens for {embeds.shape[0]} "
                               "image embeddings")
        total = len(ids) + sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidInput(f"prompt ({len(ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} exceeds "
                               f"the context length {self.max_model_len}")
        if -(-total // self.blocks.block_size) > self.blocks.num_blocks:
            raise InvalidInput(f"prompt + max_tokens ({total} tokens) exceeds the whole KV cache "
                               f"({self.blocks.num_blocks * self.blocks.block_size} tokens)")
        if embeds is not None and embeds_key is None and self.config.prefix_caching:
            embeds_key = hashlib.blake2b(embeds.detach().cpu().contiguous().view(torch.uint8).numpy()).digest()
        ticket = ticket or Ticket.untracked()
        ticket.score = self.qos.score(image_tokens=len(positions), text_tokens=len(ids) - len(positions))
        seq = Sequence(ids, sampling, request_id, ticket, embeds=embeds, embed_positions=positions,
                       embeds_key=embeds_key or b"", fault=fault, lora=lora)
        if lora:
            self.adapters.hold(a for a, _ in lora)
        self.scheduler.add(seq)
        return seq

    def choose_adapters(self, lora_id: str, prompt: str | list[int]) -> tuple[tuple[LoraAdapter, float], ...]:
        """A request's adapters for `lora_id` (a name, or "auto" for the router's top two over the prompt's mean
        input embedding); safe to call from any thread. Raises AdapterError (with NOT_FOUND for unknown names)."""
        if self.adapters is None:
            raise InvalidInput("this model serves no LoRA adapters (its max_loras is 0)")
        pooled = None
        if lora_id == AUTO:
            ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
            with torch.inference_mode():
                pooled = self.model.embed_tokens.weight[torch.tensor(ids, device=self.device)].float().mean(0)
        return self.adapters.choose(lora_id, pooled)

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence now; its KV blocks return to the pool before this returns."""
        if not seq.finished:
            self._finish(seq, "cancelled")

    # --- the loop -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one prefill or decode step; returns the sequences that got a token (some may have finished), and
        those that waited past their QoS timeout without starting (finished, with an Unavailable error).

        With `overlap_steps`, the next step is launched on the GPU before this one's tokens are back when it can be
        (`_can_follow`: it takes them on the device), else as soon as they are; this one's text is decoded (and stop
        strings looked for) while the GPU runs it, and the next call completes that step. A sequence that ends
        meanwhile (EOS, a stop string, a cancellation) computed one token too many in it, which is dropped; the
        blocks it frees are written by later steps only after that one in the device's queue."""
        launched, self.pending = self.pending or self._launch(), None
        if not launched.seqs:
            return launched.expired
        if self._can_follow(launched):
            try:
                launched.drawn = draw(launched.logits, launched.seqs, self.eos_ids)
            except Exception as e:  # raised when the step completes (as StepFailed)
                launched.error = e
            else:
                self.pending = self._launch(after=launched)
        seqs, deferred = self._complete(launched)
        if self.overlap and self.pending is None and self.proposer is None and self.scheduler.has_work:
            self.pending = self._launch()
        for seq in deferred:  # (the GPU runs the next step meanwhile)
            self._guard(seq, self._decode_text)
        return launched.expired + seqs

    @property
    def has_work(self) -> bool:
        return self.pending is not None or self.scheduler.has_work

    def _can_follow(self, launched: Launched) -> bool:
        """Whether the next step can go before `launched`'s tokens are on the host: it is a decode step of every
        running sequence, so the next step either decodes the same sequences one token further, whatever their
        tokens are (those not at their last token), or prefills waiting prompts, none of which could ride a decode
        step instead (it would have a step of its own anyway)."""
        seqs, config = launched.seqs, self.config
        shortest = self.scheduler.waiting.shortest()
        none_would_ride = shortest is None or (config.chunk_tokens is None and not config.qos_lower_rides
                                               and shortest > config.prompt_rows)
        return (self.overlap and self.proposer is None and launched.logits is not None
                and launched.error is None and not launched.is_prefill and launched.decoding == len(seqs)
                and none_would_ride and set(self.scheduler.running) == {s for s in seqs if not s.finished}
                and any(len(s.output_ids) + 1 < s.sampling.max_tokens for s in seqs))

    def _launch(self, after: Launched | None = None) -> Launched:
        """Schedule a step and start it: the model's logits for the tokens to sample (on a GPU, still being
        computed), or the verified tokens of a speculative step (which waits for the GPU). `after`: the step still
        running that this one continues (see `_can_follow`), its tokens drawn on the device: they are this step's
        input there; meanwhile each of its sequences has a stand-in for its token (`Sequence.placeholder`),
        or, when that token will be its last, sits this step out (`Sequence.ending`)."""
        if after is not None:
            for seq in after.seqs:
                if len(seq.output_ids) + 1 >= seq.sampling.max_tokens:
                    seq.ending = True
                else:
                    seq.num_cached = seq.num_tokens
                    seq.output_ids.append(0)
                    seq.placeholder = True
        expired = self._expire()
        seqs, is_prefill = self.scheduler.schedule()
        launched = Launched(seqs, is_prefill, expired, time.monotonic(), lower=self.scheduler.lower_step)
        if not seqs:
            return launched
        # a sequence whose step ends before its last token (a prompt chunk) gets no token this step
        launched.done = [i for i, s in enumerate(seqs) if s.num_cached + s.step_tokens == s.num_tokens]
        launched.decoding = sum(s.num_cached > 0 and s.num_tokens - s.num_cached == 1 for s in seqs)
        launched.prompt_tokens = sum(s.step_tokens for s in seqs
                                     if s.num_cached == 0 or s.num_tokens - s.num_cached > 1)
        try:
            drafts = None if is_prefill or launched.decoding < len(seqs) else self._propose(seqs)
            if drafts:
                launched.tokens = self._verify(self.runner.decode(seqs), seqs, drafts)
            elif is_prefill and not self.runner.as_rows(seqs):
                launched.logits = self.runner.prefill(seqs)
            elif launched.decoding < len(seqs):  # prompts (or chunks of them) rode the decode step, or a prefill
                # step of prompts with cached prefixes runs as decode rows: their last rows
                if after is not None and not is_prefill:  # (`_can_follow` leaves no prompt that could)
                    raise RuntimeError("a step launched ahead has prompt rows beside tokens not yet known")
                rows = [s.step_tokens for s in seqs]
                last = to_device([r - 1 for r in itertools.accumulate(rows)], torch.int64, self.device)
                launched.logits = self.runner.decode(seqs, rows=rows)[last]  # (indices from pinned memory: no wait)
            else:
                launched.logits = self.runner.decode(seqs, ids=None if after is None else self._taken(after, seqs))
        except Exception as e:  # raised when the step completes (as StepFailed)
            launched.error = e
        finally:
            if self.proposer is not None:  # a verify step's proposals are spent, whatever happened
                for seq in seqs:
                    seq.draft_ids = []
        return launched

    def _taken(self, after: Launched, seqs: list[Sequence]) -> torch.Tensor:
        """The input ids of a decode step of `seqs` on the device: their tokens from `after`'s rows."""
        row = {seq: i for i, seq in enumerate(after.seqs)}
        if not all(seq in row for seq in seqs):
            raise RuntimeError("a step launched ahead holds a sequence the step before it did not")
        index = [row[seq] for seq in seqs]
        if index == list(range(len(seqs))):
            return after.drawn.tokens[:len(seqs)]
        return after.drawn.tokens[to_device(index, torch.int64, self.device)]

    def _complete(self, launched: Launched) -> tuple[list[Sequence], list[Sequence]]:
        """Sample a launched step's tokens (waiting for the GPU) and append them; a sequence that ends here is
        finished now, text and all. Returns (the sequences that got a token, those whose text is still to decode).
        A sequence finished while the step ran (a stop string, a cancellation) gets nothing from it."""
        seqs = launched.seqs
        for seq in seqs:  # the stand-ins of the step launched after this one make way for the tokens
            seq.ending = False
            if seq.placeholder:
                seq.output_ids.pop()
                seq.placeholder = False
        done = [i for i in launched.done if not seqs[i].finished]
        tokens = launched.tokens
        try:
            if launched.error is not None:
                raise launched.error
            if tokens is None and launched.drawn is not None:
                every = chosen(launched.drawn)
                tokens = [every[i] if isinstance(every[i], Exception) else [every[i]] for i in done]
            elif tokens is None:
                logits = launched.logits if len(done) == len(seqs) else \
                    launched.logits[to_device(done, torch.int64, self.device)]
                tokens = [t if isinstance(t, Exception) else [t] for t in sample(
                    logits, [seqs[i] for i in done], self.eos_ids)]
        except Exception as e:
            raise StepFailed(seqs) from e
        if not done and self.device.type == "cuda":  # nothing sampled waited for the step, whose host-side inputs
            torch.cuda.synchronize(self.device)  # the next one overwrites
        now = time.monotonic()  # sampling has brought the tokens to the host: it is over
        seconds = now - max(launched.started, self.completed_at)  # (launched ahead: it ran from the last one's end)
        self.completed_at = now
        self.scheduler.yielded(seconds, launched.lower, launched.prompt_tokens if launched.is_prefill else 0)
        self.stats.prefill_tokens += launched.prompt_tokens
        if launched.is_prefill:
            self.stats.prefill_steps += 1
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_seconds += seconds
        if launched.decoding:
            self.stats.decode_steps += 1
            self.stats.decode_tokens += launched.decoding
            self.stats.max_decode_batch = max(self.stats.max_decode_batch, launched.decoding)
        for seq in (s for s in seqs if s.num_cached + s.step_tokens < s.num_tokens and not s.finished):  # chunks
            seq.num_cached += seq.step_tokens
            self.blocks.register(seq)
        seqs, deferred = [seqs[i] for i in done], []
        for seq, new in zip(seqs, tokens):
            if not isinstance(new, Exception) and len(new) == 1 and new[0] not in self.eos_ids \
                    and len(seq.output_ids) + 1 < seq.sampling.max_tokens:  # it goes on: its text can wait
                self._take(seq, new[0])
                deferred.append(seq)
            else:
                self._guard(seq, self._append_all, new)
        return seqs, deferred

    def _append_all(self, seq: Sequence, new: list[int] | Exception) -> None:
        if isinstance(new, Exception):
            raise new
        for token in new:
            self._append(seq, token)
            if seq.finished:
                break
        else:
            self.blocks.shrink(seq, seq.num_tokens)  # blocks taken for proposals it rejected

    def _decode_text(self, seq: Sequence) -> bool:
        """The newest tokens' text; True when a stop string ended the sequence."""
        if append_text(self.tokenizer, seq, check_stop=len(seq.output_ids) >= seq.sampling.min_tokens):
            self._finish(seq, "stop")
            return True
        return False

    def _guard(self, seq: Sequence, work: Callable[..., None], *args) -> None:
        """Run `work(seq, *args)`; its failure (its sampling, its text) ends that sequence alone."""
        try:
            work(seq, *args)
        except Exception as e:
            log.error("sequence %s failed", seq.request_id or seq.seq_id, exc_info=e)
            seq.error = e
            if not seq.finished:
                self._finish(seq, "error")

    def _propose(self, seqs: list[Sequence]) -> list[Draft] | None:
        """Proposals for a decode step (None: it runs without speculation), each cut to the KV blocks left."""
        if self.proposer is None or len(seqs) > self.config.speculative_max_batch:
            return None
        most = self.config.num_speculative_tokens
        lengths = [0 if seq.fault else  # a test's injected fault takes the plain path
                   min(seq.speculate or most, seq.sampling.max_tokens - len(seq.output_ids) - 1) for seq in seqs]
        drafts = self.proposer.propose(seqs, lengths)
        for seq, draft in zip(seqs, drafts):
            k = len(draft.tokens)
            while k and not self.blocks.can_hold(seq, seq.num_tokens + k):
                k -= 1
            draft.tokens = draft.tokens[:k]
            draft.probs = None if draft.probs is None or not k else draft.probs[:k]
            self.blocks.grow(seq, seq.num_tokens + k)
            seq.draft_ids, seq.step_tokens = draft.tokens, 1 + k
        return drafts if any(seq.draft_ids for seq in seqs) else None

    def _verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft]) -> list[list[int] | Exception]:
        """Each sequence's new tokens from the logits of its newest token and proposals (speculative.py); one
        without proposals is sampled as in any step."""
        rows = [0, *itertools.accumulate(1 + len(d.tokens) for d in drafts)]  # each sequence's first row
        plain = [i for i, d in enumerate(drafts) if not d.tokens]
        results: list[list[int] | Exception] = [[] for _ in seqs]
        if plain:
            sampled = sample(logits[[rows[i] for i in plain]], [seqs[i] for i in plain], self.eos_ids)
            for i, token in zip(plain, sampled):
                results[i] = token if isinstance(token, Exception) else [token]
        for i, seq in enumerate(seqs):
            if drafts[i].tokens:
                mask_early_eos(logits[rows[i]:rows[i + 1]], seq, self.eos_ids)
        best = logits.argmax(-1).tolist()  # one device sync for the step's greedy rows
        for i, (seq, draft) in enumerate(zip(seqs, drafts)):
            if not draft.tokens:
                continue
            try:
                results[i] = verify_greedy(draft, best[rows[i]:rows[i + 1]]) if seq.sampling.greedy else \
                    verify_sampled(logits[rows[i]:rows[i + 1]], seq, draft)
            except Exception as e:  # noqa: BLE001  (its own failure, handed to it)
                results[i] = e
                continue
            accepted, proposed = len(results[i]) - 1, len(draft.tokens)
            self.stats.speculated += 1
            self.stats.proposed_tokens += proposed
            self.stats.accepted_tokens += accepted
            if self.config.speculative_schedule == "adaptive":
                seq.speculate = next_length(seq.speculate or self.config.num_speculative_tokens, proposed, accepted,
                                            self.config.num_speculative_tokens)
        return results

    def _expire(self) -> list[Sequence]:
        now = time.monotonic()
        expired = self.scheduler.expired(now)
        for seq in expired:
            seq.error = seq.ticket.time_out(now)
            self._finish(seq, "error")
        return expired

    def _take(self, seq: Sequence, token: int) -> None:
        """The token joins the sequence (its text not yet)."""
        if seq.status is Status.RUNNING:  # (not one the step launched after its own preempted: it is recomputed)
            seq.num_cached = seq.num_tokens
            self.blocks.register(seq)  # its newly full blocks join the prefix cache (before it may finish)
        seq.output_ids.append(token)
        self.stats.generated_tokens += 1

    def _append(self, seq: Sequence, token: int) -> None:
        self._take(seq, token)
        if token in self.eos_ids:  # the sampler never picks EOS before min_tokens
            seq.output_ids.pop()  # EOS ends the output; it is not part of it
            flush_text(self.tokenizer, seq)
            self._finish(seq, "stop")
        elif not self._decode_text(seq) and len(seq.output_ids) >= seq.sampling.max_tokens:
            flush_text(self.tokenizer, seq)
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.ticket.end()
        if self.proposer is not None:
            self.proposer.forget(seq)
        if seq.lora:
            self.adapters.drop(a for a, _ in seq.lora)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def generate(self, prompts: list[str | list[int]], sampling: SamplingParams) -> list[Sequence]:
        """Offline use: run all prompts to completion, batched together."""
        seqs = [self.add(p, sampling) for p in prompts]
        while self.has_work:
            self.step()
        return seqs
