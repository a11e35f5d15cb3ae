"""The scheduler's waiting sequences, kept in QoS order at a cost per step that does not grow with the queue.

Overloaded, the engine holds hundreds of waiting requests (at twice the capacity on the CPU, 500 and more); sorting
them by their QoS key on every step took a third of the engine loop's time there. The order needs no re-sorting: a
ticket's key (backends/core/qos.py) is (rank, score - waited / max_wait_s) until its aging deadline, then that
deadline. Within a class every ticket's key falls at the same rate, so their order is fixed at arrival; only the
passing of deadlines changes it, and deadlines are fixed too. So the queue keeps sorted lists (by that order, by
aging deadline, by timeout, by prompt length) and reads the front of each.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from backends.llm.sequence import Sequence


class _SortedBy:
    """Sequences sorted by a key taken when they join (ties by sequence id)."""

    def __init__(self, key: Callable[[Sequence], float | tuple]):
        self.key, self.items = key, []

    def add(self, seq: Sequence) -> tuple:
        entry = (self.key(seq), seq.seq_id, seq)
        bisect.insort(self.items, entry)
        return entry

    def remove(self, entry: tuple) -> None:
        del self.items[bisect.bisect_left(self.items, entry[:2])]

    def __iter__(self) -> Iterator[tuple]:
        return iter(self.items)


class WaitQueue:
    """Waiting sequences; `head` reads them in the order of their tickets' `key(now)` (`order`: of those not
    overdue; a test's own must be as fixed)."""

    def __init__(self, order: Callable[[Sequence], tuple] = lambda s: s.ticket.fixed_order()):
        self._order = _SortedBy(order)
        self._deadline = _SortedBy(lambda s: s.ticket.aging_deadline)
        self._timeout = _SortedBy(lambda s: s.ticket.timeout_deadline)
        self._length = _SortedBy(lambda s: s.num_tokens - s.num_cached)  # (num_cached is 0 while it waits)
        self._lists = (self._order, self._deadline, self._timeout, self._length)
        self._entries: dict[Sequence, list[tuple]] = {}  # what each list holds of it, to find it there again

    def add(self, seq: Sequence) -> None:
        self._entries[seq] = [sorted_by.add(seq) for sorted_by in self._lists]

    def remove(self, seq: Sequence) -> None:
        for sorted_by, entry in zip(self._lists, self._entries.pop(seq)):
            sorted_by.remove(entry)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Sequence]:
        """In no particular order."""
        return iter(list(self._entries))

    def head(self, count: int, now: float) -> list[Sequence]:
        """The first `count` in order: overdue ones by deadline, then the others by their fixed order."""
        first = []
        for deadline, _, seq in self._deadline:
            if deadline > now or len(first) == count:
                break
            first.append(seq)
        for _, _, seq in self._order:
            if len(first) == count:
                break
            if seq.ticket.aging_deadline > now:  # (the overdue ones are in `first` already)
                first.append(seq)
        return first

    def expired(self, now: float) -> list[Sequence]:
        """Those that never started and have waited past their QoS timeout."""
        found = []
        for deadline, _, seq in self._timeout:
            if deadline > now:
                break
            if not seq.ticket.started:
                found.append(seq)
        return found

    def shortest(self) -> int | None:
        """The fewest prompt tokens a waiting sequence has left to compute (None: none waits)."""
        return self._length.items[0][0] if self._length.items else None
