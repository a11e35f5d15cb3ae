"""Continuous batching: which sequences run in the next step.

A step is either a prefill (waiting sequences join: their prompts, or prompt + output after a preemption, go
through the model at once) or a decode (every running sequence adds one token). New requests join between decode
steps as soon as the batch and the KV cache have room. When a decode step needs a block and none is free, the
sequence that would run last (`policy` order) is preempted: its blocks are freed and it is recomputed later.
"""
from __future__ import annotations

from collections import deque

from backends.llm.kv_cache import BlockManager
from backends.llm.sequence import Sequence, Status


def fcfs(seq: Sequence) -> tuple:
    """Scheduling order: priority class first, then arrival. The QoS issue replaces this with weighted aging."""
    return (seq.priority, seq.arrival, seq.seq_id)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int, policy=fcfs):
        self.blocks, self.max_batch, self.max_prefill_tokens, self.policy = blocks, max_batch, max_prefill_tokens, policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """(sequences, is_prefill) for the next step; ([], False) when nothing can run."""
        prefill, tokens = [], 0
        for seq in sorted(self.waiting, key=self.policy):
            if len(self.running) + len(prefill) >= self.max_batch:
                break
            if prefill and tokens + seq.num_tokens > self.max_prefill_tokens:
                break
            if not self.blocks.admit(seq):  # cached prefix blocks shared, the rest allocated
                break
            prefill.append(seq)
            tokens += seq.num_tokens
        if prefill:
            for seq in prefill:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
            self.running += prefill
            return prefill, True
        self.running.sort(key=self.policy)
        decode = []
        while self.running:
            seq = self.running.pop(0)
            while not self.blocks.can_hold(seq, seq.num_tokens) and self.running:
                self.preempt(self.running.pop())
            if not self.blocks.can_hold(seq, seq.num_tokens):
                self.preempt(seq)
                break
            self.blocks.grow(seq, seq.num_tokens)
            decode.append(seq)
        self.running = decode
        return list(decode), False  # a copy: finishing sequences leave `running` while the caller iterates

    def preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free the sequence's blocks now (finished, stopped or cancelled) and drop it from the queues."""
        self.blocks.release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
