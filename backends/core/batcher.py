"""Our own batching queue for the dynamically batched models: QoS order and an adaptive batching window.

Triton's dynamic batcher holds a batch that is not full for its whole `max_queue_delay`, even when nothing else is
coming: at concurrency 1 a 15 ms window adds 15 ms to every request. With `batch_window` adaptive or fixed, a model
takes its requests from Triton as they arrive (its config has no dynamic batcher), answers each through its
response sender, and batches them here:
- waiting requests are taken in QoS order (backends.core.qos: class, then the aged cost score), at most `max_batch`,
  all of the first one's class: a batch runs in lockstep until its slowest request is done, so a cheap request of
  class high must not share one with a 4K image or half a minute of audio of class low;
- a batch that is not full waits for more up to the window. `fixed`: always `batch_window_max_ms`. `adaptive`:
  additive increase, multiplicative decrease. It starts at zero and grows by a step (max / 8) whenever requests
  queued up meanwhile (two or more waiting when the engine is free) or a wait gathered some; it halves when a wait
  gathered none, and when the p99 latency of the last 64 requests rises above 1.5x its rolling baseline. Requests
  that come one at a time therefore never wait.
`ContinuousBatcher` serves engines whose running batch takes and releases requests between steps (whisper's decoder):
waiting requests join in QoS order whenever the engine has room, without waiting for the batch in flight to end; a
full engine may preempt lower-class work for the first waiting request.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from backends.core.errors import Unavailable
from backends.core.heartbeat import IDLE_WAKE_S, Heartbeat
from backends.core.params import bounded, choice
from backends.core.qos import QosParams, Ticket

log = logging.getLogger(__name__)
WINDOWS = ("triton", "adaptive", "fixed")  # "triton": Triton's dynamic batcher batches, not this module


@dataclass(frozen=True)
class BatchingParams(QosParams):
    """Model-config parameters of the dynamically batched backends."""

    batch_window: str = choice(*WINDOWS)  # who batches and how long a batch that is not full waits (see above)
    batch_window_max_ms: float = bounded(15.0, 0)
    # niceness added to the prepare threads: decoding yields the CPU to the thread that admits requests, so under
    # overload the excess is refused at once instead of queueing in Triton before `execute` (perf.overload)
    prepare_nice: int = bounded(5, 0, 19)
    # threads that make and send our batcher's responses while it runs the next batch (0: its own thread sends them)
    response_threads: int = bounded(2, 0)


class BatchWindow:
    """How long a batch that is not full waits for more requests (see the module's docstring)."""

    LATENCY_SAMPLE = 64  # requests per p99 check
    P99_TOLERANCE = 1.5  # p99 above this multiple of the baseline shrinks the window
    BASELINE_WEIGHT = 0.2  # of each new p99 in the rolling baseline

    def __init__(self, mode: str, max_s: float):
        if mode not in WINDOWS[1:]:
            raise ValueError(f"batch window {mode!r}: expected adaptive or fixed")
        self.adaptive = mode == "adaptive"
        self.max_s = max_s
        self.step_s = max_s / 8
        self.current_s = 0.0 if self.adaptive else max_s
        self.baseline_p99_s: float | None = None
        self._latencies: list[float] = []

    def backlog(self, waiting: int) -> None:
        """`waiting` requests are queued as the engine becomes free: two or more means they arrive faster than
        one per batch, and a longer window makes fuller batches."""
        if waiting > 1:
            self._grow()

    def waited(self, gathered: int) -> None:
        """A wait of `current_s` for a batch that was not full gathered `gathered` more requests."""
        self._grow() if gathered else self._shrink()

    def finished(self, latency_s: float) -> None:
        """One request's latency, arrival to response."""
        self._latencies.append(latency_s)
        if len(self._latencies) < self.LATENCY_SAMPLE:
            return
        p99 = float(np.percentile(self._latencies, 99))
        self._latencies.clear()
        if self.baseline_p99_s is not None and p99 > self.P99_TOLERANCE * self.baseline_p99_s:
            self._shrink()
        self.baseline_p99_s = p99 if self.baseline_p99_s is None else \
            (1 - self.BASELINE_WEIGHT) * self.baseline_p99_s + self.BASELINE_WEIGHT * p99

    def _grow(self) -> None:
        if self.adaptive:
            self.current_s = min(self.max_s, self.current_s + self.step_s)

    def _shrink(self) -> None:
        if self.adaptive:
            self.current_s = self.current_s / 2 if self.current_s > self.step_s / 8 else 0.0


@dataclass(eq=False)
class Job:
    """One request in the batcher: what the engine needs (`work`), its QoS ticket, and `answer`, which sends its
    response (an output or an exception)."""

    work: Any
    ticket: Ticket | None
    answer: Callable[[Any], None]


class Batcher:
    """A thread that runs `setup()` once (it raises here if that fails), then `run(batch)` (one output or exception
    per job, in order) over batches of waiting jobs, then `after()` (metrics; before the batch's answers, so a client
    that has its answer sees it counted), then answers them.

    Build the engine in `setup`, on this thread: torch's CPU kernels ran 1.9x slower on a thread of their own once
    another thread had used them (each thread that runs OpenMP parallel regions keeps a team of workers; with more
    of them than cores libgomp stops spinning and every region waits for its workers to wake up)."""

    def __init__(self, run: Callable[[list[Job]], list[Any]], max_batch: int, window: BatchWindow,
                 name: str = "batcher", setup: Callable[[], None] = lambda: None,
                 after: Callable[[], None] = lambda: None, heartbeat: Heartbeat | None = None):
        """`heartbeat`: beats on every pass of the loop, idle ones too (at least every IDLE_WAKE_S), and times the
        batches."""
        self._run = run
        self._after = after
        self._heartbeat = heartbeat
        self.max_batch = max_batch
        self.window = window
        self._jobs: list[Job] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = self.requests = 0  # run so far (the batch being run counts)
        self.after_seconds = 0.0  # spent in `after` (metrics: a round trip to the server each)
        self._thread = start_thread(setup, self._loop, name)

    def put(self, job: Job) -> None:
        with self._cond:
            if not self._closed:
                self._jobs.append(job)
                self._cond.notify()
                return
        answer(job, Unavailable("the model is being unloaded"))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the batch in flight; the jobs still waiting are refused (UNAVAILABLE)."""
        with self._cond:
            self._closed = True
            waiting, self._jobs = self._jobs, []
            self._cond.notify()
        self._thread.join(timeout=timeout_s)
        for job in waiting:
            answer(job, Unavailable("the model is being unloaded"))

    # --- the batcher thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            if batch:  # empty when every waiting job had timed out
                with self._heartbeat.step() if self._heartbeat else nullcontext():
                    self._run_batch(batch)

    def _run_batch(self, batch: list[Job]) -> None:
        """Start the batch's jobs (they leave the QoS queue), run it, answer each job, feed the window."""
        for job in batch:
            job.ticket.start()
        self.batches, self.requests = self.batches + 1, self.requests + len(batch)
        try:
            outputs = self._run(batch)
        except Exception as e:  # `run` isolates failures per job; this is a bug in it, still answered
            log.exception("batch of %d failed", len(batch))
            outputs = [e] * len(batch)
        now = time.monotonic()
        self._run_after("after a batch")
        for job, output in zip(batch, outputs):
            answer(job, output)
            self.window.finished(now - job.ticket.arrival)

    def _run_after(self, what: str) -> None:
        start = time.perf_counter()
        try:
            self._after()
        except Exception:
            log.exception(what)
        self.after_seconds += time.perf_counter() - start

    def _next_batch(self) -> list[Job] | None:
        with self._cond:
            while not (self._jobs or self._closed):
                if self._heartbeat:
                    self._heartbeat.beat()
                self._cond.wait(IDLE_WAKE_S)
            if self._closed:
                return None
            expired = self._take_expired(time.monotonic())
            if self._jobs:
                self.window.backlog(len(self._jobs))
                self._wait_for_more()
            now = time.monotonic()
            self._jobs.sort(key=lambda job: job.ticket.key(now))
            batch, rest = [], []
            for job in self._jobs:  # the first job's class, up to max_batch, in order
                same = job.ticket.rank == self._jobs[0].ticket.rank and len(batch) < self.max_batch
                (batch if same else rest).append(job)
            self._jobs = rest
        for job, error in expired:
            answer(job, error)
        return batch

    def _wait_for_more(self, limit: int | None = None) -> None:
        """Hold a batch that is not full (`limit`, default max_batch) up to the window (lock held; `wait`
        releases it)."""
        limit = limit or self.max_batch
        if len(self._jobs) >= limit or self.window.current_s <= 0:
            return
        before, deadline = len(self._jobs), time.monotonic() + self.window.current_s
        while len(self._jobs) < limit and not self._closed and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        self.window.waited(len(self._jobs) - before)

    def _take_expired(self, now: float) -> list[tuple[Job, Exception]]:
        """Jobs that waited past their class's timeout, with the error to refuse them with."""
        expired, self._jobs = [j for j in self._jobs if j.ticket.expired(now)], \
            [j for j in self._jobs if not j.ticket.expired(now)]
        return [(job, job.ticket.time_out(now)) for job in expired]


class Stepper(Protocol):
    """An engine that runs requests in steps, taking new ones between steps (ContinuousBatcher's engine)."""

    busy: bool  # holds requests (so the loop steps without waiting for new ones)

    def room(self, waiting: Ticket | None) -> int:
        """How many more jobs it takes now; when it is full, it may make room for one by preempting work of a lower
        class than `waiting` (the ticket of the job first in QoS order, None when none waits)."""

    def admit(self, jobs: list[Job]) -> None:
        """Take jobs (their `work`); they run from the next step."""

    def step(self) -> list[tuple[Job, Any]]:
        """One step; the jobs that finished with their output (or exception: failures stay with their jobs)."""

    def abort(self) -> list[Job]:
        """Drop every job held (after a failure `step` did not contain, or at close); returns them."""


class ContinuousBatcher(Batcher):
    """A thread that runs `setup()`, then steps `engine` while it is busy; between steps, waiting jobs join it in QoS
    order up to its room (any class: a continuous batch has no lockstep). When it is idle the window applies, as in
    Batcher. `after()` (metrics) runs once jobs joined or left, at most every AFTER_EVERY_S while the engine is busy
    (each metric update is a round trip to the server) and at once when it goes idle."""

    # each update is a round trip to the server per metric, with no step launched meanwhile: at 0.05 s whisper's
    # loop spent 0.24 ms a step on them, 1.6% of its time (H100, perf/results/h100/2026-12-07e-whisper-throughput.md)
    AFTER_EVERY_S = 0.25

    def __init__(self, engine: Stepper, window: BatchWindow, name: str = "batcher",
                 setup: Callable[[], None] = lambda: None, after: Callable[[], None] = lambda: None,
                 heartbeat: Heartbeat | None = None):
        self.engine = engine
        self._changed, self._after_at = False, 0.0  # jobs joined or left since `after` last ran; when it did
        super().__init__(lambda batch: [], 0, window, name, setup, after, heartbeat)

    def _loop(self) -> None:
        while (jobs := self._take()) is not None:
            with self._heartbeat.step() if self._heartbeat else nullcontext():
                self._step(jobs)
        for job in self.engine.abort():
            answer(job, Unavailable("the model is being unloaded"))

    def _step(self, jobs: list[Job]) -> None:
        for job in jobs:
            job.ticket.start()
        try:
            if jobs:
                self.batches, self.requests = self.batches + 1, self.requests + len(jobs)
                self.engine.admit(jobs)
            finished = self.engine.step() if self.engine.busy else []
        except Exception as e:  # the engine isolates failures per job; this is a bug in it, still answered
            log.exception("engine step failed")
            finished = [(job, e) for job in self.engine.abort()]
        now = time.monotonic()
        for job, output in finished:
            answer(job, output)
            self.window.finished(now - job.ticket.arrival)
        self._changed = self._changed or bool(jobs or finished)
        if self._changed and (not self.engine.busy or now - self._after_at >= self.AFTER_EVERY_S):
            self._changed, self._after_at = False, now
            self._run_after("after a step")

    def _take(self) -> list[Job] | None:
        """Jobs to admit before the next step (none while the engine is full); None once closed."""
        with self._cond:
            while not (self._jobs or self._closed or self.engine.busy):
                if self._heartbeat:
                    self._heartbeat.beat()
                self._cond.wait(IDLE_WAKE_S)
            if self._closed:
                return None
            expired = self._take_expired(time.monotonic())
            now = time.monotonic()
            self._jobs.sort(key=lambda job: job.ticket.key(now))
            room, jobs = self.engine.room(self._jobs[0].ticket if self._jobs else None), []
            if self._jobs and room > 0:
                if not self.engine.busy:
                    self.window.backlog(len(self._jobs))
                    self._wait_for_more(room)
                    now = time.monotonic()
                    self._jobs.sort(key=lambda job: job.ticket.key(now))
                jobs, self._jobs = self._jobs[:room], self._jobs[room:]
        for job, error in expired:
            answer(job, error)
        return jobs


def start_thread(setup: Callable[[], None], run: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread that runs `setup()` then `run()`; returns once `setup` is done, raising what it raised.
    For engines: built on the thread that runs them (see Batcher)."""
    ready, failure = threading.Event(), []

    def main() -> None:
        try:
            setup()
        except Exception as e:
            failure.append(e)
            return
        finally:
            ready.set()
        run()
    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    ready.wait()
    if failure:
        raise failure[0]
    return thread


def answer(job: Job, output: Any) -> None:
    """Send a job's response (it leaves the QoS queue); a client gone meanwhile is logged, nothing more."""
    if job.ticket is not None:  # None: refused before it had one
        job.ticket.end()
    try:
        job.answer(output)
    except Exception:
        log.exception("sending a response failed")
