"""`token_stream`: a decoupled model that streams tokens on a fixed clock, the known truth for the LLM benchmark.

It answers like `llm` (same inputs, `text_output` deltas) but produces exactly `max_tokens` one-character tokens: the
first `first_token_ms` after the request arrives, then one every `token_interval_ms`. A benchmark that reports
anything else for it is measuring itself. All requests share one timer thread, so the clock holds at any concurrency.
"""
from __future__ import annotations

import heapq
import itertools
import string
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backends.core.adapter import TritonBackend
from backends.core.params import Parameters, bounded
from backends.llm.requests import GENERATION_INPUTS, OPTIONS_HINT, read_generation_request

ALPHABET = string.ascii_lowercase  # one byte-level token each


@dataclass(order=True)
class _Stream:
    due: float
    order: int
    request: object = field(compare=False)
    sender: object = field(compare=False)
    remaining: int = field(compare=False)
    stream: bool = field(compare=False)
    text: list[str] = field(compare=False, default_factory=list)


@dataclass(frozen=True)
class TokenStreamParams(Parameters):
    first_token_ms: float = bounded(20.0, 0)
    token_interval_ms: float = bounded(5.0, 0)


class TokenStreamModel(TritonBackend[TokenStreamParams]):
    Params = TokenStreamParams

    def setup(self) -> None:
        self.first_token_s = self.params.first_token_ms / 1e3
        self.interval_s = self.params.token_interval_ms / 1e3
        self.heap: list[_Stream] = []
        self.order = itertools.count()
        self.wake = threading.Condition()
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def execute(self, requests: list) -> None:
        now = time.monotonic()
        for request in requests:
            sender = request.get_response_sender()
            try:
                self.check_parameters(request, hint=OPTIONS_HINT)
                ask = read_generation_request(self.inputs(request), max_tokens_limit=1_000_000)
            except Exception as e:
                sender.send(self.error_response(e), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            with self.wake:
                heapq.heappush(self.heap, _Stream(now + self.first_token_s, next(self.order), request, sender,
                                                  ask.sampling.max_tokens, ask.stream))
                self.wake.notify()
        return None

    def _loop(self) -> None:
        while True:
            with self.wake:
                while self.running and (not self.heap or self.heap[0].due > time.monotonic()):
                    self.wake.wait(timeout=self.heap[0].due - time.monotonic() if self.heap else None)
                if not self.running:
                    return
                item = heapq.heappop(self.heap)
            self._emit(item)

    def _emit(self, item: _Stream) -> None:
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if item.request.is_cancelled():
            item.sender.send(flags=final)
            return
        item.text.append(ALPHABET[len(item.text) % len(ALPHABET)])
        item.remaining -= 1
        last = item.remaining == 0
        if item.stream or last:
            text = item.text[-1] if item.stream else "".join(item.text)
            output = self.pb.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
            item.sender.send(self.pb.InferenceResponse([output]), flags=final if last else 0)
        if not last:
            item.due += self.interval_s
            with self.wake:
                heapq.heappush(self.heap, item)

    def finalize(self) -> None:
        with self.wake:
            self.running = False
            for item in self.heap:
                item.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.wake.notify()
        self.thread.join()


MODEL_PY = '"""Calibration model for the LLM benchmark: perf.token_stream."""\n' \
           "from perf.token_stream import TokenStreamModel as TritonPythonModel  # noqa: F401\n"


def write_token_stream_model(repository: Path, first_token_ms: float = 20, token_interval_ms: float = 5) -> Path:
    """A repository folder holding `token_stream` (its config names this venv as the stub's environment)."""
    from build_engines.repository import PythonModelConfig, Tensor, execution_env, write_model

    config = PythonModelConfig(
        "token_stream", "python", [Tensor(n, d, dims, optional=o) for n, d, dims, o in GENERATION_INPUTS],
        [Tensor("text_output", "BYTES", [1])], TokenStreamParams(first_token_ms, token_interval_ms),
        execution_env("auto", repository / "token_stream"), max_batch_size=0, max_queue_delay_us=None,
        decoupled=True)
    folder = write_model(repository, config)
    (folder / "1" / "model.py").write_text(MODEL_PY)
    return folder
