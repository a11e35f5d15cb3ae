"""backends/core/qos.py and the LLM engine's queue under it: order by class then aged cost score, the aging bound,
per-class queue limits, timeouts, and the reasons given when a request is refused."""
from __future__ import annotations

import threading
import time

import pytest

from backends.core.errors import InvalidInput, Unavailable
from backends.core.params import ParameterError
from backends.core.qos import QosParams, QosPolicy, QosPool, Ticket, admit_in_order
from backends.llm import scheduler as scheduler_module
from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.sampling import SamplingParams
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT

POLICY = QosPolicy(QosParams(qos_max_wait_s="high=1,normal=4,low=10", qos_max_queued="high=2,normal=2,low=1",
                             qos_timeout_s="high=5,normal=5,low=20"))


def order(tickets: list[Ticket], now: float) -> list[Ticket]:
    return sorted(tickets, key=lambda t: t.key(now))


def test_cost_score_weights_normalised_sizes_capped_at_their_maximum():
    policy = QosPolicy(QosParams(qos_size_max="image=1000,audio=10,text=100"))
    assert policy.score() == 0
    assert policy.score(image_tokens=500) == pytest.approx(0.4 * 0.5)
    assert policy.score(audio_s=5, text_tokens=50) == pytest.approx(0.35 * 0.5 + 0.25 * 0.5)
    assert policy.score(image_tokens=10**6, audio_s=10**6, text_tokens=10**6) == pytest.approx(1.0)


def test_class_first_then_the_cheaper_then_the_wait_makes_up_for_the_cost():
    t0 = 100.0
    high_heavy = POLICY.ticket("high", score=0.9, arrival=t0)
    normal_light = POLICY.ticket("normal", score=0.0, arrival=t0)
    normal_heavy = POLICY.ticket(None, score=0.8, arrival=t0)
    low = POLICY.ticket("low", score=0.0, arrival=t0)
    assert order([low, normal_heavy, normal_light, high_heavy], t0) == [high_heavy, normal_light, normal_heavy, low]
    # within a class, a heavy request that has waited 3.5 of its 4 s (0.8 - 0.875) passes a light one just arrived
    fresh_light = POLICY.ticket("normal", score=0.0, arrival=t0 + 3.5)
    assert order([fresh_light, normal_heavy], t0 + 3.5) == [normal_heavy, fresh_light]


def test_the_aging_bound_overdue_requests_go_first_by_deadline():
    t0 = 0.0
    low = POLICY.ticket("low", score=1.0, arrival=t0)  # deadline t0 + 10
    normal = POLICY.ticket("normal", score=1.0, arrival=t0 + 7)  # deadline t0 + 11
    high = POLICY.ticket("high", score=0.0, arrival=t0 + 10.5)  # deadline t0 + 11.5
    assert order([high, normal, low], t0 + 10.5)[0] is low  # overdue: ahead of a fresh high request
    assert order([high, normal, low], t0 + 11.2) == [low, normal, high]  # both overdue, earliest deadline first


def test_requests_are_admitted_in_qos_order_at_most_ahead_of_their_consumer_by_class():
    """What `vlm` admits (and encodes), two at most waiting ahead of its engine: a high request that arrived last goes
    first, then the cheapest low one; when a low one already waits, the high one still goes and no low one does; one
    past its timeout is handed back to be refused."""
    t0 = 0.0
    lows = [POLICY.ticket("low", score=s, arrival=t0) for s in (0.9, 0.1, 0.5)]
    high = POLICY.ticket("high", score=0.9, arrival=t0 + 3)
    stale = POLICY.ticket("normal", score=0.0, arrival=t0 - 2.5)  # 5.5 s waited at t0 + 3, its timeout is 5 s
    pending = [*lows, stale, high]
    admit, hold, expired = admit_in_order(pending, lambda t: t, t0 + 3, ahead=2)
    assert admit == [high, lows[1]] and hold == [lows[2], lows[0]] and expired == [stale]
    one_low = [POLICY.ticket("low", arrival=t0)]
    assert admit_in_order(pending, lambda t: t, t0 + 3, ahead=2, waiting=one_low)[0] == [high]
    full = [POLICY.ticket("high", arrival=t0)] * 2  # two high ones waiting: nothing more
    assert admit_in_order(pending, lambda t: t, t0 + 3, ahead=2, waiting=full)[0] == []
    assert admit_in_order(pending, lambda t: t, t0 + 3)[0] == [high, *(lows[i] for i in (1, 2, 0))]  # no limit


def test_a_low_request_is_served_within_its_bound_under_a_stream_of_high_ones():
    """One request served per 0.1 s tick, two high ones arriving every tick (twice the capacity): class order alone
    would starve the low request forever. Overdue first by deadline, with the high queue's limit (2) bounding what
    can be overdue before it, it starts within its bound of 10 s plus two ticks."""
    policy = QosPolicy(QosParams(qos_max_wait_s="high=1,normal=4,low=10", qos_max_queued="high=2,normal=2,low=1"))
    now, queue, refused = 0.0, [policy.admit(policy.ticket("low", score=0.5, arrival=0.0))], 0
    while True:
        for _ in range(2):
            try:
                queue.append(policy.admit(policy.ticket("high", score=0.0, arrival=now)))
            except Unavailable:
                refused += 1
        served = order(queue, now)[0]
        queue.remove(served)
        served.start()
        if served.qos_class == "low":
            break
        now += 0.1
    assert 10.0 <= now <= 10.2 + 1e-9 and refused > 90


def test_queue_limits_refuse_at_once_with_the_reason_and_count_by_class():
    policy = QosPolicy(QosParams(qos_max_queued="high=1,normal=2,low=1"))
    first = policy.admit(policy.ticket("low"))
    with pytest.raises(Unavailable, match=r"the low queue is full \(1 requests waiting\)"):
        policy.admit(policy.ticket("low"))
    policy.admit(policy.ticket("high"))  # other classes have their own room
    first.start()
    first.start()  # idempotent: a preempted sequence starts again
    first.end()
    second = policy.admit(policy.ticket("low"))
    second.end()  # ended before it started: leaves the queue, not admitted
    stats = policy.admission.drain()
    assert (stats["low"].queued, stats["low"].admitted, stats["low"].rejected) == (0, 1, {"queue_full": 1,
                                                                                         "timeout": 0})
    assert stats["high"].queued == 1
    # one wait and one latency: the request that started and ended; the one that never started counts in neither
    assert len(stats["low"].waits) == len(stats["low"].latencies) == 1
    assert 0 <= stats["low"].waits[0] <= stats["low"].latencies[0]
    assert policy.admission.drain()["low"].waits == []  # taken out by the drain


def test_a_bad_class_or_setting_is_named():
    with pytest.raises(InvalidInput, match="'qos_class' = 'urgent': expected one of"):
        POLICY.ticket("urgent")
    with pytest.raises(ParameterError, match="'qos_max_wait_s'.*missing low"):
        QosParams(qos_max_wait_s="high=1,normal=2")
    with pytest.raises(ParameterError, match="'qos_timeout_s'.*high must be a number > 0"):
        QosParams(qos_timeout_s="high=0,normal=2,low=3")
    with pytest.raises(ParameterError, match="'qos_weights'"):
        QosParams(qos_weights="image=0.4,audio=0.35,txt=0.25")
    assert QosParams.from_config({"qos_weights": "image=1,audio=0,text=0"}).qos_weights == "image=1,audio=0,text=0"


# --- the engine's queue ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return LLMEngine(tiny_checkpoint("llm", ROOT / ".checkpoints"),
                     EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8, max_batch=1,
                                  qos_timeout_s="high=30,normal=30,low=0.05"))


def run_to_end(engine: LLMEngine) -> list:
    started = []
    while engine.has_work:
        started += [s for s in engine.scheduler.running if s not in started]
        engine.step()
    return started


def test_the_engine_runs_the_high_class_first_and_the_lighter_request_first_within_a_class(engine):
    sampling = SamplingParams(max_tokens=2, min_tokens=2)
    qos = engine.qos
    busy = engine.add("warm up the batch slot", sampling, ticket=qos.ticket("normal"))
    engine.step()  # `busy` holds the one batch slot
    heavy = engine.add("a much longer prompt " * 20, sampling, ticket=qos.ticket("normal"))
    light = engine.add("short", sampling, ticket=qos.ticket("normal"))
    high = engine.add("a much longer prompt " * 20, sampling, ticket=qos.ticket("high"))
    assert heavy.ticket.score > light.ticket.score > 0
    assert run_to_end(engine) == [busy, high, light, heavy]
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_request_that_waits_past_its_timeout_without_starting_is_refused_and_frees_its_place(engine):
    qos, sampling = engine.qos, SamplingParams(max_tokens=4, min_tokens=4)
    busy = engine.add("hold the slot", sampling, ticket=qos.admit(qos.ticket("normal")))
    engine.step()
    late = engine.add("waits", sampling, ticket=qos.admit(qos.ticket("low")))
    time.sleep(0.06)
    finished = engine.step()
    assert late in finished and late.finished and isinstance(late.error, Unavailable)
    assert "in the low queue without starting (its timeout is 0.05 s)" in str(late.error)
    run_to_end(engine)
    assert busy.finish_reason == "length" and busy.ticket.started
    stats = qos.admission.drain()
    assert stats["low"].rejected["timeout"] == 1 and stats["low"].queued == 0 and stats["normal"].admitted >= 1
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_full_batch_preempts_a_lower_class_for_a_higher_one_and_the_preempted_text_is_unchanged(engine):
    qos, sampling = engine.qos, SamplingParams(max_tokens=12, min_tokens=12)
    alone = engine.generate(["the cat sat on the red car"], sampling)[0].text
    low = engine.add("the cat sat on the red car", sampling, ticket=qos.ticket("low"))
    for _ in range(4):
        engine.step()
    high = engine.add("urgent", SamplingParams(max_tokens=3, min_tokens=3), ticket=qos.ticket("high"))
    engine.step()
    assert engine.scheduler.running == [high] and low.preemptions == 1
    normal = engine.add("a normal one", SamplingParams(max_tokens=3, min_tokens=3), ticket=qos.ticket("normal"))
    run_to_end(engine)
    assert high.preemptions == 0 and normal.preemptions == 0  # a higher class is never preempted for a lower one
    assert low.text == alone and low.finish_reason == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_an_overdue_request_is_not_preempted_for_a_higher_class(engine):
    qos, sampling = engine.qos, SamplingParams(max_tokens=6, min_tokens=6)
    # normal: overdue after 5 s, refused if not started after 30 s
    normal = engine.add("waited long", sampling, ticket=qos.ticket("normal", arrival=time.monotonic() - 10))
    engine.step()
    high = engine.add("urgent", sampling, ticket=qos.ticket("high"))
    engine.step()
    assert engine.scheduler.running == [normal] and normal.preemptions == 0
    run_to_end(engine)
    assert high.finish_reason == "length"


def test_lower_class_prompts_start_in_their_share_of_time_and_token_cap_while_a_higher_class_runs():
    engine = LLMEngine(tiny_checkpoint("llm", ROOT / ".checkpoints"),
                       EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8, max_batch=4,
                                    qos_lower_share=0.01, qos_lower_tokens=8, qos_lower_step_ms=0))
    qos, scheduler = engine.qos, engine.scheduler
    tokens = engine.tokenizer.encode
    short = [tokens("a b c d e f g")[:6], tokens("h i j k l m n")[:6]]
    assert list(map(len, short)) == [6, 6]
    high = engine.add("urgent", SamplingParams(max_tokens=20, min_tokens=20), ticket=qos.ticket("high"))
    engine.step()
    lows = [engine.add(p, SamplingParams(max_tokens=2, min_tokens=2), ticket=qos.ticket("low")) for p in short]
    engine.step()  # the gate is open: one low prompt starts (6 tokens of the cap of 8; two would be 12)
    started = len(high.prompt_ids) + 6
    assert scheduler.running == [high, lows[0]] and engine.stats.prefill_tokens == started
    assert scheduler.lower.open_at > time.monotonic()  # that step's time, 99 times over
    for _ in range(3):
        engine.step()  # the high request decodes; the second low prompt waits for the share of time
        assert lows[1] in scheduler.waiting and engine.stats.prefill_tokens == started
    overdue = engine.add("waited", SamplingParams(max_tokens=2, min_tokens=2),
                         ticket=qos.ticket("low", arrival=time.monotonic() - 60))
    engine.step()  # past its aging bound: it starts at once
    assert overdue in scheduler.running and lows[1] in scheduler.waiting
    run_to_end(engine)
    assert lows[1].finish_reason == "length" and high.finish_reason == "length"
    assert engine.stats.prefill_seconds > 0 and engine.stats.decode_seconds > 0
    assert engine.stats.prefill_tokens == sum(len(s.prompt_ids) for s in (high, *lows, overdue))
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("step_ms", [1.0, 0.0])
def test_a_lower_class_step_takes_the_prompt_tokens_recent_prefill_steps_computed_in_its_time(step_ms):
    """`qos_lower_step_ms`: at 0.1 ms a prompt token (the prefill steps' moving mean), a 1 ms step takes 10 tokens:
    of two 6-token low prompts one starts, the other in a step of its own (a prompt longer than the cap starts alone);
    with no time cap (0) both start together."""
    engine = LLMEngine(tiny_checkpoint("llm", ROOT / ".checkpoints"),
                       EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8, max_batch=4, prompt_rows=0,
                                    qos_lower_share=1, qos_lower_tokens=None, qos_lower_step_ms=step_ms))
    qos, scheduler = engine.qos, engine.scheduler
    high = engine.add("urgent", SamplingParams(max_tokens=20, min_tokens=20), ticket=qos.ticket("high"))
    engine.step()
    assert scheduler.prefill_token_s > 0  # timed by that prefill step
    scheduler.prefill_token_s = 1e-4
    short = [engine.tokenizer.encode(text)[:6] for text in ("a b c d e f g", "h i j k l m n")]
    lows = [engine.add(p, SamplingParams(max_tokens=2, min_tokens=2), ticket=qos.ticket("low")) for p in short]
    engine.step()
    assert scheduler.running == ([high, lows[0]] if step_ms else [high, *lows])
    if step_ms:
        engine.step()  # the cap has followed this machine's real prefill steps, and the second prompt starts alone
        assert lows[1] in scheduler.running and engine.stats.prefill_tokens == len(high.prompt_ids) + 12
    scheduler.prefill_token_s = 1e-4
    scheduler.yielded(0.004, False, prefill_tokens=4)  # 1 ms a token: the moving mean moves a fifth of the way
    assert scheduler.prefill_token_s == pytest.approx(0.8e-4 + 0.2e-3)
    run_to_end(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_lower_class_steps_stay_capped_while_a_higher_class_was_added_lately():
    """No high-class request runs, but one was added within EXPECTED_S: its next one may arrive during the step, so
    low prompts start within the step cap (one 6-token prompt of the cap of 8, not both); once that is longer ago,
    together."""
    engine = LLMEngine(tiny_checkpoint("llm", ROOT / ".checkpoints"),
                       EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=8, max_batch=4, prompt_rows=0,
                                    qos_lower_share=1, qos_lower_tokens=8, qos_lower_step_ms=0))
    qos, scheduler = engine.qos, engine.scheduler
    high = engine.add("urgent", SamplingParams(max_tokens=2, min_tokens=2), ticket=qos.ticket("high"))
    run_to_end(engine)
    short = [engine.tokenizer.encode(text)[:6] for text in ("a b c d e f g", "h i j k l m n")]
    for lately in (True, False):
        if not lately:
            scheduler.added_at[high.ticket.rank] -= scheduler_module.EXPECTED_S
        lows = [engine.add(p, SamplingParams(max_tokens=2, min_tokens=2), ticket=qos.ticket("low")) for p in short]
        engine.step()
        assert scheduler.running == (lows[:1] if lately else lows)
        run_to_end(engine)
        assert all(low.finish_reason == "length" for low in lows)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_lower_class_prompts_ride_decode_steps_in_chunks_while_a_higher_class_runs():
    """No prefill step of their own: the high request gets a token every step while a long low prompt goes through
    in chunks of `prompt_rows` beside it, to the tokens it has alone; a same-class prompt of that length would take
    a prefill step (test_llm_engine)."""
    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    config = dict(dtype="fp32", device="cpu", kv_cache_memory_mb=8, max_batch=4, block_size=4)
    prompt = "the dog is on the grass and the person is in the tree with a blue car and a red car"
    sampling = SamplingParams(max_tokens=6, min_tokens=6)
    alone = LLMEngine(checkpoint, EngineConfig(**config)).generate([prompt], sampling)[0].output_ids
    engine = LLMEngine(checkpoint, EngineConfig(prompt_rows=8, qos_lower_rides=True, **config))
    high = engine.add("urgent", SamplingParams(max_tokens=20, min_tokens=20), ticket=engine.qos.ticket("high"))
    engine.step()
    low = engine.add(prompt, sampling, ticket=engine.qos.ticket("low"))
    chunks = -(-len(low.prompt_ids) // 8)
    assert chunks >= 3
    for step in range(1, chunks + 1):
        engine.step()
        assert len(high.output_ids) == 1 + step and engine.stats.prefill_steps == 1
        assert low.num_cached == min(8 * step, len(low.prompt_ids)) or low.output_ids
    assert len(low.output_ids) == 1
    run_to_end(engine)
    assert low.output_ids == alone and high.finish_reason == "length"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_the_pool_starts_queued_work_by_class_and_hands_back_results_errors_and_cancellations():
    pool = QosPool(1, "test-pool")
    gate, holding, started = threading.Event(), threading.Event(), []

    def hold() -> bool:  # takes the only thread while the rest queue
        holding.set()
        return gate.wait(5)

    busy = pool.submit(POLICY.ticket("low"), hold)
    assert holding.wait(5)
    queued = [pool.submit(POLICY.ticket(name), started.append, name) for name in ("low", "normal", "high")]
    failing = pool.submit(POLICY.ticket("low"), int, "not a number")
    gate.set()
    assert busy.result(timeout=5) is True
    for future in queued:
        future.result(timeout=5)
    assert started == ["high", "normal", "low"]
    assert isinstance(failing.exception(timeout=5), ValueError)
    gate.clear(), holding.clear()
    busy = pool.submit(POLICY.ticket("high"), hold)
    assert holding.wait(5)
    waiting = pool.submit(POLICY.ticket("high"), started.append, "never")
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert waiting.cancelled() and busy.result(timeout=5) is True and "never" not in started


def test_the_pool_runs_work_at_most_ahead_of_its_consumer_by_class():
    policy = QosPolicy(QosParams())
    pool = QosPool(2, "test-ahead", ahead=1)
    lows = [policy.admit(policy.ticket("low")) for _ in range(2)]
    ran = [pool.submit(ticket, str, "low") for ticket in lows]
    assert ran[0].result(timeout=5) == "low"
    time.sleep(0.2)
    assert not ran[1].done()  # one low ran and its request has not started: the second waits
    high = policy.admit(policy.ticket("high"))
    assert pool.submit(high, str, "high").result(timeout=5) == "high"  # lower classes never hold a higher one back
    lows[0].start()
    pool.kick()
    time.sleep(0.2)
    assert not ran[1].done()  # the high one ran ahead too and counts for every class below it
    high.end()
    pool.kick()
    assert ran[1].result(timeout=5) == "low"
    parked = pool.submit(policy.admit(policy.ticket("low")), str, "at shutdown")
    time.sleep(0.2)
    assert not parked.done()
    pool.shutdown()  # no task is left behind: each one answers its request
    assert parked.result(timeout=5) == "at shutdown"


def test_the_pools_lower_share_holds_lower_work_while_a_higher_request_is_in_flight():
    """`lower_share` 0.5: while a high request is in flight, low tasks run one at a time, each followed by as long a
    pause as it took (so starts at least 0.2 s apart for tasks of 0.1 s); an overdue one runs at once; once the high
    request ended, low tasks run side by side again."""
    pool = QosPool(2, "test-share", lower_share=0.5)
    spans: dict[str, list[float]] = {}

    def task(name: str, seconds: float) -> None:
        spans[name] = [time.monotonic()]
        time.sleep(seconds)
        spans[name].append(time.monotonic())

    try:
        high = POLICY.ticket("high")
        pool.submit(high, str, "high").result(timeout=5)  # its request is in flight until it ends
        held = [pool.submit(POLICY.ticket("low"), task, f"low{i}", 0.1) for i in range(3)]
        for future in held:
            future.result(timeout=5)
        starts = sorted(spans[f"low{i}"][0] for i in range(3))
        assert all(b - a >= 0.2 for a, b in zip(starts, starts[1:])), starts
        overdue = POLICY.ticket("low")
        overdue.arrival -= 100  # past its aging bound: ahead of every class, the share does not apply
        pool.submit(overdue, task, "overdue", 0.0).result(timeout=5)
        assert spans["overdue"][0] - spans["low2"][1] < 0.1  # the share was closed for another 0.1 s
        high.end()
        free = [pool.submit(POLICY.ticket("low"), task, f"free{i}", 0.3) for i in range(2)]
        for future in free:
            future.result(timeout=5)
        assert max(spans["free0"][0], spans["free1"][0]) < min(spans["free0"][1], spans["free1"][1])  # together
    finally:
        pool.shutdown()


def test_the_pools_threads_run_at_the_niceness_asked_and_others_keep_theirs():
    """Under our batcher the prepare threads yield the CPU (`prepare_nice`): the thread that admits requests must not
    wait behind image decoding (perf.overload), and only the pool's own threads are lowered."""
    import os

    def niceness() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    own = niceness()
    pool = QosPool(2, "test-nice", nice=5)
    try:
        assert pool.submit(POLICY.ticket("normal"), niceness).result(timeout=5) == min(19, own + 5)
    finally:
        pool.shutdown()
    assert niceness() == own
    plain = QosPool(1, "test-not-nice")
    try:
        assert plain.submit(POLICY.ticket("normal"), niceness).result(timeout=5) == own
    finally:
        plain.shutdown()
