"""Continuous batching: which sequences run in the next step.

A step is either a prefill (waiting sequences join: their prompts, or prompt + output after a preemption, go through
the model at once) or a decode (every running sequence adds one token). Short prompts (`prompt_rows`) join a decode
step instead, a row per token: a step of their own would cost a pass over the weights, and every running sequence
would wait for it. With `lower_rides`, prompts of a lower QoS class than one running start only so, in chunks. New
requests join between decode steps as soon as the batch and the KV cache have room. When a decode step needs a block
and none is free, the sequence that would run last (QoS order) is preempted: its blocks are freed and it is
recomputed later. A full batch preempts the same way for a waiting sequence of a higher QoS class
(backends/core/qos.py). A sequence with LoRA adapters also needs their device slots to be admitted; it holds them
while it runs, and when none is free, admission waits (in order) like it does for KV blocks.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from backends.core.qos import LowerShare
from backends.llm.kv_cache import BlockManager
from backends.llm.sequence import Sequence, Status
from backends.llm.wait_queue import WaitQueue

if TYPE_CHECKING:
    from backends.llm.adapter_cache import AdapterCache

EXPECTED_S = 10.0  # a QoS class added within this long may come again any moment: lower ones' steps stay short


def qos_order(seq: Sequence, now: float) -> tuple:
    """Scheduling order, lowest first: the QoS ticket's (backends/core/qos.py), then arrival (the waiting queue
    keeps it too, backends/llm/wait_queue.py)."""
    return (*seq.ticket.key(now), seq.seq_id)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int,
                 chunk_tokens: int | None = None, adapters: AdapterCache | None = None,
                 lower_share: float = 1.0, lower_tokens: int | None = None, prompt_rows: int = 0,
                 lower_rides: bool = False, max_rows: int | None = None, lower_step_s: float = 0.0):
        self.blocks, self.max_batch, self.max_prefill_tokens = blocks, max_batch, max_prefill_tokens
        self.policy = qos_order  # the running sequences' order: who decodes first, who is preempted (waiting ones
        # are in QoS order: WaitQueue)
        # decode steps of at most `max_rows` rows take up to `prompt_rows` prompt tokens (whole prompts, and with
        # `lower_rides` chunks of lower-class ones, see `_prefill`)
        self.prompt_rows, self.lower_rides, self.max_rows = prompt_rows, lower_rides, max_rows or max_batch
        self.adapters = adapters
        self.chunk_tokens = chunk_tokens  # None: a prefill step runs alone; else the token budget of mixed steps
        # while a higher QoS class runs, lower-class prompts start in at most `lower_share` of the engine's time, in
        # steps of at most `lower_tokens` prompt tokens and of what prefill steps compute in `lower_step_s` (0: no
        # such cap; see `_prefill`)
        self.lower, self.lower_tokens, self.lower_step_s = LowerShare(lower_share), lower_tokens, lower_step_s
        self.prefill_token_s: float | None = None  # seconds a prompt token took in recent prefill steps (moving mean)
        self.lower_step = False  # the step scheduled last started lower-class prompts beside a higher class
        self.added_at: dict[int, float] = {}  # QoS rank -> when a sequence of it was last added
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)
        self.added_at[seq.ticket.rank] = time.monotonic()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill) for the next step; ([], False) when nothing can run. Each sequence's
        `step_tokens` says how many of its uncached tokens the step computes (1 for a decoding sequence).

        Without chunking, prompts prefill whole in steps of their own while the running sequences wait. With
        `chunk_tokens`, a step that has sequences decoding also takes prompt chunks up to that budget: every
        decoding sequence keeps its pace while long prompts (images) prefill."""
        now = time.monotonic()
        self.order = lambda seq: self.policy(seq, now)
        self.now, self.lower_step = now, False
        decoding = sum(s.num_tokens - s.num_cached == 1 for s in self.running)
        if self.chunk_tokens is None and decoding and self.prompt_rows:
            if riders := self._prefill(min(self.prompt_rows, self.max_rows - decoding), chunked=False, riding=True):
                decode = self._decode()  # (it may preempt a rider, and takes one of a single token itself)
                return decode + [s for s in riders if s.status is Status.RUNNING and s not in decode], False
        if self.chunk_tokens is None or not decoding:
            if prefill := self._prefill(self.max_prefill_tokens, chunked=False):
                return prefill, True
            return self._decode(), False
        decode = self._decode()
        prefill = self._prefill(max(self.chunk_tokens - len(decode), self.blocks.block_size), chunked=True)
        return decode + prefill, bool(prefill)

    def _prefill(self, budget: int, chunked: bool, riding: bool = False) -> list[Sequence]:
        """Sequences part-way through their prompt first, then waiting ones admitted in QoS order (shared prefix
        blocks and new ones), while the token budget lasts; a chunked step cuts the last prompt at the budget, an
        unchunked one runs a longer prompt whole when it comes first. `riding`: the prompts for a decode step's
        spare rows, whole when they fit the budget; the order stops at one that does not, or that has image features.

        A waiting prompt of a lower class than one running or chosen, not overdue, must not hold up the higher class
        by a prefill step of its own: a step delays every decoding sequence by its whole length, and without this a
        stream of heavy low-class prompts (4K images) sets the pace of a high-class chat. With `lower_rides`, such a
        text prompt starts only in a decode step, in chunks of the rows left (which then cost the higher class a
        wider step, not a wait); else (and with images) only when the lower classes' share of time allows
        (`yielded`), within `lower_tokens` and within the tokens recent prefill steps computed in `lower_step_s`: the
        share bounds how much of the time the higher class waits, this how long one wait lasts (its latency's tail),
        in seconds whatever the model and device (a prompt longer than that still starts, alone). The step cap also
        holds while no higher class runs but one was added in the last EXPECTED_S: its next request may arrive during
        the step and wait for it (at twice the capacity on an H100 high-class requests waited up to 110 ms for the
        engine loop, the time an uncapped step of many low-class prompts, up to max_prefill_tokens, can take)."""
        partial = sorted((s for s in self.running if s.num_tokens - s.num_cached > 1), key=self.order)
        top = min((s.ticket.rank for s in self.running), default=None)
        expected = min((rank for rank, at in self.added_at.items() if self.now - at < EXPECTED_S), default=None)
        chosen, capped = [], False
        # (each pass takes the sequence or stops, and at most max_batch are admitted: the head is enough)
        for seq in [*partial, *self.waiting.head(self.max_batch + 1, self.now)]:
            lower = self._below(seq, top)
            rides_lower = lower and self.lower_rides and self.prompt_rows > 0 and seq.embeds is None
            if rides_lower and not riding:
                break
            first_lower = lower and not rides_lower and not self.lower_step  # (the ones after it are lower too)
            if first_lower and self.lower.closed(self.now):
                break
            if (lower and not rides_lower or self._below(seq, expected)) and not capped:
                capped = True
                budget = min(budget, self.lower_tokens or budget, self._lower_step_tokens() or budget)
            if budget <= 0:
                break
            remaining = seq.num_tokens - seq.num_cached
            in_chunks = riding and (rides_lower or seq.status is Status.RUNNING)  # started prompts go on in chunks
            if riding and (seq.embeds is not None or (remaining > budget and not in_chunks)):
                break
            if seq.status is Status.WAITING:
                if len(self.running) >= self.max_batch and not self._make_room(seq, chosen):
                    break
                if not chunked and chosen and seq.num_tokens > budget:
                    break
                if not self._take_slots(seq):
                    break
                if not self.blocks.admit(seq):
                    self._give_slots(seq)
                    break
                self.waiting.remove(seq)
                seq.ticket.start()
                seq.status = Status.RUNNING
                self.running.append(seq)
            top = seq.ticket.rank if top is None else min(top, seq.ticket.rank)
            self.lower_step |= lower and not rides_lower
            remaining = seq.num_tokens - seq.num_cached
            seq.step_tokens = min(remaining, budget) if chunked or in_chunks else remaining
            budget -= seq.step_tokens
            chosen.append(seq)
        return chosen

    def _below(self, seq: Sequence, rank: int | None) -> bool:
        """`seq` waits, of a lower class than `rank` (None: none), and not past its class's aging bound."""
        return seq.status is Status.WAITING and rank is not None and seq.ticket.rank > rank \
            and not seq.ticket.overdue(self.now)

    def yielded(self, seconds: float, lower_step: bool, prefill_tokens: int = 0) -> None:
        """The engine ran a step in `seconds`: when it started lower-class prompts beside a higher class
        (`lower_step` as its scheduling left it), the next such step waits until the lower classes' time is back
        within their share. `prefill_tokens`: the prompt tokens of a prefill step (0 for decode steps), which time
        the prompt tokens a lower step may take."""
        if lower_step:
            self.lower.spent(seconds, time.monotonic())
        if prefill_tokens:
            token_s, last = seconds / prefill_tokens, self.prefill_token_s
            self.prefill_token_s = token_s if last is None else 0.8 * last + 0.2 * token_s

    def _lower_step_tokens(self) -> int | None:
        """The prompt tokens a lower-class step may take by `lower_step_s` (None: no cap yet)."""
        if not self.lower_step_s or not self.prefill_token_s:
            return None
        return max(1, int(self.lower_step_s / self.prefill_token_s))

    def _make_room(self, seq: Sequence, chosen: list[Sequence]) -> bool:
        """A full batch takes a waiting sequence of a higher QoS class by preempting the running sequence last in
        order, when that one is of a lower class and not overdue (the aging bound protects it)."""
        candidates = [s for s in self.running if s not in chosen]
        if not candidates:
            return False
        victim = max(candidates, key=self.order)
        if victim.ticket.rank <= seq.ticket.rank or self.order(victim) < self.order(seq):
            return False
        self.running.remove(victim)
        self.preempt(victim)
        return True

    def _decode(self) -> list[Sequence]:
        """The running sequences that have all but their newest token cached, each given room for it; when the pool
        runs dry, the sequences last in QoS order are preempted."""
        self.running.sort(key=self.order)
        decode, kept = [], []
        while self.running:
            seq = self.running.pop(0)
            if seq.num_tokens - seq.num_cached > 1 or seq.ending:  # still prefilling (holds its blocks already),
                kept.append(seq)  # or its last token is being computed
                continue
            while not self.blocks.can_hold(seq, seq.num_tokens) and self.running:
                self.preempt(self.running.pop())
            if not self.blocks.can_hold(seq, seq.num_tokens):
                self.preempt(seq)
                break
            self.blocks.grow(seq, seq.num_tokens)
            seq.step_tokens = 1
            decode.append(seq)
        self.running = decode + kept + self.running
        return list(decode)  # a copy: finishing sequences leave `running` while the caller iterates

    def expired(self, now: float) -> list[Sequence]:
        """Waiting sequences that never started and have waited past their QoS timeout."""
        return self.waiting.expired(now)

    def _take_slots(self, seq: Sequence) -> bool:
        if not seq.lora:
            return True
        slots = self.adapters.acquire([adapter for adapter, _ in seq.lora])
        seq.lora_slots = slots or []
        return slots is not None

    def _give_slots(self, seq: Sequence) -> None:
        if seq.lora_slots:
            self.adapters.release(seq.lora_slots)
            seq.lora_slots = []

    def preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        self._give_slots(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free the sequence's blocks now (finished, stopped or cancelled) and drop it from the queues."""
        self.blocks.release(seq)
        self._give_slots(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
