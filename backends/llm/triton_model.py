"""Triton adapter for the `llm` model (decoupled): requests in, streamed `text_output` deltas out.

`execute` only validates and queues; one background loop per model instance owns the engine: it admits queued
requests between steps, runs a step, sends each sequence's new text, and checks `request.is_cancelled()` so a
cancelled gRPC stream frees its KV blocks at once. Engine statistics are exported as custom metrics (llm_*).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backends.errors import InvalidInput
from backends.generation import GenerationRequest, check_request_parameters, read_generation_request
from backends.llm.detokenizer import pending_text
from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.sequence import Sequence
from backends.triton_model import instance_device, model_parameters, optional_input, route_logs_to_triton

log = logging.getLogger(__name__)
HOUSEKEEPING_S = 0.01  # is_cancelled() and metric updates are IPC round trips: do them at most this often


@dataclass
class _Stream:
    request: object
    sender: object
    stream: bool


class LLMTritonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        route_logs_to_triton(pb_utils)
        self.params = model_parameters(json.loads(args["model_config"]))
        engine_config = EngineConfig.from_params(self.params)
        engine_config = dataclasses.replace(engine_config, device=instance_device(args, engine_config.device))
        self.engine = LLMEngine(Path(args["model_repository"]) / args["model_version"], engine_config)
        self.inbox: queue.Queue[tuple[object, object, GenerationRequest, object]] = queue.Queue()
        self.pending: list[tuple[object, object, GenerationRequest, object]] = []  # queued, preparation running
        self.active: dict[Sequence, _Stream] = {}
        self.wake = threading.Event()
        self.running = True
        self.metrics = EngineMetrics(pb_utils, {"model": args["model_name"], "version": args["model_version"]})
        self.metrics.update(self.engine)
        self.thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self.thread.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                check_request_parameters(request.parameters())
                ask = read_generation_request(lambda name: optional_input(self.pb, request, name),
                                              self.engine.max_model_len)
                prepared = self.prepare(request, ask)
            except InvalidInput as e:
                self._fail(sender, e, self.pb.TritonError.INVALID_ARG)
                continue
            self.inbox.put((request, sender, ask, prepared))
        self.wake.set()
        return None

    def prepare(self, request, ask: GenerationRequest) -> object:
        """Per-request checks and work started in `execute`. A Future (the VLM's image decoding) keeps the request
        out of the engine until it is done, without holding up `execute`; it must set `self.wake` when done."""
        return None

    def engine_inputs(self, batch: list[tuple[GenerationRequest, object]]) -> list[dict | InvalidInput]:
        """`engine.add` arguments (or the reason it is refused) for each request admitted together (the VLM runs
        the vision tower over the images of all of them here)."""
        return [{"prompt": ask.prompt} for ask, _ in batch]

    def finalize(self) -> None:
        self.running = False
        self.wake.set()
        self.thread.join(timeout=10)  # never hang the unload: the loop is a daemon thread
        unloading = RuntimeError("the model is being unloaded")
        for seq, stream in list(self.active.items()):
            self.engine.cancel(seq)
            self._fail(stream.sender, unloading, self.pb.TritonError.UNAVAILABLE)
        self.active.clear()
        self._take_inbox()
        for _, sender, _, _ in self.pending:
            self._fail(sender, unloading, self.pb.TritonError.UNAVAILABLE)
        self.pending.clear()
        self.metrics.close()

    # --- the engine loop ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        last_housekeeping = 0.0
        while self.running:
            self._admit()
            if time.monotonic() - last_housekeeping > HOUSEKEEPING_S or not self.engine.has_work:
                self._drop_cancelled()
                self.metrics.update(self.engine)
                last_housekeeping = time.monotonic()
            if not self.engine.has_work:
                self.wake.wait(timeout=0.05)
                self.wake.clear()
                continue
            try:
                advanced = self.engine.step()
            except Exception as e:  # a failed step fails its requests, never the server
                log.exception("LLM engine step failed")
                for seq, stream in list(self.active.items()):
                    self.engine.cancel(seq)
                    self._fail(stream.sender, RuntimeError(f"engine step failed: {e}"), self.pb.TritonError.INTERNAL)
                self.active.clear()
                continue
            for seq in advanced:
                self._respond(seq)

    def _take_inbox(self) -> None:
        while True:
            try:
                self.pending.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def _admit(self) -> None:
        self._take_inbox()
        ready, waiting = [], []
        for item in self.pending:  # one pass: a future finishing meanwhile must land in exactly one list
            (waiting if isinstance(item[3], Future) and not item[3].done() else ready).append(item)
        self.pending = waiting
        if not ready:
            return
        try:
            inputs = self.engine_inputs([(ask, prepared) for _, _, ask, prepared in ready])
        except Exception as e:  # e.g. the vision tower failed: these requests fail, the server keeps serving
            log.exception("preparing engine inputs failed")
            inputs = [RuntimeError(f"preparing the request failed: {e}")] * len(ready)
        for (request, sender, ask, _), item in zip(ready, inputs):
            try:
                if isinstance(item, Exception):
                    raise item
                seq = self.engine.add(sampling=ask.sampling, request_id=request.request_id(), **item)
            except InvalidInput as e:
                self._fail(sender, e, self.pb.TritonError.INVALID_ARG)
                continue
            except Exception as e:
                self._fail(sender, e, self.pb.TritonError.INTERNAL)
                continue
            self.active[seq] = _Stream(request, sender, ask.stream)

    def _drop_cancelled(self) -> None:
        for seq, stream in list(self.active.items()):
            if stream.request.is_cancelled():
                self.engine.cancel(seq)
                del self.active[seq]
                stream.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _respond(self, seq: Sequence) -> None:
        stream = self.active.get(seq)
        if stream is None:
            return
        if stream.stream:
            delta = pending_text(seq)
            if seq.finished:  # always a final response, possibly empty: clients see where the stream ends
                stream.sender.send(self._text(delta), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            elif delta:
                stream.sender.send(self._text(delta))
        elif seq.finished:
            stream.sender.send(self._text(seq.text), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if seq.finished:
            del self.active[seq]

    def _text(self, text: str):
        return self.pb.InferenceResponse([self.pb.Tensor("text_output", np.array([text.encode()], dtype=np.object_))])

    def _fail(self, sender, error: Exception, code) -> None:
        response = self.pb.InferenceResponse(error=self.pb.TritonError(str(error), code))
        sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class EngineMetrics:
    """The engine's statistics as Triton custom metrics (served on the metrics port with Triton's own)."""

    GAUGES = {"llm_kv_blocks_free": "KV-cache blocks free", "llm_kv_blocks_total": "KV-cache blocks in all",
              "llm_sequences_running": "sequences in the running batch",
              "llm_sequences_waiting": "sequences waiting for a batch slot or KV blocks",
              "llm_decode_batch_max": "largest decode batch so far"}
    COUNTERS = {"llm_prefill_steps_total": "prefill steps", "llm_decode_steps_total": "decode steps",
                "llm_decode_tokens_total": "tokens produced by decode steps (sum of decode batch sizes)",
                "llm_generated_tokens_total": "tokens generated", "llm_preemptions_total": "sequences preempted"}

    def __init__(self, pb, labels: dict[str, str]):
        # a family must outlive its metrics: keep both
        self.families = {name: pb.MetricFamily(name, doc, pb.MetricFamily.GAUGE) for name, doc in self.GAUGES.items()}
        self.families.update({name: pb.MetricFamily(name, doc, pb.MetricFamily.COUNTER)
                              for name, doc in self.COUNTERS.items()})
        self.gauges = {name: self.families[name].Metric(labels) for name in self.GAUGES}
        self.counters = {name: self.families[name].Metric(labels) for name in self.COUNTERS}
        self.counted = dict.fromkeys(self.COUNTERS, 0)

    def close(self) -> None:
        """Metrics before their families, as the python backend requires."""
        self.gauges.clear()
        self.counters.clear()
        self.families.clear()

    def update(self, engine: LLMEngine) -> None:
        s = engine.stats
        values = {"llm_kv_blocks_free": engine.blocks.num_free, "llm_kv_blocks_total": engine.blocks.num_blocks,
                  "llm_sequences_running": len(engine.scheduler.running),
                  "llm_sequences_waiting": len(engine.scheduler.waiting), "llm_decode_batch_max": s.max_decode_batch}
        for name, value in values.items():
            self.gauges[name].set(value)
        totals = {"llm_prefill_steps_total": s.prefill_steps, "llm_decode_steps_total": s.decode_steps,
                  "llm_decode_tokens_total": s.decode_tokens, "llm_generated_tokens_total": s.generated_tokens,
                  "llm_preemptions_total": engine.scheduler.preemptions}
        for name, total in totals.items():
            if total > self.counted[name]:
                self.counters[name].increment(total - self.counted[name])
                self.counted[name] = total
