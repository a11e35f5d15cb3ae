"""backends/core/outbox.py: responses leave in each stream's order, deltas that queue up merge, finals end the
polling of cancellation, a failing send does not stop the outbox, nothing queued is lost at close, and an answer sent
after what is queued follows every thread's earlier responses."""
import threading
import time

from backends.core.outbox import POLL_SHARE, Outbox, _Message, merge_deltas

FINAL = 1


class Sender:
    """Records what the outbox sent; `delay_s` makes each send as slow as a round trip to the server."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False):
        self.sent, self.delay_s, self.fail = [], delay_s, fail
        self.threads = set()

    def send(self, response=None, flags=0):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("stream closed")
        self.sent.append((response, flags))


class Request:
    def __init__(self):
        self.cancelled, self.polls = False, 0

    def is_cancelled(self):
        self.polls += 1
        return self.cancelled


class SlowRequest(Request):
    """Each ask 2 ms: an IPC round trip under load."""

    def is_cancelled(self):
        time.sleep(0.002)
        return super().is_cancelled()


def outbox(**kwargs) -> Outbox:
    return Outbox(lambda text, finish_reason: ("text", text) + ((finish_reason,) if finish_reason else ()), FINAL, lambda gauges, totals: None, poll_s=0.001, **kwargs)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_deltas_merge_per_stream_and_other_responses_keep_their_place():
    a, b = Sender(), Sender()
    messages = [_Message(a, "he"), _Message(b, "x"), _Message(a, "llo"), _Message(a, None, "error", True),
                _Message(b, "y", final=True, finish_reason="stop")]
    merged = merge_deltas(messages)
    assert [(m.sender, m.text, m.response, m.final, m.finish_reason) for m in merged] == [
        (a, "hello", None, False, None), (b, "xy", None, True, "stop"), (a, None, "error", True, None)]


def test_a_slow_server_gets_fewer_larger_responses_in_order_and_the_final_last():
    sender, box = Sender(delay_s=0.05), outbox()
    box.text(sender, ">")
    wait_for(lambda: sender.threads)  # the first send is on its way
    for i in range(40):
        box.text(sender, str(i % 10))
    box.text(sender, "!", final=True, finish_reason="length")
    box.close()
    assert sender.sent == [(("text", ">"), 0), (("text", "0123456789" * 4 + "!", "length"), FINAL)]
    assert sender.threads == {"outbox"}


def test_cancellation_is_reported_once_and_finished_streams_are_no_longer_polled():
    box = outbox()
    live, done = (Sender(), Request()), (Sender(), Request())
    box.watch(live[0], live[1], "live")
    box.watch(done[0], done[1], "done")
    box.text(done[0], "bye", final=True)
    wait_for(lambda: done[0].sent and live[1].polls > 2)
    polls_after_final = done[1].polls
    live[1].cancelled = True
    wait_for(lambda: box.cancelled() == ["live"])
    time.sleep(0.02)
    assert box.cancelled() == []
    assert done[1].polls == polls_after_final <= 1
    box.close()


def test_a_round_of_cancellation_polls_gives_way_to_responses():
    """100 watched requests, each ask 2 ms (an IPC round trip under load): a round takes 0.2 s, yet a response
    queued during it leaves at once; the round then goes on, and a cancellation in it is still reported."""
    box, requests = outbox(), [SlowRequest() for _ in range(100)]
    for i, request in enumerate(requests):
        box.watch(Sender(), request, i)
    wait_for(lambda: sum(r.polls for r in requests) >= 10)  # a round is under way
    sender, start = Sender(), time.monotonic()
    box.text(sender, "first token")
    wait_for(lambda: sender.sent)
    assert time.monotonic() - start < 0.05 and sum(r.polls for r in requests) < 90
    requests[0].cancelled = True
    wait_for(lambda: box.cancelled() == [0])
    box.close()


def test_slow_rounds_of_polls_are_spaced_to_their_share_of_the_thread():
    """20 watched requests, each ask 2 ms: back to back, rounds of 40 ms would ask about 500 times in a second; spaced
    to POLL_SHARE of the time they ask about a quarter of that, and a cancellation is still reported."""
    box, requests = outbox(), [SlowRequest() for _ in range(20)]
    for i, request in enumerate(requests):
        box.watch(Sender(), request, i)
    wait_for(lambda: requests[0].polls >= 1)
    time.sleep(1.0)
    asks = sum(r.polls for r in requests)
    assert 60 <= asks <= 60 + 500 * POLL_SHARE, asks  # (at least 3 rounds: at most ~0.2 s apart)
    requests[7].cancelled = True
    wait_for(lambda: box.cancelled() == [7])
    box.close()


def test_a_failing_send_does_not_stop_the_outbox_and_after_close_sends_are_direct():
    broken, fine = Sender(fail=True), Sender()
    box = outbox()
    box.send(broken, "error")
    box.text(fine, "ok", final=True)
    box.close()
    assert fine.sent == [(("text", "ok"), FINAL)]
    box.send(fine)
    assert fine.sent[-1] == (None, FINAL)
    assert fine.threads == {"outbox", threading.current_thread().name}


def test_metrics_are_set_on_the_outbox_thread_with_the_latest_values():
    seen = []
    box = Outbox(lambda text, finish_reason: text, FINAL, lambda gauges, totals: seen.append((gauges, threading.current_thread().name)),
                 poll_s=0.001)
    box.metrics({"g": 1}, {})
    box.metrics({"g": 2}, {})
    wait_for(lambda: seen)
    box.close()
    assert seen[-1] == ({"g": 2}, "outbox")


def test_with_several_threads_each_stream_keeps_its_order_and_cancellations_come_from_all():
    box = outbox(threads=3)
    streams = [(Sender(delay_s=0.0005), Request()) for _ in range(12)]
    for i, (sender, request) in enumerate(streams):
        box.watch(sender, request, i)
    for step in range(20):
        for sender, _ in streams[:6]:
            box.text(sender, f"{step},", final=step == 19)
    for _, request in streams[6:]:
        request.cancelled = True
    seen = []
    wait_for(lambda: seen.extend(box.cancelled()) or sorted(seen) == list(range(6, 12)))
    box.close()
    for sender, _ in streams[:6]:
        assert "".join(r[1] for r, _ in sender.sent) == "".join(f"{step}," for step in range(20))
        assert [flags for _, flags in sender.sent][-1] == FINAL and len(sender.threads) == 1
    assert len({t for sender, _ in streams for t in sender.threads}) == 3


def test_an_answer_sent_after_queued_follows_every_thread_s_earlier_responses():
    box, order = outbox(threads=2), []

    class Ordered(Sender):
        def __init__(self, name: str, delay_s: float = 0.0):
            super().__init__(delay_s)
            self.name = name

        def send(self, response=None, flags=0):
            super().send(response, flags)
            order.append((self.name, response))
    slow, other, unload = Ordered("slow", delay_s=0.02), Ordered("other"), Ordered("unload")
    box.text(slow, "a")  # new streams take the threads in turn: slow's the first, other's the second, the one-off
    box.text(other, "b")  # answer to other2 the first, so a plain send of unload's answer would take the second,
    box.send(Ordered("other2"), "x")  # idle while slow's sends still queue on the first
    for word in "cdef":
        box.text(slow, word)
    box.text(slow, "", final=True)
    box.send_after_queued(unload, "unloaded")
    wait_for(lambda: len(unload.sent) == 1 and bool(slow.sent) and slow.sent[-1][1] == FINAL)
    assert order[-1] == ("unload", "unloaded") and unload.sent == [("unloaded", FINAL)]
    box.close()
