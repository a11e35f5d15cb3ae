"""Greedy Whisper decoding with continuous batching, on transformers' own modules and weights.

Clips are added at any time (`add`); each `step` first lets waiting clips into free decoder slots (their features
and encoder run together, up to `encoder_batch` clips), then runs one decoder step over every slot in use
(backends.whisper.decoder) and returns the clips that finished, so clips join and leave the running batch between
steps. A clip feeds its prompt (<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>) one token per step; when
its language was not given it is picked after <|startoftranscript|> as transformers' detect_language does. The
checkpoint's suppress_tokens (every step) and begin_suppress_tokens (first generated token) apply as in
transformers, so tokens equal WhisperForConditionalGeneration.generate's greedy output. `transcribe` runs a list of
clips to the end.
"""
from __future__ import annotations

import collections
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backends.core.batcher import BatchingParams
from backends.core.cuda_graphs import batch_sizes, try_graphs
from backends.core.devices import DTYPES, resolve_device
from backends.core.errors import InvalidInput
from backends.core.params import bounded, choice, device
from backends.core.qos import LowerShare, Ticket
from backends.media.audio import AudioLimits
from backends.whisper.decoder import SlotDecoder
from backends.whisper.encoder import FusedEncoder
from backends.whisper.features import LogMel

log = logging.getLogger(__name__)
TASKS = ("transcribe", "translate")
PROMPT = 4  # <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>
PHASES = ("waiting", "joining", "decoding")  # for a slot; in one, its join in flight; joined, to its end


@dataclass(frozen=True)
class WhisperParams(BatchingParams):
    """The `mm_whisper` backend's parameters."""

    dtype: str = choice("fp32", *(d for d in DTYPES if d != "fp32"))
    device: str = device()
    max_batch: int = bounded(64, 1)  # decoder slots: clips (30 s chunks) decoded at once
    encoder_batch: int = bounded(16, 1)  # clips that join per step (their encoder pass delays that step)
    # while clips decode, waiting clips start joining once this many wait (or as many as there are free slots) or
    # the first has waited join_wait_ms: one clip's encoder pass costs the GPU about twice its share of a batched
    # one (H200: 17.9 ms against 8.9 ms a clip in 16), and served requests can arrive one at a time (1: join at once)
    join_min: int = bounded(1, 1)
    join_wait_ms: float = bounded(50.0, 0)
    cuda_graphs: bool = True  # decoder steps and joins replayed from CUDA graphs (GPU only)
    fused_encoder: bool = True  # the encoder with fewer passes over memory (backends/whisper/encoder.py); false:
    # transformers' WhisperEncoder.forward
    qos_lower_share: float = bounded(0.25, 0, 1, low_open=True)  # while a clip of a higher QoS class decodes, clips
    # of lower classes (not overdue) start in at most this share of the time: their encoder pass holds its steps up
    # (on the CPU; on a GPU it runs on a stream of its own, so the share measures only its launch; 1: no limit)
    prepare_threads: int = bounded(4, 1, 256)  # audio decoding threads per instance
    max_audio_seconds: float = bounded(AudioLimits.max_seconds, 0, low_open=True)
    max_channels: int = bounded(AudioLimits.max_channels, 1)
    max_sample_rate: int = bounded(AudioLimits.max_sample_rate, 1)

    @property
    def limits(self) -> AudioLimits:
        return AudioLimits(self.max_audio_seconds, self.max_channels, self.max_sample_rate)


@dataclass
class Transcription:
    tokens: list[int]  # generated tokens, without the prompt and <|endoftext|>
    text: str
    language: str  # code, e.g. "en"


@dataclass(eq=False)
class Clip:
    """One clip of at most 30 s through the decoder: what it asks for, where it is, what it produced."""

    audio: np.ndarray  # 16 kHz mono samples
    language: str | None  # None: detected
    task: str
    budget: int | None  # most tokens to generate; None: as many as the decoder's positions allow
    owner: Any = None  # the caller's (e.g. its request)
    added: float = 0.0  # when it was queued (time.monotonic)
    slotted: float = 0.0  # when it took a slot and its join started
    decoding: float = 0.0  # when its join finished and it began to decode
    language_id: int | None = None
    slot: int = -1
    position: int = 0  # of the token fed next
    feed: list[int] = field(default_factory=list)  # prompt tokens still to feed; the next token fed is feed[0]
    tokens: list[int] = field(default_factory=list)
    ticket: Ticket | None = None  # its request's QoS ticket (preemption: a lower class yields its slot)
    joined: bool = False  # its encoder output is in its slot: it decodes
    error: Exception | None = None  # set when the clip failed


class WhisperEngine:
    def __init__(self, checkpoint: Path, dtype: str = "fp32", device: str = "auto", slots: int = 64,
                 encoder_batch: int = 16, cuda_graphs: bool = True, lower_share: float = 1.0, join_min: int = 1,
                 join_wait_s: float = 0.05, fused_encoder: bool = True):
        from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

        self.device, self.dtype = resolve_device(device), DTYPES[dtype]
        self.model = WhisperForConditionalGeneration.from_pretrained(checkpoint, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.features = LogMel(WhisperFeatureExtractor.from_pretrained(checkpoint))
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        gen = self.model.generation_config
        self.sot, self.eot = gen.decoder_start_token_id, gen.eos_token_id
        self.languages = {token[2:-2]: i for token, i in gen.lang_to_id.items()}  # "en" -> id
        self.codes = {i: code for code, i in self.languages.items()}
        self.tasks = dict(gen.task_to_id)
        self.no_timestamps = gen.no_timestamps_token_id
        self.max_new_tokens = self.model.config.max_target_positions - PROMPT
        self.encoder_batch = encoder_batch
        self.join_min, self.join_wait_s = min(join_min, encoder_batch), join_wait_s
        self.decoder = SlotDecoder(self.model, slots, cuda_graphs)
        encoder = self.model.model.encoder
        self.encoder = FusedEncoder(encoder, compiled=self.device.type == "cuda") if fused_encoder else \
            (lambda features: encoder(features).last_hidden_state)
        # a join (features, encoder, cross-attention keys and values into the slots) replayed from a graph of 1, 2,
        # 4, ... clips, one launch instead of hundreds from Python, during which the engine's loop launches no
        # decoder step. It pays for small joins only: on an H100 one clip took 10.3 ms against 15.5 op by op, 16
        # clips 142.3 against 143.9, the encoder's compute (perf/results/h100/2026-12-07b-whisper-steps.md)
        self.join_graphs = try_graphs(self._encode_into, [(self.features.n_samples,), ()], [torch.float32, torch.long],
                                      self.device, encoder_batch, exact=True) \
            if cuda_graphs and self.device.type == "cuda" else None
        self.waiting: collections.deque[Clip] = collections.deque()
        self.running: list[Clip | None] = [None] * slots  # by slot, clips still joining too
        self.join_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.joining: list[tuple[torch.cuda.Event, list[Clip]]] = []  # encoders in flight on join_stream
        self.preempted: collections.deque[Clip] = collections.deque()  # rejoin from scratch after `waiting`
        self.lower = LowerShare(lower_share)  # lower-class clips joining while a higher class decodes (`admits`)
        # decoder steps, tokens fed by them (clips x steps), rows they computed (SlotDecoder.rows), joins, clips
        # encoded, clips preempted, clips moved to a lower slot (`_compact`)
        self.steps = self.fed = self.computed = self.joins = self.encoded = self.preemptions = self.moves = 0
        # seconds in decoder steps (launch and the wait for their choices) and in joins (launch only on a GPU)
        self.step_seconds = self.join_seconds = 0.0
        # clips that left their slot, and their seconds in the engine by phase (PHASES), summed: what a clip's time
        # from `add` to its end was spent on
        self.left = 0
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)

    def check_language(self, language: str | None) -> None:
        if language is not None and language not in self.languages:
            raise InvalidInput(f"unknown language {language!r}; known: {', '.join(sorted(self.languages))}")

    # --- continuous batching ----------------------------------------------------------------------------------
    def add(self, *clips: Clip) -> None:
        """Queue clips (all or, when one is wrong, none); they join the running batch at coming steps."""
        now = time.monotonic()
        for clip in clips:
            self.check(clip)
            clip.added = now
        self.waiting.extend(clips)

    def check(self, clip: Clip) -> None:
        """Refuses what the clip asks for when it is wrong; caps its budget at what the decoder's positions allow."""
        self.check_language(clip.language)
        if clip.task not in TASKS:
            raise InvalidInput(f"task must be one of {TASKS}, got {clip.task!r}")
        if clip.budget is not None and clip.budget < 1:
            raise InvalidInput(f"max_new_tokens must be at least 1, got {clip.budget}")
        clip.budget = min(clip.budget or self.max_new_tokens, self.max_new_tokens)

    @property
    def free_slots(self) -> int:
        return self.running.count(None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted) or self.free_slots < len(self.running)

    def occupancy(self) -> tuple[int, int, int]:
        """Clips in slots (joining ones too), joining (their encoder not finished: they do not decode yet), and
        waiting for a slot (preempted ones too)."""
        return (len(self.running) - self.free_slots, sum(len(clips) for _, clips in self.joining),
                len(self.waiting) + len(self.preempted))

    @property
    def room(self) -> int:
        """Slots free for clips not queued yet."""
        return self.free_slots - len(self.waiting) - len(self.preempted)

    def admits(self, ticket: Ticket | None, now: float) -> bool:
        """Whether a clip of `ticket` may start joining now: not one of a class lower than a running clip's while
        the lower classes' share of the time is spent (`qos_lower_share`), unless it is overdue."""
        if ticket is None or ticket.overdue(now) or not self.lower.closed(now):
            return True
        return ticket.rank <= min(self._ranks(), default=ticket.rank)

    def _ranks(self) -> list[int]:
        return [clip.ticket.rank for clip in self.running if clip is not None and clip.ticket is not None]

    def preempt_for(self, ticket: Ticket, now: float) -> bool:
        """When the engine is full: frees a slot for a request of `ticket` by preempting the decoding clip last in
        QoS order, if that clip's request is of a lower class and not overdue (the aging bound protects it); the
        clip starts again from its prompt once the clips queued meanwhile have joined. The LLM scheduler's rule."""
        if self.room > 0 or self.waiting:
            return False
        candidates = [clip for clip in self.running if clip is not None and clip.joined and clip.ticket is not None]
        if not candidates:
            return False
        victim = max(candidates, key=lambda clip: (clip.ticket.key(now), -clip.position))
        if victim.ticket.rank <= ticket.rank or victim.ticket.key(now) < ticket.key(now):
            return False
        self.running[victim.slot] = None
        self.preempted.append(victim)
        self.preemptions += 1
        return True

    def step(self) -> list[Clip]:
        """Let waiting clips start joining, run one decoder step over the clips that have joined; the clips that
        finished (or failed: `error` set)."""
        start = time.perf_counter()
        done = self._join()
        self.join_seconds += time.perf_counter() - start
        self._joined()
        self._compact()
        used = [i for i, clip in enumerate(self.running) if clip is not None and clip.joined]
        if not used:
            return done
        rows = [clip if clip is not None and clip.joined else None for clip in self.running[:used[-1] + 1]]
        self.steps, self.fed = self.steps + 1, self.fed + len(used)
        self.computed += self.decoder.rows(len(rows))
        start = time.perf_counter()
        try:
            choices = self.decoder.step([clip.feed[0] if clip else self.eot for clip in rows],
                                        [clip.position if clip else 0 for clip in rows])
        except Exception as e:  # the step's clips fail; the engine stays usable for the next ones
            log.exception("whisper decoder step failed")
            return done + [self._leave(clip, e) for clip in rows if clip is not None]
        finally:
            self.step_seconds += time.perf_counter() - start
        for clip, (language, token, first) in zip(rows, choices):
            if clip is not None and self._advance(clip, language, first if clip.position == PROMPT - 1 else token):
                done.append(self._leave(clip))
        return done

    def clear(self) -> list[Clip]:
        """Drop every clip (waiting and running); returns them."""
        if self.join_stream is not None:
            self.join_stream.synchronize()  # no encoder still writing into a slot a later clip gets
        clips = [*self.waiting, *self.preempted, *(clip for clip in self.running if clip is not None)]
        self.waiting.clear()
        self.preempted.clear()
        self.running, self.joining = [None] * len(self.running), []
        return clips

    def _join(self) -> list[Clip]:
        """Waiting clips into free slots, up to encoder_batch: features, encoder and their cross-attention keys and
        values in one call, on a CUDA stream of its own so that the running clips' decoder steps go on meanwhile
        (the encoder is compute-bound, a step mostly waits on memory); clips that fail here are returned with their
        error."""
        free = [i for i, clip in enumerate(self.running) if clip is None]
        now = time.monotonic()
        if not self._join_now(len(free), now):
            return []
        picked, top = [], min(self._ranks(), default=None)
        for queue in (self.waiting, self.preempted):  # (the waiting ones were admitted: `admits`)
            while queue and len(picked) < min(len(free), self.encoder_batch) and \
                    (queue is self.waiting or self.admits(queue[0].ticket, now)):
                picked.append((queue, queue.popleft()))
        if not picked:
            return []
        if self.join_graphs is not None:  # as many as a graph holds; the rest join at the next steps
            size = max(s for s in batch_sizes(self.encoder_batch) if s <= len(picked))
            for queue, clip in reversed(picked[size:]):
                queue.appendleft(clip)
            del picked[size:]
        clips = [clip for _, clip in picked]
        lower = top is not None and any(c.ticket is not None and c.ticket.rank > top and not c.ticket.overdue(now)
                                        for c in clips)
        try:
            # pinned on a GPU: a copy from pageable memory may run synchronously with the host, and then this loop
            # waits out a join still in flight (an encoder of up to 16 clips) with no decoder step launched meanwhile
            pinned = self.join_stream is not None
            waves = self.features.waves([clip.audio for clip in clips], pinned)
            slots = torch.tensor(free[:len(clips)], pin_memory=pinned)
            with torch.inference_mode(), torch.cuda.stream(self.join_stream) if self.join_stream else nullcontext():
                if self.join_graphs is not None:
                    self.join_graphs(waves, slots)
                else:
                    self._encode_into(waves.to(self.device, non_blocking=True),
                                      slots.to(self.device, non_blocking=True))
                event = self.join_stream.record_event() if self.join_stream else None
            self.joins, self.encoded = self.joins + 1, self.encoded + len(clips)
            if lower:
                end = time.monotonic()
                self.lower.spent(end - now, end)
        except Exception as e:
            log.exception("whisper encoder failed on %d clips", len(clips))
            for clip in clips:
                clip.error = e
            return clips
        for slot, clip in zip(free, clips):
            clip.slotted = clip.decoding = now
            language = self.languages[clip.language] if clip.language else None
            clip.slot, clip.position, clip.language_id, clip.tokens = slot, 0, language, []
            clip.feed = [self.sot, *self._rest_of_prompt(clip)] if language is not None else [self.sot]
            clip.joined = event is None
            self.running[slot] = clip
        if event is not None:
            self.joining.append((event, clips))
        return []

    def _join_now(self, free: int, now: float) -> bool:
        """Whether waiting clips start joining at this step (`join_min`, `join_wait_s`): always when none decodes."""
        queued = len(self.waiting) + len(self.preempted)
        if not queued or not free:
            return False
        if queued >= min(self.join_min, free):
            return True
        oldest = min(clip.added for queue in (self.waiting, self.preempted) for clip in queue)
        return now - oldest >= self.join_wait_s or not any(c is not None and c.joined for c in self.running)

    def _encode_into(self, waves: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Clips' 30 s of samples [n, n_samples] -> their features, encoder output and its cross-attention keys and
        values in the decoder's `slots` [n] (all on the device); returns `slots` (a graph needs an output)."""
        features = self.features.from_waves(waves).to(self.dtype)
        self.decoder.join(slots, self.encoder(features))
        return slots

    def _joined(self) -> None:
        """Clips whose encoder finished join the decoder's batch (when none is decoding, it waits for the first)."""
        if self.joining and not any(clip is not None and clip.joined for clip in self.running):
            self.joining[0][0].synchronize()
        now = time.monotonic()
        for event, clips in self.joining:
            if event.query():
                torch.cuda.current_stream(self.device).wait_event(event)
                for clip in clips:
                    clip.joined, clip.decoding = True, now
        self.joining = [(event, clips) for event, clips in self.joining if not clips[0].joined]

    def _compact(self) -> None:
        """Decoding clips move from the highest slots into free ones below while that lets a step compute fewer rows
        (SlotDecoder.rows): a step computes every row up to the highest slot in use, and each row reads its
        cross-attention keys and values (245 MB at large-v3's shapes) whether or not a clip holds it. A clip that
        leaves frees a slot anywhere: in process its successor takes it at the next step, a served one arrives a
        round trip later. A move copies about twice a row's bytes once. A clip still joining stays where it is (its
        encoder writes into its slot)."""
        occupied = [i for i, clip in enumerate(self.running) if clip is not None]
        while occupied and occupied[-1] + 1 > self.decoder.rows(len(occupied)):
            clip = self.running[occupied.pop()]
            if not clip.joined:
                return
            hole = self.running.index(None)
            self.decoder.move(clip.slot, hole, clip.position)
            self.running[hole], self.running[clip.slot], clip.slot = clip, None, hole
            occupied = sorted([*occupied, hole])
            self.moves += 1

    def _rest_of_prompt(self, clip: Clip) -> list[int]:
        return [clip.language_id, self.tasks[clip.task], self.no_timestamps]

    def _advance(self, clip: Clip, language: int, token: int) -> bool:
        """The step's choices for this clip (`token`: the one its position calls for); True when it is done."""
        clip.feed.pop(0)
        clip.position += 1
        if clip.language_id is None:  # it fed <|startoftranscript|>: its language is the likeliest language token
            clip.language_id = language
            clip.feed = self._rest_of_prompt(clip)
        if clip.feed:  # still feeding its prompt
            return False
        if token == self.eot:
            return True
        clip.tokens.append(token)
        clip.feed = [token]
        return len(clip.tokens) >= clip.budget

    def _leave(self, clip: Clip, error: Exception | None = None) -> Clip:
        self.running[clip.slot] = None
        clip.error = error
        self.left += 1
        for phase, seconds in zip(PHASES, (clip.slotted - clip.added, clip.decoding - clip.slotted,
                                           time.monotonic() - clip.decoding)):
            self.phase_seconds[phase] += seconds
        return clip

    def result(self, clip: Clip) -> Transcription:
        return Transcription(clip.tokens, self.tokenizer.decode(clip.tokens, skip_special_tokens=True),
                             self.codes[clip.language_id])

    # --- a batch to the end -----------------------------------------------------------------------------------
    def transcribe(self, audios: list[np.ndarray], languages: list[str | None], tasks: list[str],
                   max_new_tokens: list[int | None] | None = None) -> list[Transcription]:
        """16 kHz mono clips of at most 30 s -> one Transcription each (greedy; a clip ends at <|endoftext|> or
        after its own max_new_tokens, default: as many as the decoder's positions allow). Runs the engine until
        these clips are done (any clips added before are run too); raises the first clip's error."""
        budgets = max_new_tokens or [None] * len(audios)
        clips = [Clip(audio, language, task, n) for audio, language, task, n in zip(audios, languages, tasks, budgets)]
        self.add(*clips)
        pending = set(clips)
        while pending:
            for clip in self.step():
                if clip.error is not None and clip in pending:
                    self.clear()
                    raise clip.error
                pending.discard(clip)
        return [self.result(clip) for clip in clips]
