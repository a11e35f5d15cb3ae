"""Our batcher: the adaptive window's rule, QoS order of waiting requests, one class per batch, full batches leave at
once, a window that gathers, refusals at close and after a timeout, and a failing run answered for every job. The
continuous batcher: requests join a busy engine between steps as it has room, in QoS order; failures and close
answer every request it holds."""
from __future__ import annotations

import threading

import pytest

import time

from backends.core.batcher import Batcher, BatchWindow, ContinuousBatcher, Job
from backends.core.errors import Unavailable
from backends.core.qos import QosParams, QosPolicy


def test_adaptive_window_grows_with_backlog_and_shrinks_when_waiting_gains_nothing():
    window = BatchWindow("adaptive", 0.016)
    assert window.current_s == 0.0
    window.backlog(1)  # one request at a time: never a wait
    assert window.current_s == 0.0
    for expected in (0.002, 0.004):
        window.backlog(2)
        assert window.current_s == pytest.approx(expected)
    window.waited(gathered=3)
    assert window.current_s == pytest.approx(0.006)
    for _ in range(20):
        window.backlog(5)
    assert window.current_s == pytest.approx(0.016)  # capped at the maximum
    window.waited(gathered=0)
    assert window.current_s == pytest.approx(0.008)
    for _ in range(8):
        window.waited(gathered=0)
    assert window.current_s == 0.0  # back to passing requests straight through


def test_adaptive_window_shrinks_when_p99_rises_above_its_baseline():
    window = BatchWindow("adaptive", 0.016)
    for _ in range(8):
        window.backlog(2)
    for _ in range(BatchWindow.LATENCY_SAMPLE):
        window.finished(0.010)
    assert window.baseline_p99_s == pytest.approx(0.010) and window.current_s == pytest.approx(0.016)
    for _ in range(BatchWindow.LATENCY_SAMPLE):
        window.finished(0.020)
    assert window.current_s == pytest.approx(0.008)
    assert window.baseline_p99_s == pytest.approx(0.012)


def test_fixed_window_never_moves():
    window = BatchWindow("fixed", 0.015)
    window.waited(gathered=0)
    window.backlog(10)
    assert window.current_s == 0.015
    with pytest.raises(ValueError, match="adaptive or fixed"):
        BatchWindow("triton", 0.015)


class Recorder:
    """A batcher's `run`: records each batch's work, optionally held until released."""

    def __init__(self, hold: bool = False, fail: Exception | None = None):
        self.batches: list[list] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        if not hold:
            self.release.set()
        self.fail = fail

    def __call__(self, batch: list[Job]) -> list:
        self.entered.set()
        self.release.wait(10)
        self.batches.append([job.work for job in batch])
        if self.fail is not None:
            raise self.fail
        return [f"out-{job.work}" for job in batch]


def make_job(policy: QosPolicy, work, qos_class: str | None = None, score: float = 0.0):
    answered = threading.Event()
    result = {}

    def answer(output):
        result["output"] = output
        answered.set()
    return Job(work, policy.admit(policy.ticket(qos_class, score)), answer), answered, result


def busy_batcher(policy: QosPolicy, first: str, max_batch: int = 1):
    """A batcher whose engine is busy with the job `first` until `run.release` is set; jobs put meanwhile wait.
    Returns the batcher, its Recorder and `first`'s (job, answered, result)."""
    run = Recorder(hold=True)
    batcher = Batcher(run, max_batch=max_batch, window=BatchWindow("adaptive", 0.015))
    job = make_job(policy, first)
    batcher.put(job[0])
    assert run.entered.wait(5)
    return batcher, run, job


def test_waiting_requests_run_by_class_then_score():
    policy = QosPolicy(QosParams())
    batcher, run, _ = busy_batcher(policy, "first")
    jobs = [make_job(policy, name, cls, score) for name, cls, score in
            [("low", "low", 0.0), ("normal-big", "normal", 0.9), ("normal-small", "normal", 0.1), ("high", "high", 1)]]
    for job, _, _ in jobs:
        batcher.put(job)
    run.release.set()
    for _, answered, _ in jobs:
        assert answered.wait(5)
    batcher.close()
    assert run.batches == [["first"], ["high"], ["normal-small"], ["normal-big"], ["low"]]
    assert jobs[0][2]["output"] == "out-low"
    assert all(s.queued == 0 for s in policy.admission.drain().values())



def test_a_batch_holds_one_class():
    policy = QosPolicy(QosParams())
    batcher, run, _ = busy_batcher(policy, "first", max_batch=4)
    jobs = [make_job(policy, name, name.split("-")[0]) for name in ("low-a", "high-a", "low-b", "high-b")]
    for job, _, _ in jobs:
        batcher.put(job)
    run.release.set()
    assert all(answered.wait(5) for _, answered, _ in jobs)
    batcher.close()
    assert run.batches == [["first"], ["high-a", "high-b"], ["low-a", "low-b"]]


def test_a_full_batch_leaves_at_once_and_a_window_gathers_more():
    policy = QosPolicy(QosParams())
    run = Recorder()
    batcher = Batcher(run, max_batch=2, window=BatchWindow("fixed", 30.0))  # a window no test would outwait
    jobs = [make_job(policy, i) for i in range(2)]
    for job, _, _ in jobs:
        batcher.put(job)
    assert all(answered.wait(5) for _, answered, _ in jobs)  # full: did not wait for the 30 s window
    assert run.batches == [[0, 1]]
    batcher.close()

    gathering = Batcher(run := Recorder(), max_batch=8, window=BatchWindow("fixed", 0.5))
    jobs = [make_job(policy, i) for i in range(3)]
    for job, _, _ in jobs:
        gathering.put(job)
    assert all(answered.wait(5) for _, answered, _ in jobs)
    gathering.close()
    assert run.batches == [[0, 1, 2]]  # put within the window: one batch


def test_close_refuses_waiting_requests_and_later_ones():
    policy = QosPolicy(QosParams())
    batcher, run, (_, running_done, running_result) = busy_batcher(policy, "running")
    waiting, waiting_done, waiting_result = make_job(policy, "waiting")
    batcher.put(waiting)
    threading.Timer(0.2, run.release.set).start()
    batcher.close()
    assert running_done.wait(5) and running_result["output"] == "out-running"  # the batch in flight completes
    assert waiting_done.is_set() and isinstance(waiting_result["output"], Unavailable)
    late, late_done, late_result = make_job(policy, "late")
    batcher.put(late)
    assert late_done.is_set() and "unloaded" in str(late_result["output"])
    assert all(s.queued == 0 for s in policy.admission.drain().values())


def test_a_request_past_its_timeout_is_refused_and_counted():
    policy = QosPolicy(QosParams(qos_timeout_s="high=30,normal=120,low=0.05"))
    batcher, run, _ = busy_batcher(policy, "blocker")
    late, late_done, late_result = make_job(policy, "late", "low")
    batcher.put(late)
    threading.Timer(0.2, run.release.set).start()
    assert late_done.wait(5)
    batcher.close()
    assert isinstance(late_result["output"], Unavailable) and "timeout" in str(late_result["output"])
    assert policy.admission.drain()["low"].rejected["timeout"] == 1
    assert run.batches == [["blocker"]]


def test_a_failing_run_answers_every_job_with_its_error():
    policy = QosPolicy(QosParams())
    batcher = Batcher(Recorder(fail=RuntimeError("engine broke")), max_batch=4,
                      window=BatchWindow("fixed", 0.2))
    jobs = [make_job(policy, i) for i in range(2)]
    for job, _, _ in jobs:
        batcher.put(job)
    assert all(answered.wait(5) for _, answered, _ in jobs)
    batcher.close()
    assert all(isinstance(result["output"], RuntimeError) for _, _, result in jobs)


def test_setup_runs_on_the_batcher_thread_and_its_failure_raises_at_construction():
    threads = []
    batcher = Batcher(Recorder(), max_batch=1, window=BatchWindow("adaptive", 0.015), name="the-batcher",
                      setup=lambda: threads.append(threading.current_thread().name))
    batcher.close()
    assert threads == ["the-batcher"]  # where the engine is built is where it runs

    def broken():
        raise RuntimeError("no weights")
    with pytest.raises(RuntimeError, match="no weights"):
        Batcher(Recorder(), max_batch=1, window=BatchWindow("adaptive", 0.015), setup=broken)


class StepCounter:
    """A Stepper: each job's work is (name, steps it needs); `slots` jobs at a time; records when each job joined and
    left (in steps), optionally failing at a given step."""

    def __init__(self, slots: int, step_s: float = 0.002, fail_at: int | None = None):
        self.slots, self.step_s, self.fail_at = slots, step_s, fail_at
        self.held: dict[Job, int] = {}  # job -> steps left
        self.steps = 0
        self.joined: dict[str, int] = {}
        self.left: dict[str, int] = {}
        self.offered: list[str | None] = []  # the class of the first waiting job, as each room() saw it

    @property
    def busy(self) -> bool:
        return bool(self.held)

    def room(self, waiting) -> int:
        self.offered.append(None if waiting is None else waiting.qos_class)
        return self.slots - len(self.held)

    def admit(self, jobs: list[Job]) -> None:
        assert len(jobs) <= self.slots - len(self.held)
        for job in jobs:
            self.held[job] = job.work[1]
            self.joined[job.work[0]] = self.steps

    def step(self) -> list:
        self.steps += 1
        time.sleep(self.step_s)
        if self.steps == self.fail_at:
            raise RuntimeError("step broke")
        for job in self.held:
            self.held[job] -= 1
        done = [job for job, left in self.held.items() if left == 0]
        for job in done:
            del self.held[job]
            self.left[job.work[0]] = self.steps
        return [(job, f"out-{job.work[0]}") for job in done]

    def abort(self) -> list[Job]:
        jobs, self.held = list(self.held), {}
        return jobs


def test_continuous_batcher_lets_requests_join_a_busy_engine_in_qos_order():
    policy = QosPolicy(QosParams())
    engine = StepCounter(slots=2)
    batcher = ContinuousBatcher(engine, BatchWindow("adaptive", 0.015))
    long, long_done, _ = make_job(policy, ("long", 200))
    batcher.put(long)
    deadline = time.monotonic() + 5
    while engine.steps < 5 and time.monotonic() < deadline:
        time.sleep(0.001)
    short, short_done, short_result = make_job(policy, ("short", 5))
    batcher.put(short)
    assert short_done.wait(5) and short_result["output"] == "out-short"
    assert not long_done.is_set()  # the short one joined the running batch and left it first
    assert engine.joined["short"] > engine.joined["long"] and engine.left["short"] < 200
    while len(engine.held) < 2 and not long_done.is_set():  # refill the free slot, then queue two while full
        batcher.put(make_job(policy, ("filler", 30))[0])
        time.sleep(0.05)
    low, low_done, _ = make_job(policy, ("low", 1), "low")
    high, high_done, _ = make_job(policy, ("high", 1), "high")
    batcher.put(low)
    batcher.put(high)
    assert low_done.wait(5) and high_done.wait(5) and long_done.wait(5)
    batcher.close()
    assert engine.joined["high"] <= engine.joined["low"]  # the free slot went to the higher class first
    assert "high" in engine.offered  # the engine saw who waited first (a full engine may preempt for it)
    assert engine.left["long"] == 200


def test_continuous_batcher_answers_every_held_request_on_a_failed_step_and_at_close():
    policy = QosPolicy(QosParams())
    batcher = ContinuousBatcher(StepCounter(slots=4, fail_at=3), BatchWindow("fixed", 0.2))
    jobs = [make_job(policy, (i, 10)) for i in range(2)]
    for job, _, _ in jobs:
        batcher.put(job)
    assert all(answered.wait(5) for _, answered, _ in jobs)
    assert all(isinstance(result["output"], RuntimeError) for _, _, result in jobs)
    held, held_done, held_result = make_job(policy, ("held", 10 ** 6))  # still running when the model unloads
    batcher.put(held)
    time.sleep(0.05)
    batcher.close()
    assert held_done.is_set() and isinstance(held_result["output"], Unavailable)
    assert all(s.queued == 0 for s in policy.admission.drain().values())
