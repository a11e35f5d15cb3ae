"""`mm_llm`: Triton backend for the decoupled `llm` model (and the base of `mm_vlm`): requests in, streamed
`text_output` deltas out.

`execute` only validates and queues; one background loop per model instance owns the engine: it admits queued
requests between steps, runs a step and hands each sequence's new text to an outbox thread, which sends it (merging
the deltas that queued up meanwhile), sets the metrics, and polls `is_cancelled()` so a cancelled gRPC stream frees
its KV blocks at once. A failure that belongs to one request (its inputs, its image, its
sampling) ends that request alone; only a failed model step fails the sequences in it. Engine statistics are
exported as custom metrics (llm_*).

LoRA (model parameter max_loras > 0): a request's `lora_id` names an adapter folder in the adapter root (read on its
first use) or "auto" (the root's router picks two); `execute` resolves it, so an unknown or unloadable adapter fails
that request at once. A request with `lora_action` instead of a prompt controls the adapters: "load" (also lifts an
unload), "list", or "unload", answered once no request uses the adapter any more. The answer is JSON in
`text_output`. Each model instance holds its own adapters: with more than one instance, control requests reach one.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from backends.core.adapter import TritonBackend, inject
from backends.core.batcher import start_thread
from backends.core.errors import InvalidInput
from backends.core.heartbeat import Heartbeat
from backends.core.inputs import Inputs
from backends.core.metrics import CustomMetrics, QosMetrics, RequestHistograms
from backends.core.outbox import Outbox
from backends.core.qos import CLASSES, QOS_PARAMETER, REJECTIONS, Ticket, admit_in_order, read_qos_class
from backends.core.spans import SpanLog
from backends.llm.detokenizer import pending_text
from backends.llm.engine import EngineConfig, LLMEngine, StepFailed
from backends.llm.adapters import LoraAdapter
from backends.llm.requests import (OPTIONS_HINT, AdapterAction, GenerationRequest, read_adapter_action,
                                   read_generation_request)
from backends.llm.sequence import Sequence

log = logging.getLogger(__name__)
HOUSEKEEPING_S = 0.01  # how often cancellation is polled and metrics are updated
# how long the loop hangs for a request with inject_fault "stall": well over the health check's heartbeat timeout,
# for its tests
STALL_S = 4.0

GAUGES = {"llm_kv_blocks_free": "KV-cache blocks free", "llm_kv_blocks_total": "KV-cache blocks in all",
          "llm_sequences_running": "sequences in the running batch",
          "llm_sequences_waiting": "sequences waiting for a batch slot or KV blocks",
          "llm_decode_batch_max": "largest decode batch so far"}
COUNTERS = {"llm_prefill_steps_total": "prefill steps", "llm_decode_steps_total": "decode steps",
            "llm_prefill_tokens_total": "prompt tokens computed (short ones riding decode steps too)",
            "llm_prefill_seconds_total": "time in prefill steps",
            "llm_decode_seconds_total": "time in decode steps (short prompts riding them too)",
            "llm_decode_tokens_total": "tokens produced by decode steps (sum of decode batch sizes)",
            "llm_generated_tokens_total": "tokens generated", "llm_preemptions_total": "sequences preempted",
            "llm_prefix_cache_hit_tokens_total": "prompt tokens whose KV came from the prefix cache",
            "llm_spec_verify_total": "sequence-steps that verified speculative proposals",
            "llm_spec_proposed_tokens_total": "tokens proposed by speculative decoding",
            "llm_spec_accepted_tokens_total": "proposed tokens the model accepted (mean accepted length per step: "
                                              "accepted / verify)"}
LORA_GAUGES = {"llm_lora_adapters_loaded": "LoRA adapters in the host cache",
               "llm_lora_adapters_on_device": "LoRA adapters in device slots"}
LORA_COUNTERS = {"llm_lora_loads_total": "LoRA adapters read from the adapter root",
                 "llm_lora_load_seconds_total": "time spent reading and checking LoRA adapters",
                 "llm_lora_evictions_total": "LoRA adapters evicted from the host cache",
                 "llm_lora_slot_loads_total": "LoRA adapters copied into a device slot",
                 "llm_lora_slot_evictions_total": "idle LoRA adapters whose device slot another one took"}


@dataclass
class Pending:
    """A request `execute` accepted, waiting for the engine loop (and, for `vlm`, for its image)."""

    request: object
    sender: object
    ask: GenerationRequest
    ticket: Ticket
    fault: str | None = None
    prepared: Future | None = None  # work started in `execute` that must finish before the request is admitted
    prompt_ids: list[int] | None = None  # its prompt tokenized in `execute` (llm), not on the engine loop
    lora: tuple[tuple[LoraAdapter, float], ...] = ()  # its adapters and their shares


@dataclass
class Unloading:
    """An unload answered once no request uses the adapter."""

    adapter: LoraAdapter
    sender: object


@dataclass
class EngineInput:
    """`LLMEngine.add`'s arguments for one request."""

    prompt: str | list[int]
    embeds: torch.Tensor | None = None  # image features for the placeholder tokens (vlm)
    placeholder_id: int | None = None
    embeds_key: bytes | None = None  # names the image in prefix-cache keys (a digest of its file)


@dataclass
class Stream:
    request: object
    sender: object
    stream: bool
    arrival: float  # monotonic, when `execute` took the request
    first: float | None = None  # when its first token was out of the engine
    last: float = 0.0  # when its latest was
    spans: dict[str, int] | None = None  # monotonic ns by backends.core.spans.EVENTS, when the server traces


def engine_stats(engine: LLMEngine) -> tuple[dict[str, float], dict[str, int]]:
    s = engine.stats
    gauges = {"llm_kv_blocks_free": engine.blocks.num_free, "llm_kv_blocks_total": engine.blocks.num_blocks,
              "llm_sequences_running": len(engine.scheduler.running),
              "llm_sequences_waiting": len(engine.scheduler.waiting), "llm_decode_batch_max": s.max_decode_batch}
    totals = {"llm_prefill_steps_total": s.prefill_steps, "llm_decode_steps_total": s.decode_steps,
              "llm_prefill_tokens_total": s.prefill_tokens, "llm_prefill_seconds_total": s.prefill_seconds,
              "llm_decode_seconds_total": s.decode_seconds,
              "llm_decode_tokens_total": s.decode_tokens, "llm_generated_tokens_total": s.generated_tokens,
              "llm_preemptions_total": engine.scheduler.preemptions,
              "llm_prefix_cache_hit_tokens_total": engine.blocks.hit_tokens, "llm_spec_verify_total": s.speculated,
              "llm_spec_proposed_tokens_total": s.proposed_tokens, "llm_spec_accepted_tokens_total": s.accepted_tokens}
    if (adapters := engine.adapters) is not None:
        gauges.update(llm_lora_adapters_loaded=len(adapters.host), llm_lora_adapters_on_device=adapters.on_device)
        a = adapters.stats
        totals.update(llm_lora_loads_total=a.loads, llm_lora_load_seconds_total=a.load_seconds,
                      llm_lora_evictions_total=a.evictions, llm_lora_slot_loads_total=a.slot_loads,
                      llm_lora_slot_evictions_total=a.slot_evictions)
    return gauges, totals


class TritonPythonModel(TritonBackend[EngineConfig]):
    Params = EngineConfig

    def setup(self) -> None:
        # the engine is built on the loop thread that steps it: torch's CPU kernels ran about 2x slower on a second
        # thread once the main thread had used them (see backends.core.batcher.Batcher); the loop starts once
        # `setup` has made the queues, metrics and outbox it uses
        self.started = threading.Event()
        self.heartbeat = Heartbeat(self.name)  # the `health` model watches the loop through it
        self.thread = start_thread(self.load, self._loop, f"{self.name}-engine")
        self.inbox: queue.Queue[Pending] = queue.Queue()
        self.pending: list[Pending] = []  # taken from the inbox, preparation still running
        self.active: dict[Sequence, Stream] = {}
        self.wake = threading.Event()
        self.running = True
        self.unloading: queue.Queue[Unloading] = queue.Queue()  # from `execute` to the loop
        self.waiting_unloads: list[Unloading] = []
        lora = self.engine.adapters is not None
        self.metrics = CustomMetrics(self.pb, self.labels, {**GAUGES, **(LORA_GAUGES if lora else {})},
                                     {**COUNTERS, **(LORA_COUNTERS if lora else {})})
        self.metrics.update(*engine_stats(self.engine))
        self.qos_metrics = QosMetrics(self.pb, self.labels, CLASSES, REJECTIONS)
        self.request_metrics = RequestHistograms(self.pb, self.labels)
        self.spans = SpanLog(self.name)
        self.step_start_ns = 0
        self.finished_timings: collections.deque[tuple[float, float | None, int]] = collections.deque()
        self.outbox = Outbox(self._text, self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, self._update_metrics,
                             poll_s=HOUSEKEEPING_S, name=f"{self.name}-outbox", threads=self.params.response_threads)
        self.started.set()

    def load(self) -> None:
        """Build the engine (and what else runs on the loop: the VLM's vision tower); on the loop thread."""
        self.engine = LLMEngine(self.folder, dataclasses.replace(self.params, device=self.device))


    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            pending = None
            try:
                fault = self.check_parameters(request, hint=OPTIONS_HINT, allowed=(QOS_PARAMETER,))
                inject(fault, "read")
                inputs = self.inputs(request)
                if (action := read_adapter_action(inputs)) is not None:
                    self._control(action, sender)
                    continue
                ticket = self.engine.qos.ticket(read_qos_class(json.loads(request.parameters() or "{}")))
                pending = Pending(request, sender, read_generation_request(inputs, self.engine.max_model_len,
                                                                           self.engine.max_prompt_bytes), ticket, fault)
                if pending.ask.lora_id:  # read from the root here if need be, not on the engine loop
                    pending.lora = self.engine.choose_adapters(pending.ask.lora_id, pending.ask.prompt)
                self.engine.qos.admit(ticket)  # the class's queue is full: refused now (UNAVAILABLE)
                pending.prepared = self.prepare(inputs, pending)
            except Exception as e:
                if pending is not None:
                    pending.ticket.end()
                self._fail(sender, e)
                continue
            self.inbox.put(pending)
        self.wake.set()
        return None

    def _control(self, action: AdapterAction, sender) -> None:
        adapters = self.engine.adapters
        if adapters is None:
            raise InvalidInput("this model serves no LoRA adapters (its max_loras is 0)")
        if action.action == "unload":
            adapter = adapters.unload(action.name)
            if adapter is not None:  # answered by the loop once no request uses it
                self.unloading.put(Unloading(adapter, sender))
                self.wake.set()
                return
            answer = {"unloaded": action.name}
        elif action.action == "load":
            adapter = adapters.load(action.name)
            answer = {"loaded": adapter.name, "rank": adapter.rank}
        else:
            answer = adapters.listing()
        sender.send(self._text(json.dumps(answer)), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def prepare(self, inputs: Inputs, pending: Pending) -> Future | None:
        """Per-request work started in `execute` (the VLM's image decoding): a Future keeps the request out of the
        engine until it is done, without holding up `execute`; it must set `self.wake` when done. Here: the prompt
        is tokenized (the tokenizer releases the GIL; on the engine loop a long prompt held up every stream)."""
        pending.prompt_ids = self.engine.tokenizer(pending.ask.prompt)["input_ids"]
        return None

    def engine_inputs(self, batch: list[Pending]) -> list[EngineInput | Exception]:
        """`engine.add` arguments (or the reason the request fails) for requests admitted together (the VLM runs the
        vision tower over the images of all of them here)."""
        for pending in batch:
            inject(pending.fault, "infer")
            if pending.fault == "stall":  # a hung engine loop, for the health check's tests
                time.sleep(STALL_S)
        return [EngineInput(pending.prompt_ids) for pending in batch]  # tokenized by `prepare`

    def finalize(self) -> None:
        self.running = False
        self.wake.set()
        self.thread.join(timeout=10)  # never hang the unload: the loop is a daemon thread
        self.outbox.close()  # what the loop queued goes out first; from here on responses are sent directly
        unloading = self.pb.TritonError("the model is being unloaded", self.pb.TritonError.UNAVAILABLE)
        for seq, stream in list(self.active.items()):
            self.engine.cancel(seq)
            self._send_error(stream.sender, unloading)
        self.active.clear()
        self._take_inbox()
        for pending in self.pending:
            pending.ticket.end()
            self._send_error(pending.sender, unloading)
        self.pending.clear()
        for unload in self._unloads():  # every request that used them has just ended
            self._send_unloaded(unload)
        self.metrics.close()
        self.qos_metrics.close()
        self.request_metrics.close()
        self.spans.close()
        self.heartbeat.stop()

    # --- the engine loop ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        self.started.wait()  # `setup` has made the queues, metrics and outbox
        last_housekeeping = 0.0
        while self.running:
            self.heartbeat.beat()
            self._admit()
            if time.monotonic() - last_housekeeping > HOUSEKEEPING_S or not self.engine.has_work:
                self._drop_cancelled()
                self._answer_unloads()
                self.outbox.metrics(*engine_stats(self.engine))
                last_housekeeping = time.monotonic()
            if not self.engine.has_work:
                self.wake.wait(timeout=0.05)
                self.wake.clear()
                continue
            try:
                self.step_start_ns = time.monotonic_ns()
                with self.heartbeat.step():
                    advanced = self.engine.step()
            except StepFailed as e:  # the model step itself failed: its sequences fail, the server keeps serving
                log.exception("LLM engine step failed")
                for seq in e.seqs:
                    self.engine.cancel(seq)
                    if (stream := self.active.pop(seq, None)) is not None:
                        self.outbox.send(stream.sender, self.error_response(e.__cause__ or e))
                continue
            for seq in advanced:
                self._respond(seq)

    def _take_inbox(self) -> None:
        while True:
            try:
                self.pending.append(self.inbox.get_nowait())
            except queue.Empty:
                return

    def admit_ahead(self) -> tuple[int | None, list[Ticket]]:
        """How many requests of a class or higher may wait in the engine's queue (None: no limit), and the tickets
        of those waiting there now; see mm_vlm."""
        return None, []

    def _admit(self) -> None:
        self._take_inbox()
        ready, waiting = [], []
        for pending in self.pending:  # one pass: a future finishing meanwhile must land in exactly one list
            (waiting if pending.prepared is not None and not pending.prepared.done() else ready).append(pending)
        now = time.monotonic()
        ready, held, expired = admit_in_order(ready, lambda p: p.ticket, now, *self.admit_ahead())
        self.pending = waiting + held
        for pending in expired:  # as the engine refuses those in its own queue
            error = pending.ticket.time_out(now)
            pending.ticket.end()
            self.outbox.send(pending.sender, self.error_response(error))
        for pending, item in zip(ready, self._engine_inputs_isolated(ready)):
            try:
                if isinstance(item, Exception):
                    raise item
                seq = self.engine.add(item.prompt, pending.ask.sampling, pending.request.request_id(), pending.ticket,
                                      embeds=item.embeds, placeholder_id=item.placeholder_id,
                                      embeds_key=item.embeds_key, fault=pending.fault, lora=pending.lora)
            except Exception as e:
                pending.ticket.end()
                self.outbox.send(pending.sender, self.error_response(e))
                continue
            stream = Stream(pending.request, pending.sender, pending.ask.stream, pending.ticket.arrival)
            if self.spans.enabled:
                stream.spans = {"queued": int(stream.arrival * 1e9), "admitted": time.monotonic_ns()}
            self.active[seq] = stream
            self.outbox.watch(pending.sender, pending.request, seq)

    def _engine_inputs_isolated(self, batch: list[Pending]) -> list[EngineInput | Exception]:
        """When preparing a group together fails, each request is prepared alone, so only the culprit fails."""
        if not batch:
            return []
        try:
            return self.engine_inputs(batch)
        except Exception as e:
            if len(batch) == 1:
                return [e]
            log.warning("preparing %d requests together failed (%s); preparing them one by one", len(batch), e)
            return [item for pending in batch for item in self._engine_inputs_isolated([pending])]

    def _unloads(self) -> list[Unloading]:
        """Unloads waiting for their adapter's last request (taken from `execute`'s queue)."""
        while True:
            try:
                self.waiting_unloads.append(self.unloading.get_nowait())
            except queue.Empty:
                return self.waiting_unloads

    def _answer_unloads(self) -> None:
        self._take_inbox()  # requests `execute` accepted with the adapter before its unload count as its users
        for unload in list(self._unloads()):
            accepted = any(unload.adapter is a for p in self.pending for a, _ in p.lora)  # not in the engine yet
            if unload.adapter.users == 0 and not accepted:
                self.waiting_unloads.remove(unload)
                self._send_unloaded(unload)

    def _send_unloaded(self, unload: Unloading) -> None:
        # after the responses already queued: the adapter's last stream's tokens may sit on another outbox thread
        self.outbox.send_after_queued(unload.sender, self._text(json.dumps({"unloaded": unload.adapter.name})))

    def _drop_cancelled(self) -> None:
        for seq in self.outbox.cancelled():
            if (stream := self.active.pop(seq, None)) is not None:  # not finished meanwhile
                self.engine.cancel(seq)
                self.outbox.send(stream.sender)

    def _respond(self, seq: Sequence) -> None:
        stream = self.active.get(seq)
        if stream is None:
            return
        if seq.error is not None:
            self.outbox.send(stream.sender, self.error_response(seq.error))
        elif stream.stream:
            delta = pending_text(seq)
            if seq.finished or delta:  # always a final response, possibly empty: clients see where the stream ends
                self.outbox.text(stream.sender, delta, final=seq.finished,
                                 finish_reason=seq.finish_reason if seq.finished else None)
        elif seq.finished:
            self.outbox.text(stream.sender, seq.text, final=True, finish_reason=seq.finish_reason)
        if seq.output_ids:
            stream.last = time.monotonic()
            if stream.first is None:
                stream.first = stream.last
                if stream.spans is not None:  # its prompt was (the last part of) this step's prefill
                    stream.spans |= {"prefill_start": self.step_start_ns, "first_token": int(stream.first * 1e9)}
        if seq.finished:
            del self.active[seq]
            if stream.spans is not None:
                self.spans.write(stream.request.request_id(), stream.spans | {"finished": time.monotonic_ns()},
                                 output_tokens=len(seq.output_ids),
                                 error=None if seq.error is None else str(seq.error))
            if seq.error is None and stream.first is not None:  # observed on the outbox thread (a round trip each)
                tokens = len(seq.output_ids)
                self.finished_timings.append((stream.first - stream.arrival,
                                              (stream.last - stream.first) / (tokens - 1) if tokens > 1 else None,
                                              tokens))

    def _update_metrics(self, gauges: dict, totals: dict) -> None:
        """On the outbox thread."""
        self.metrics.update(gauges, totals)
        while self.finished_timings:
            self.request_metrics.observe(*self.finished_timings.popleft())
        self.qos_metrics.update(self.engine.qos.admission.drain())

    def _text(self, text: str, finish_reason: str | None = None):
        outputs = [self.pb.Tensor("text_output", np.array([text.encode()], dtype=np.object_))]
        if finish_reason is not None:  # the final response: the stream ended here on purpose
            outputs.append(self.pb.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=np.object_)))
        return self.pb.InferenceResponse(outputs)

    def _fail(self, sender, exc: BaseException) -> None:
        """Fail a request from `execute` (the loop's failures go through the outbox)."""
        self._send_error(sender, self.error(exc))

    def _send_error(self, sender, error) -> None:
        sender.send(self.pb.InferenceResponse(error=error), flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
