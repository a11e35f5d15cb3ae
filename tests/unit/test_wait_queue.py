"""backends/llm/wait_queue.py against its definition: the waiting sequences sorted by their tickets' key(now)."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from backends.core.qos import CLASSES, QosParams, QosPolicy, Ticket
from backends.llm.sampling import SamplingParams
from backends.llm.scheduler import qos_order
from backends.llm.sequence import Sequence
from backends.llm.wait_queue import WaitQueue

POLICY = QosPolicy(QosParams(qos_max_wait_s="high=1,normal=4,low=10", qos_timeout_s="high=3,normal=8,low=20"))


def sequence(ticket: Ticket, tokens: int, started: bool = False) -> Sequence:
    ticket.started = started  # (a preempted sequence waits again with a started ticket)
    return Sequence(list(range(tokens)), SamplingParams(max_tokens=4), ticket=ticket)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([*CLASSES, None]), st.floats(0, 1), st.floats(0, 30), st.integers(1, 300),
                          st.booleans()), min_size=1, max_size=40),
       st.floats(0, 40), st.integers(0, 2**32 - 1))
def test_head_expired_and_shortest_equal_the_sort_by_key(specs, now, seed):
    t0 = 1000.0
    seqs = [sequence(POLICY.ticket(c, score, arrival=t0 + at) if c else Ticket.untracked(), tokens, started)
            for c, score, at, tokens, started in specs]
    queue = WaitQueue()
    for seq in seqs:
        queue.add(seq)
    rng = random.Random(seed)
    for seq in rng.sample(seqs, len(seqs) // 3):  # some leave (admitted, finished, cancelled) ...
        queue.remove(seq)
        seqs.remove(seq)
    for seq in rng.sample(seqs, len(seqs) // 4):  # ... and come back (preempted)
        queue.remove(seq)
        queue.add(seq)
    now += t0
    by_key = sorted(seqs, key=lambda s: qos_order(s, now))
    assert len(queue) == len(seqs) and all(s in queue for s in seqs)
    for count in (1, 3, len(seqs) + 1):
        assert queue.head(count, now) == by_key[:count]
    assert queue.expired(now) == [s for s in sorted(seqs, key=lambda s: (s.ticket.arrival + s.ticket.timeout_s,
                                                                          s.seq_id))
                                  if not s.ticket.started and s.ticket.expired(now)]
    assert queue.shortest() == min(s.num_tokens for s in seqs)


def test_an_overdue_low_goes_ahead_of_a_high_that_came_later():
    t0 = 1000.0
    low, high = (sequence(POLICY.ticket(c, arrival=t0 + at), 8) for c, at in (("low", 0), ("high", 9.5)))
    queue = WaitQueue()
    queue.add(high)
    queue.add(low)
    assert queue.head(2, t0 + 9.9) == [high, low]  # the low class's aging bound is 10 s, the high one's 1 s
    assert queue.head(2, t0 + 10) == [low, high]
    assert queue.head(1, t0 + 10) == [low] and WaitQueue().shortest() is None
