"""The engine loop's traffic to the server on a thread of its own.

In the python backend a response `send`, a request's `is_cancelled` and a metric `set` each wait for a round trip to
the server process (tens of microseconds). Made on the engine loop, 64 streams' responses alone keep the GPU idle for
milliseconds a step. The outbox makes them on one background thread, which releases the GIL while it waits, and
merges the text deltas of a stream that queued up meanwhile into one response, as streaming servers do under load.
Finals are sent after everything queued before them for their stream, and a request is never asked whether it was
cancelled once its final response has gone. A round of those questions gives way to responses queued meanwhile: with
hundreds of requests queued in the engine (at twice the capacity), a round of round trips would hold up every
stream's next token. Rounds are also spaced so that they take at most POLL_SHARE of the thread's time: asked back to
back, 500 queued requests kept both outbox threads busy on a 2-core VM, which the engine loop then lacked.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)

POLL_SHARE = 0.25  # of an outbox thread's time, at most, asking whether requests were cancelled


@dataclass
class _Message:
    sender: object
    text: str | None  # a text delta (merged with the stream's next ones), or None: `response` as it is
    response: object = None
    final: bool = False
    finish_reason: str | None = None  # of a final text delta
    arrive: Callable[[], None] | None = None  # a barrier (send_after_queued): called instead of sending


class Outbox:
    """Sends responses, polls cancellation and sets metrics for a decoupled model's engine loop, on `threads`
    threads; each stream belongs to one of them, so its responses keep their order.

    `text_response(text, finish_reason)` builds the response for a (merged) text delta; `update_metrics(gauges,
    totals)` sets the metrics. Cancelled requests of watched streams are reported through `cancelled()` by their key."""

    def __init__(self, text_response: Callable[[str, str | None], object], final_flag: int,
                 update_metrics: Callable[[dict, dict], None], poll_s: float = 0.01, name: str = "outbox",
                 threads: int = 1):
        self._shards = [_OutboxThread(text_response, final_flag, update_metrics, poll_s, name if threads == 1
                                      else f"{name}-{i}") for i in range(threads)]
        self._owners: dict[int, _OutboxThread] = {}  # id(sender) -> its thread, until its final response
        self._next = 0

    def _shard(self, sender, final: bool = False) -> _OutboxThread:
        """Streams go to the threads in turn."""
        shard = self._owners.pop(id(sender), None) if final else self._owners.get(id(sender))
        if shard is None:
            shard, self._next = self._shards[self._next], (self._next + 1) % len(self._shards)
            if not final:
                self._owners[id(sender)] = shard
        return shard

    def text(self, sender, text: str, final: bool = False, finish_reason: str | None = None) -> None:
        self._shard(sender, final).text(sender, text, final, finish_reason)

    def send(self, sender, response=None, final: bool = True) -> None:
        """A response as it is (an error, a JSON answer), or with `response` None only the final flag."""
        self._shard(sender, final).send(sender, response, final)

    def send_after_queued(self, sender, response) -> None:
        """`response` as a final one, once every thread has sent what was queued before it: an answer that must
        follow other streams' responses (an adapter's unload, after its last stream's tokens)."""
        remaining, lock = [len(self._shards)], threading.Lock()

        def arrive() -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self._shards[0].deliver(_Message(sender, None, response, final=True))
        for shard in self._shards:
            shard.barrier(arrive)

    def watch(self, sender, request, key: Hashable) -> None:
        """Poll `request.is_cancelled()` until the stream's final response is sent; a cancellation reports `key`."""
        self._shard(sender).watch(sender, request, key)

    def cancelled(self) -> list[Hashable]:
        return [key for shard in self._shards for key in shard.cancelled()]

    def metrics(self, gauges: dict, totals: dict) -> None:
        self._shards[0].metrics(gauges, totals)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop; later messages are sent at once on the caller's thread."""
        for shard in self._shards:
            shard.close(timeout_s)


class _OutboxThread:
    """One thread of an outbox and the streams it serves."""

    def __init__(self, text_response: Callable[[str, str | None], object], final_flag: int,
                 update_metrics: Callable[[dict, dict], None], poll_s: float, name: str):
        self._text_response = text_response
        self._final_flag = final_flag
        self._update_metrics = update_metrics
        self._poll_s = poll_s
        self._messages: list[_Message] = []
        self._metrics: tuple[dict, dict] | None = None
        self._watched: dict[int, tuple[object, Hashable]] = {}  # id(sender) -> (request, key); this thread only
        self._to_watch: list[tuple[object, object, Hashable]] = []
        self._round: list[int] = []  # id(sender)s the current round of cancellation polls has still to ask
        self._round_start = self._round_busy = self._next_round = 0.0  # (seconds of time.monotonic)
        self._cancelled: queue.SimpleQueue[Hashable] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- called by the engine loop ----------------------------------------------------------------------------
    def text(self, sender, text: str, final: bool = False, finish_reason: str | None = None) -> None:
        self._post(_Message(sender, text, final=final, finish_reason=finish_reason))

    def send(self, sender, response=None, final: bool = True) -> None:
        self._post(_Message(sender, None, response, final))

    def barrier(self, arrive: Callable[[], None]) -> None:
        self._post(_Message(None, None, arrive=arrive))

    def watch(self, sender, request, key: Hashable) -> None:
        with self._lock:
            self._to_watch.append((sender, request, key))

    def cancelled(self) -> list[Hashable]:
        keys = []
        while True:
            try:
                keys.append(self._cancelled.get_nowait())
            except queue.Empty:
                return keys

    def metrics(self, gauges: dict, totals: dict) -> None:
        with self._lock:
            self._metrics = (gauges, totals)

    def close(self, timeout_s: float) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(timeout=timeout_s)

    def _post(self, message: _Message) -> None:
        with self._lock:
            if not self._closing:
                self._messages.append(message)
                self._lock.notify()
                return
        self.deliver(message)  # after `close`: on the caller's thread

    # --- the outbox thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                if not (self._messages or self._closing):
                    self._lock.wait(timeout=self._poll_s)
                messages, self._messages = self._messages, []
                metrics, self._metrics = self._metrics, None
                to_watch, self._to_watch = self._to_watch, []
                closing = self._closing
            for sender, request, key in to_watch:
                self._watched[id(sender)] = (request, key)
            for message in merge_deltas(messages):
                self.deliver(message)
            if closing and not messages:
                return
            if metrics is not None:
                self._guard(self._update_metrics, *metrics)
            if self._round or time.monotonic() >= self._next_round:
                self._poll_cancelled()

    def deliver(self, message: _Message) -> None:
        if message.arrive is not None:
            message.arrive()
            return
        response = self._text_response(message.text, message.finish_reason) if message.text is not None \
            else message.response
        flags = self._final_flag if message.final else 0
        if message.final:
            self._watched.pop(id(message.sender), None)
        self._guard(message.sender.send, response, flags=flags)

    def _poll_cancelled(self) -> None:
        """Asks the watched requests of this round (a new round: all of them) whether they were cancelled, until
        the round ends or a message waits to be sent; the round goes on after it. The next round starts `poll_s`
        after this one did, or later, when this one's questions took more than POLL_SHARE of that time."""
        if not self._round:
            self._round, self._round_start, self._round_busy = list(self._watched), time.monotonic(), 0.0
        while self._round and not self._messages:  # (a list's truth read without the lock: at worst one ask more)
            sender_id = self._round.pop()
            watched = self._watched.get(sender_id)
            if watched is None:
                continue
            asked = time.monotonic()
            cancelled = self._guard(watched[0].is_cancelled)
            self._round_busy += time.monotonic() - asked
            if cancelled:
                del self._watched[sender_id]
                self._cancelled.put(watched[1])
        if not self._round:
            self._next_round = self._round_start + max(self._poll_s, self._round_busy / POLL_SHARE)

    @staticmethod
    def _guard(call, *args, **kwargs):
        """One failed IPC call (a stream the server already closed) must not stop the outbox."""
        try:
            return call(*args, **kwargs)
        except Exception:
            log.exception("outbox: %s failed", getattr(call, "__qualname__", call))
            return None


def merge_deltas(messages: list[_Message]) -> list[_Message]:
    """Consecutive text deltas of one stream become one message; each stream keeps its own order."""
    merged: list[_Message] = []
    last: dict[int, _Message] = {}  # id(sender) -> its latest message in `merged`
    for message in messages:
        previous = last.get(id(message.sender))
        if previous is not None and previous.text is not None and message.text is not None and not previous.final:
            previous.text += message.text
            previous.final, previous.finish_reason = message.final, message.finish_reason
            continue
        merged.append(message)
        last[id(message.sender)] = message
    return merged
