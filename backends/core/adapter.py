"""The base of every backend's `TritonPythonModel`: what they share between Triton's python backend and the engines.

`TritonBackend.initialize` reads the model config through the backend's typed `Parameters` (a bad key or value
fails the load), picks the instance's device, routes the `backends` log records into Triton's log and calls
`setup()`. Every request gets its own error policy (`error`): InvalidInput -> INVALID_ARG with the reason, anything
else -> INTERNAL with a short message for the client and the traceback in the server log, for that request only.

`BatchedBackend` is the flow of the dynamically batched models (vit, clip_*, whisper): read each request on the
model thread, prepare its items on a thread pool, run all prepared requests through the engine at once; when that
shared call fails, each request is retried alone so that only the one that fails gets the error. Who forms the
batches is the `batch_window` parameter: Triton's dynamic batcher ("triton"), or our own (backends.core.batcher: QoS
order, adaptive or fixed window), which answers each request through its response sender once its batch ran. A
backend whose engine takes requests between steps (`stepper`) runs under our ContinuousBatcher instead. Under ours
the responses are made and sent on `response_threads` threads: a send waits for a round trip to the server, which
copies the outputs (SAM's masks: megabytes), and made on the batcher's thread those waits kept the engine idle.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

from backends.core.batcher import Batcher, BatchWindow, ContinuousBatcher, Job, Stepper, answer
from backends.core.errors import InjectedFault, InvalidInput, NotFound, Unavailable
from backends.core.heartbeat import Heartbeat
from backends.core.inputs import Inputs, check_request_parameters
from backends.core.metrics import CustomMetrics, QosMetrics
from backends.core.params import Parameters
from backends.core.qos import CLASSES, QOS_PARAMETER, REJECTIONS, QosPolicy, QosPool, read_qos_class

log = logging.getLogger(__name__)
P = TypeVar("P", bound=Parameters)

# Fault injection for tests: with this variable set to 1 in the server's environment, a request parameter
# `inject_fault` naming a stage ("read", "prepare", "infer"; "sample" in the LLM engine) makes that request raise an
# unexpected error there; "stall" hangs an LLM engine loop for a while (its heartbeat goes silent).
FAULTS_ENV = "MM_FAULT_INJECTION"
FAULT_PARAMETER = "inject_fault"
# our batcher's metrics (Triton's statistics count one execution per request when it batches)
BATCHER_GAUGES = {"batcher_window_seconds": "how long a batch that is not full waits for more requests now"}
BATCHER_COUNTERS = {"batcher_batches_total": "batches run by the model's own batcher",
                    "batcher_requests_total": "requests in those batches (÷ batches = mean batch size)",
                    "batcher_metrics_seconds_total": "time the batcher's thread spent updating metrics (a round trip "
                                                     "to the server each)",
                    "batcher_answers_total": "responses sent for the requests of the model's own batcher",
                    "batcher_answer_seconds_total": "time from a request's end in the engine to its response sent "
                                                    "(waiting for a responder, made, the send's round trip)"}


class TritonLogHandler(logging.Handler):
    """The `backends` package's log records into Triton's own log (pb_utils.Logger), beside the server's lines:
    the stub's Python logging has no handler of its own."""

    def __init__(self, pb):
        super().__init__(logging.INFO)
        self.pb = pb

    def emit(self, record: logging.LogRecord) -> None:
        logger = self.pb.Logger
        write = logger.log_error if record.levelno >= logging.ERROR else \
            logger.log_warn if record.levelno >= logging.WARNING else logger.log_info
        write(f"{record.name}: {self.format(record)}")


def route_logs_to_triton(pb) -> None:
    package = logging.getLogger("backends")
    if not any(isinstance(h, TritonLogHandler) for h in package.handlers):
        package.addHandler(TritonLogHandler(pb))
        package.setLevel(logging.INFO)


def instance_device(args: dict, configured: str) -> str:
    """The device of this model instance: the GPU Triton placed a KIND_GPU instance on, else the configured one."""
    return f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else configured


class TritonBackend(Generic[P]):
    """Subclasses set `Params` and implement `setup()` and `execute()`."""

    Params: type[P] = Parameters  # type: ignore[assignment]

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        route_logs_to_triton(pb_utils)
        self.model_config: dict = json.loads(args["model_config"])
        self.name: str = args["model_name"]
        # one series per stub process: a model reloaded in place registers its metrics while the old copy still
        # holds them, and Triton 2.51 frees a series two stubs share when the first deletes it (the server crashed
        # at the next update)
        self.labels = {"model": args["model_name"], "version": args["model_version"], "stub_pid": str(os.getpid())}
        self.folder = Path(args["model_repository"]) / args["model_version"]
        self.params: P = self.Params.from_model_config(self.model_config)
        self.device: str = instance_device(args, getattr(self.params, "device", "cpu"))
        self.faults_enabled = os.environ.get(FAULTS_ENV) == "1"
        self.setup()

    def setup(self) -> None:
        """Load the engine from `self.folder` with `self.params` on `self.device`."""

    # --- one request ----------------------------------------------------------------------------------------
    def inputs(self, request, on_device: bool = False) -> Inputs:
        """The request's inputs as numpy arrays; with `on_device` (a model whose config lets GPU tensors in), one on
        a GPU as a torch tensor there (DLPack, no copy)."""
        pb = self.pb

        def get(name: str):
            tensor = pb.get_input_tensor_by_name(request, name)
            if tensor is None:
                return None
            if on_device and not tensor.is_cpu():
                import torch

                return torch.from_dlpack(tensor.to_dlpack())
            return tensor.as_numpy()
        return Inputs(get, frozenset(request.requested_output_names()))

    def check_parameters(self, request, hint: str = "", allowed: tuple[str, ...] = ()) -> str | None:
        """Refuses request parameters this model would ignore; returns the fault stage a test asked for."""
        return check_request_parameters(request.parameters(), hint, FAULT_PARAMETER if self.faults_enabled else None,
                                        allowed)

    def error(self, exc: BaseException):
        """The per-request error policy: the client's mistake is named; anything else is logged here and reported
        without internals (no paths, no traceback)."""
        pb = self.pb
        for kind, code in ((NotFound, pb.TritonError.NOT_FOUND), (InvalidInput, pb.TritonError.INVALID_ARG),
                           (Unavailable, pb.TritonError.UNAVAILABLE)):  # the most specific first
            if isinstance(exc, kind):
                return pb.TritonError(str(exc), code)
        log.error("%s: request failed", self.name, exc_info=exc)
        return pb.TritonError(f"{self.name} failed on this request ({type(exc).__name__}); the server log has the "
                              "details", pb.TritonError.INTERNAL)

    def error_response(self, exc: BaseException):
        return self.pb.InferenceResponse(error=self.error(exc))


def inject(fault: str | None, stage: str) -> None:
    if fault == stage:
        raise InjectedFault(f"fault injected at {stage}")


class BatchedBackend(TritonBackend[P]):
    """Dynamically batched models. Subclasses implement `read` (model thread), `prepare` (one item, pool thread),
    `infer` (all prepared requests, one engine call) and `respond` (one request's output -> response); their
    parameters derive from backends.core.batcher.BatchingParams."""

    def setup(self) -> None:
        threads = getattr(self.params, "prepare_threads", 4)
        self.batcher: Batcher | None = None
        if self.params.batch_window == "triton":
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix=self.name)
            self.load()
        else:
            max_batch = self.batch_limit()
            # requests prepared in QoS order too, at most a batch (and a round of the pool) ahead of the engine
            self.pool = QosPool(threads, self.name, ahead=max_batch + threads, nice=self.params.prepare_nice)
            if "dynamic_batching" in self.model_config:
                log.warning("%s: batch_window %s with Triton's dynamic batcher too: requests wait in both",
                            self.name, self.params.batch_window)
            self.qos = QosPolicy(self.params)
            self.qos_metrics = QosMetrics(self.pb, self.labels, CLASSES, REJECTIONS)
            self.batch_metrics = CustomMetrics(self.pb, self.labels, BATCHER_GAUGES, BATCHER_COUNTERS)
            window = BatchWindow(self.params.batch_window, self.params.batch_window_max_ms / 1000)
            self.heartbeat = Heartbeat(self.name)  # the `health` model watches the batcher's loop through it
            threads = self.params.response_threads
            self.responder = ThreadPoolExecutor(threads, f"{self.name}-respond") if threads else None
            # answers waiting for a responder, at most two batches' worth: past that the batcher waits, so outputs
            # (SAM's: megabytes each) cannot pile up when sending is slower than the engine
            self.unsent = threading.Semaphore(2 * max_batch)
            self.answers, self.answer_seconds, self.answered = 0, 0.0, threading.Lock()
            common = dict(name=f"{self.name}-batcher", setup=self.load, after=self._update_metrics,
                          heartbeat=self.heartbeat)
            stepper = self.stepper()
            self.batcher = Batcher(self._run_jobs, max_batch, window, **common) if stepper is None else \
                ContinuousBatcher(stepper, window, **common)

    def load(self) -> None:
        """Load the engine (called by setup, after the pool exists; on our batcher's thread when it batches)."""

    def batch_limit(self) -> int:
        """Requests in one `infer` call under our batcher: the config's max_batch_size (at least one)."""
        return max(1, self.model_config.get("max_batch_size", 1))

    def stepper(self) -> Stepper | None:
        """Under our batcher: an engine that takes requests between its steps (jobs' `work`: the prepared items and
        the fault stage), or None (`infer` runs batches)."""
        return None

    def read(self, inputs: Inputs) -> list[Any]:
        """The items of one request to prepare (e.g. its encoded images); raise InvalidInput when it is wrong."""
        raise NotImplementedError

    def prepare(self, item: Any) -> Any:
        return item

    def sizes(self, prepared: list[Any]) -> dict[str, float]:
        """A request's sizes for its QoS cost score (QosPolicy.score's arguments), from its prepared items."""
        return {}

    def infer(self, batch: list[list[Any]]) -> list[Any]:
        """One output per request, from the prepared items of every request of the batch."""
        raise NotImplementedError

    def respond(self, output: Any):
        raise NotImplementedError

    def after_batch(self) -> None:
        """After a batch's responses (the model's own metrics)."""

    def execute(self, requests: list) -> list | None:
        if self.batcher is None:
            return self._execute_batch(requests)
        for request in requests:
            self._enqueue(request)
        return None  # each request is answered through its response sender

    # --- Triton batches -----------------------------------------------------------------------------------------
    def _execute_batch(self, requests: list) -> list:
        responses: list = [None] * len(requests)
        futures, faults = {}, {}
        for i, request in enumerate(requests):
            try:
                faults[i] = fault = self.check_parameters(request)
                items = self._read(request, fault)
                futures[i] = [self.pool.submit(self._prepare, item, fault) for item in items]
            except Exception as e:
                responses[i] = self.error_response(e)
        prepared = {}
        for i, pending in futures.items():
            try:
                prepared[i] = [f.result() for f in pending]
            except Exception as e:
                responses[i] = self.error_response(e)
        for i, output in self._infer_isolated(prepared, faults).items():
            responses[i] = self._response(output)
        self.after_batch()
        return responses

    def _read(self, request, fault: str | None) -> list[Any]:
        inject(fault, "read")
        items = self.read(self.inputs(request))
        if not items:
            raise InvalidInput("the request holds no item")
        return items

    def _response(self, output: Any):
        return self.error_response(output) if isinstance(output, Exception) else self.respond(output)

    # --- our batcher ------------------------------------------------------------------------------------------
    def _enqueue(self, request) -> None:
        """Read and admit one request (refused at once when wrong or when its class's queue is full), prepare it
        on the pool, then queue it in the batcher."""
        job = Job(None, None, functools.partial(self._answer, request.get_response_sender()))
        try:
            fault = self.check_parameters(request, allowed=(QOS_PARAMETER,))
            job.ticket = self.qos.ticket(read_qos_class(json.loads(request.parameters() or "{}")))
            items = self._read(request, fault)
            self.qos.admit(job.ticket)
        except Exception as e:
            answer(job, e)
            return
        self.pool.submit(job.ticket, self._prepare_job, job, items, fault)

    def _answer(self, sender, output: Any) -> None:
        """A job's answer: its response made and sent on a responder thread (on the caller's without any)."""
        if self.responder is None:
            self._send(sender, output, time.monotonic())
            return
        self.unsent.acquire()
        self.responder.submit(self._send, sender, output, time.monotonic()).add_done_callback(
            lambda _: self.unsent.release())

    def _send(self, sender, output: Any, ended: float) -> None:
        try:
            response = self._response(output)
        except Exception as e:  # making the response failed: the request still gets an answer
            response = self.error_response(e)
        try:
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # a client gone meanwhile: logged, nothing more
            log.exception("%s: sending a response failed", self.name)
        with self.answered:
            self.answers, self.answer_seconds = self.answers + 1, self.answer_seconds + time.monotonic() - ended

    def _prepare_job(self, job: Job, items: list[Any], fault: str | None) -> None:
        """On the pool: the request's items, its cost score, then its place in the batcher."""
        try:
            if self.batcher.closed:
                raise Unavailable("the model is being unloaded")
            job.work = ([self._prepare(item, fault) for item in items], fault)
            job.ticket.score = self.qos.score(**self.sizes(job.work[0]))
        except Exception as e:
            answer(job, e)
            return
        self.batcher.put(job)

    def _run_jobs(self, batch: list[Job]) -> list[Any]:
        """On the batcher thread: one engine call for the batch (failures isolated per request)."""
        self.pool.kick()  # the batch's requests have started: room for more ahead of the engine
        try:
            self._update_qos_metrics()  # clients see a request start (qos_admitted_total) before it ends
        except Exception:  # metrics never fail requests
            log.exception("%s: updating the QoS metrics failed", self.name)
        outputs = self._infer_isolated({i: job.work[0] for i, job in enumerate(batch)},
                                       {i: job.work[1] for i, job in enumerate(batch)})
        return [outputs[i] for i in range(len(batch))]

    def _update_qos_metrics(self) -> None:
        self.qos_metrics.update(self.qos.admission.drain())

    def _update_metrics(self) -> None:
        """On the batcher thread, after a batch's responses."""
        self._update_qos_metrics()
        self.batch_metrics.update({"batcher_window_seconds": self.batcher.window.current_s},
                                  {"batcher_batches_total": self.batcher.batches,
                                   "batcher_requests_total": self.batcher.requests,
                                   "batcher_metrics_seconds_total": self.batcher.after_seconds,
                                   "batcher_answers_total": self.answers,
                                   "batcher_answer_seconds_total": self.answer_seconds})
        self.after_batch()

    # --- both -------------------------------------------------------------------------------------------------
    def _prepare(self, item: Any, fault: str | None) -> Any:
        inject(fault, "prepare")
        return self.prepare(item)

    def _infer_isolated(self, prepared: dict[int, list], faults: dict[int, str | None]) -> dict[int, Any]:
        """Outputs by request index; when the shared engine call fails, each request runs alone, so the failure
        lands on the request that causes it."""
        if not prepared:
            return {}
        try:
            for i in prepared:
                inject(faults[i], "infer")
            return dict(zip(prepared, self.infer(list(prepared.values()))))
        except Exception as e:
            if len(prepared) == 1:
                return {i: e for i in prepared}
            log.warning("%s: a batch of %d requests failed (%s: %s); running them one by one", self.name,
                        len(prepared), type(e).__name__, e)
            return {i: out for key in prepared for i, out in self._infer_isolated({key: prepared[key]},
                                                                                   faults).items()}

    def finalize(self) -> None:
        if self.batcher is not None:
            self.batcher.close()  # waiting requests refused; those still preparing are refused by `_prepare_job`
            self.heartbeat.stop()
            self.pool.shutdown(wait=True)
            if self.responder is not None:
                self.responder.shutdown(wait=True)  # every answer sent before the model goes
            self.qos_metrics.close()
            self.batch_metrics.close()
        else:
            self.pool.shutdown(wait=False, cancel_futures=True)
