"""QoS for the queues our backends keep: classes, a cost score, aging, queue limits and deadlines.

A request names its class with the request parameter `qos_class` (high, normal or low; default normal). Its cost
score S = w_image * image_tokens / image_max + w_audio * audio_s / audio_max + w_text * text_tokens / text_max (each
size capped at its maximum) comes from its sizes after decoding. Waiting requests are served in this order:
1. overdue ones, having waited their class's `max_wait_s`, earliest deadline (arrival + max_wait_s) first: the
   aging bound, so the low class is never starved and no request is passed by one that came after its deadline;
2. then by class, and within a class by S - waited / max_wait_s (cheap first, the wait making up for the cost).
A class holds at most `max_queued` waiting requests: one more is refused at once (UNAVAILABLE, with the reason), and a
request that has waited `timeout_s` without starting is refused then, never left to time out at the client.
Work queued for threads before that (decoding images and audio) starts in the same order (`QosPool`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from backends.core.errors import InvalidInput, Unavailable
from backends.core.params import Parameters, mapping, parse_mapping

CLASSES = ("high", "normal", "low")  # in rank order
DEFAULT_CLASS = "normal"
QOS_PARAMETER = "qos_class"
SIZES = ("image", "audio", "text")  # image tokens, audio seconds, text tokens
REJECTIONS = ("queue_full", "timeout")  # why a request was refused


@dataclass(frozen=True)
class QosParams(Parameters):
    """Model-config parameters of every backend that queues requests itself."""

    qos_max_wait_s: str = mapping("high=1,normal=5,low=30", CLASSES)  # the aging bound per class
    qos_max_queued: str = mapping("high=256,normal=512,low=512", CLASSES)  # waiting requests per class
    qos_timeout_s: str = mapping("high=30,normal=120,low=600", CLASSES)  # longest wait before starting
    qos_weights: str = mapping("image=0.4,audio=0.35,text=0.25", SIZES, zero=True)  # of the cost score
    qos_size_max: str = mapping("image=2880,audio=30,text=8192", SIZES)  # sizes that count as 1 in the score


class LowerShare:
    """While a higher class runs, work of lower classes (not overdue) starts in at most `share` of the time: after
    such work took t seconds, the next waits t (1 - share) / share. One step of it (a long prompt's prefill, a batch
    of clips through the encoder) holds up every running request of the higher class for its whole length."""

    def __init__(self, share: float):
        self.share, self.open_at = share, 0.0

    def closed(self, now: float) -> bool:
        return now < self.open_at

    def spent(self, seconds: float, now: float) -> None:
        self.open_at = now + seconds * (1 - self.share) / self.share


@dataclass(eq=False)
class Ticket:
    """One request's place in a QoS queue."""

    qos_class: str
    rank: int
    score: float
    max_wait_s: float
    timeout_s: float
    arrival: float = field(default_factory=time.monotonic)
    gate: Admission | None = None  # counts it as queued until it starts or ends
    queued: bool = False
    started: bool = False
    ended: bool = False

    @classmethod
    def untracked(cls) -> Ticket:
        """For work outside QoS (offline use, tests): the default class, first come first served, no timeout."""
        return cls(DEFAULT_CLASS, CLASSES.index(DEFAULT_CLASS), 0.0, math.inf, math.inf)

    def key(self, now: float) -> tuple:
        """Sort key, lowest first (see the module's docstring)."""
        return (0, self.aging_deadline) if self.overdue(now) else (1, *self.fixed_order())

    def fixed_order(self) -> tuple:
        """The order of tickets not overdue: by class, then by S - waited / max_wait_s, which within a class falls
        by now / max_wait_s for all alike, so S + arrival / max_wait_s sorts the same at any time (a queue can stay
        sorted by it: backends/llm/wait_queue.py)."""
        return (self.rank, self.score + self.arrival / self.max_wait_s)

    @property
    def aging_deadline(self) -> float:
        return self.arrival + self.max_wait_s

    def overdue(self, now: float) -> bool:
        """It has waited past its class's aging bound: it goes ahead of every class."""
        return now >= self.aging_deadline

    @property
    def timeout_deadline(self) -> float:
        return self.arrival + self.timeout_s

    def expired(self, now: float) -> bool:
        return now >= self.timeout_deadline

    def time_out(self, now: float) -> Unavailable:
        """It waited past its timeout without starting: counted as refused; the error to give its client."""
        if self.gate is not None:
            self.gate.timed_out(self)
        return Unavailable(f"waited {now - self.arrival:.1f} s in the {self.qos_class} queue without starting "
                           f"(its timeout is {self.timeout_s:g} s): the server is overloaded, retry later")

    def start(self) -> None:
        """It leaves the queue to run (counted as admitted, with its wait); again after a preemption: nothing."""
        self.started = True
        if self.gate is not None:
            self.gate.leave(self, started=True)

    def end(self) -> None:
        """It ended (finished, cancelled, failed); if it never started, it leaves the queue uncounted; if it did,
        its time from arrival to end is counted."""
        self.ended = True
        if self.gate is not None:
            self.gate.leave(self, started=False)
            if self.started:
                self.gate.ended(self)


@dataclass
class ClassStats:
    queued: int = 0
    admitted: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTIONS, 0))
    waits: list[float] = field(default_factory=list)  # seconds from arrival to start, since the last `drain`
    latencies: list[float] = field(default_factory=list)  # from arrival to end (started ones), since the last `drain`


class Admission:
    """Thread-safe per-class count of waiting requests: refuses one more than a class's limit."""

    def __init__(self, limits: dict[str, float]):
        self.limits = limits
        self.stats = {name: ClassStats() for name in CLASSES}
        self._lock = threading.Lock()

    def enter(self, ticket: Ticket) -> None:
        with self._lock:
            stats = self.stats[ticket.qos_class]
            if stats.queued >= self.limits[ticket.qos_class]:
                stats.rejected["queue_full"] += 1
                raise Unavailable(f"the {ticket.qos_class} queue is full ({stats.queued} requests waiting): the "
                                  "server is overloaded, retry later")
            stats.queued += 1
            ticket.gate, ticket.queued = self, True

    def leave(self, ticket: Ticket, started: bool) -> None:
        with self._lock:
            if not ticket.queued:
                return
            ticket.queued = False
            stats = self.stats[ticket.qos_class]
            stats.queued -= 1
            if started:
                stats.admitted += 1
                stats.waits.append(time.monotonic() - ticket.arrival)

    def timed_out(self, ticket: Ticket) -> None:
        with self._lock:
            self.stats[ticket.qos_class].rejected["timeout"] += 1
        self.leave(ticket, started=False)

    def ended(self, ticket: Ticket) -> None:
        with self._lock:
            self.stats[ticket.qos_class].latencies.append(time.monotonic() - ticket.arrival)

    def drain(self) -> dict[str, ClassStats]:
        """Each class's counts, with its waits and latencies since the last drain (taken out)."""
        with self._lock:
            stats = {name: dataclasses.replace(s, rejected=dict(s.rejected)) for name, s in self.stats.items()}
            for s in self.stats.values():
                s.waits, s.latencies = [], []
            return stats


class QosPolicy:
    """A model's QoS settings: makes tickets and admits them."""

    def __init__(self, params: QosParams):
        self.max_wait_s = parse_mapping(params.qos_max_wait_s, CLASSES)
        self.timeout_s = parse_mapping(params.qos_timeout_s, CLASSES)
        self.weights = parse_mapping(params.qos_weights, SIZES, zero=True)
        self.size_max = parse_mapping(params.qos_size_max, SIZES)
        self.admission = Admission(parse_mapping(params.qos_max_queued, CLASSES))

    def score(self, image_tokens: float = 0, audio_s: float = 0, text_tokens: float = 0) -> float:
        sizes = {"image": image_tokens, "audio": audio_s, "text": text_tokens}
        return sum(self.weights[k] * min(sizes[k] / self.size_max[k], 1.0) for k in SIZES)

    def ticket(self, qos_class: str | None = None, score: float = 0.0, arrival: float | None = None) -> Ticket:
        """A ticket for a request of `qos_class` (None: the default class), not yet admitted."""
        name = DEFAULT_CLASS if qos_class is None else qos_class
        if name not in CLASSES:
            raise InvalidInput(f"request parameter {QOS_PARAMETER!r} = {qos_class!r}: expected one of {list(CLASSES)}")
        return Ticket(name, CLASSES.index(name), score, self.max_wait_s[name], self.timeout_s[name],
                      time.monotonic() if arrival is None else arrival)

    def admit(self, ticket: Ticket) -> Ticket:
        """Count it as waiting, or raise Unavailable when its class's queue is full."""
        self.admission.enter(ticket)
        return ticket


def admit_in_order(items: list, ticket: Callable[[object], Ticket], now: float, ahead: int | None = None,
                   waiting: list[Ticket] = ()) -> tuple[list, list, list]:
    """(to admit now, to hold, timed out) of requests ready for a consumer whose queue holds `waiting`: the ones past
    their timeout apart, the others in QoS order, each admitted while fewer than `ahead` (None: no limit) of its class
    or higher wait there, as QosPool runs work ahead. So a higher class is never held behind a lower one, and what
    is held is what would only wait in that queue."""
    expired, live = [], []
    for item in items:
        (expired if ticket(item).expired(now) else live).append(item)
    live.sort(key=lambda item: ticket(item).key(now))
    if ahead is None:
        return live, [], expired
    ranks, admit, hold = [t.rank for t in waiting], [], []
    for item in live:
        rank = ticket(item).rank
        if sum(r <= rank for r in ranks) < ahead:
            admit.append(item)
            ranks.append(rank)
        else:
            hold.append(item)
    return admit, hold, expired


def lower_priority(nice: int) -> None:
    """This thread's CPU niceness raised by `nice` (Linux schedules each thread by its own)."""
    if nice:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))


RECHECK_S = 0.05  # QosPool: how often work held back by the lower classes' share is tried again


class QosPool:
    """A thread pool that starts queued work in QoS order (each task's ticket, aged when a thread frees up) rather
    than as submitted: a small image of class high does not wait behind 4K photos of class low queued before it.

    With `ahead`, work runs at most that far ahead of its consumer: a task of class c starts only while fewer than
    `ahead` tasks of class c or higher have run without their requests starting (their tickets still queued). Under
    overload the requests that would wait anyway are not decoded early, so the CPU (and the device memory their images
    would hold) stays with the requests being served; the consumer calls `kick` when requests start. With `nice`, its
    threads run that much nicer than the rest of the process.

    With `lower_share`, while a request of a higher class is in flight (submitted here, not ended), work of lower
    classes (not overdue) runs one task at a time and in at most that share of the time (`LowerShare`): preparing a
    4K photo costs far more than its prefill step, so the engine's share alone let the photos' decoding take the CPU
    (or the GPU) from the higher class's steps."""

    def __init__(self, threads: int, name: str, ahead: int | None = None, nice: int = 0,
                 lower_share: float | None = None):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=lower_priority, initargs=(nice,))
        self._queued: list[tuple[Ticket, int, Future, Callable, tuple]] = []
        self._lock = threading.Lock()
        self._order = itertools.count()  # ties: first submitted first
        self.ahead = ahead
        self._ran: list[Ticket] = []  # tickets of the tasks run whose requests have not started
        self._parked = 0  # runs that found no task with room ahead
        self._share = LowerShare(lower_share) if lower_share else None
        self._live: list[Ticket] = []  # with a share: tickets submitted whose requests have not ended
        self._held = 0  # runs whose tasks the share held back: one is tried again by a timer (`_wake`)
        self._wake: threading.Timer | None = None

    def submit(self, ticket: Ticket, fn: Callable, *args) -> Future:
        future: Future = Future()
        with self._lock:
            self._queued.append((ticket, next(self._order), future, fn, args))
            if self._share is not None:
                self._live.append(ticket)
        self._pool.submit(self._run_next)  # one run per task; each takes whichever task comes first by then
        return future

    def kick(self) -> None:
        """Requests may have started: one parked run again for each task run ahead whose request has started."""
        with self._lock:
            running_ahead = len(self._ran)
            self._ran = [t for t in self._ran if t.queued]
            runs = min(self._parked, running_ahead - len(self._ran))
            self._parked -= runs
        for _ in range(runs):
            self._pool.submit(self._run_next)

    def _room(self, ticket: Ticket) -> bool:
        return self.ahead is None or sum(t.rank <= ticket.rank for t in self._ran) < self.ahead

    def _run_next(self) -> None:
        now = time.monotonic()
        with self._lock:
            ready = [queued for queued in self._queued if self._room(queued[0])]
            top = self._top_in_flight()
            allowed = ready
            if self._share is not None and self._share.closed(now):
                allowed = [queued for queued in ready if not self._lower(queued[0], top, now)]
            if not allowed:
                if ready:
                    self._held += 1
                    self._wake_later(now)
                else:
                    self._parked += 1
                return
            item = min(allowed, key=lambda queued: (queued[0].key(now), queued[1]))
            self._queued.remove(item)
            if self.ahead is not None:
                self._ran.append(item[0])
            lower = self._lower(item[0], top, now)
            if lower:
                self._share.open_at = math.inf  # one lower task at a time; `spent` reopens the share
            elif self._held:  # what held them may be gone (the higher request ended): one more tries
                self._held -= 1
                self._pool.submit(self._run_next)
        _, _, future, fn, args = item
        try:
            if future.set_running_or_notify_cancel():
                future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)
        finally:
            if lower:
                with self._lock:
                    end = time.monotonic()
                    if self._share is not None:  # (None after shutdown)
                        self._share.spent(end - now, end)
                    self._wake_later(end)

    def _top_in_flight(self) -> int | None:
        """(Lock held.) The highest class (lowest rank) of the requests in flight, with a share."""
        if self._share is None:
            return None
        self._live = [t for t in self._live if not t.ended]
        return min((t.rank for t in self._live), default=None)

    def _lower(self, ticket: Ticket, top: int | None, now: float) -> bool:
        """Whether the share applies to `ticket`: a request of a higher class is in flight and it is not overdue."""
        return top is not None and ticket.rank > top and not ticket.overdue(now)

    def _wake_later(self, now: float) -> None:
        """(Lock held.) One held run tried again when the share opens, or sooner (RECHECK_S): the higher request
        may end first."""
        if not self._held or self._wake is not None or self._share is None or self._share.open_at == math.inf:
            return
        self._wake = threading.Timer(min(max(0.0, self._share.open_at - now), RECHECK_S), self._retry_held)
        self._wake.daemon = True
        self._wake.start()

    def _retry_held(self) -> None:
        with self._lock:
            self._wake = None
            if not self._held:
                return
            self._held -= 1
        self._pool.submit(self._run_next)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Like ThreadPoolExecutor's; the tasks still queued are cancelled, or else all run (none is left parked)."""
        with self._lock:
            if cancel_futures:
                for _, _, future, _, _ in self._queued:
                    future.cancel()
            self.ahead, self._share, parked, self._parked, self._held = None, None, self._parked + self._held, 0, 0
        for _ in range(parked):
            self._pool.submit(self._run_next)
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def read_qos_class(parameters: dict) -> str | None:
    """The `qos_class` request parameter (a string), taken out of `parameters`."""
    value = parameters.pop(QOS_PARAMETER, None)
    if value is not None and not isinstance(value, str):
        raise InvalidInput(f"request parameter {QOS_PARAMETER!r} must be a string, one of {list(CLASSES)}")
    return value
