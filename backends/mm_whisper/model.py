"""`mm_whisper`: Triton backend for `whisper`, audio bytes (+ optional language, task, max_tokens) -> text and tokens.

Each request is checked on its own, its audio decoded and resampled on the thread pool and cut into overlapping 30 s
chunks when longer. With `batch_window` adaptive (the default) or fixed the engine batches continuously: requests
join the running decoder batch between steps in QoS order (audio seconds as the cost) as slots free up, each chunk in
a slot of its own, and a request is answered as soon as its last chunk is done. With "triton", Triton's dynamic
batcher hands `execute` several requests at once and their chunks run together to the end of the longest. Each
request's chunks are merged back into one transcript.

As a Triton ensemble (`build_engines whisper --ensemble`) it runs as two models of this backend, told apart by their
tensors: `whisper_audio` (CPU instances) decodes and resamples, `_audio` out; `whisper_decoder` (the engine) takes
`_audio`, 16 kHz mono float32 samples, with the options.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from backends.core.adapter import BatchedBackend, inject
from backends.core.batcher import Job
from backends.core.errors import InvalidInput
from backends.core.inputs import Inputs
from backends.core.metrics import CustomMetrics
from backends.core.qos import Ticket
from backends.media.audio import SAMPLE_RATE, decode_audio
from backends.whisper.chunking import merge, split
from backends.whisper.engine import PHASES, TASKS, Clip, WhisperEngine, WhisperParams


AUDIO = "_audio"  # the tensor between an ensemble's steps: 16 kHz mono float32 samples
# in the order of WhisperEngine.occupancy()
GAUGES = {"whisper_clips_running": "clips (30 s chunks) in the decoder's slots, joining ones too",
          "whisper_clips_joining": "clips in a slot whose encoder has not finished (they do not decode yet)",
          "whisper_clips_waiting": "clips waiting for a decoder slot"}
COUNTERS = {"whisper_decode_steps_total": "decoder steps",
            "whisper_decode_tokens_total": "tokens fed by decoder steps (÷ steps = mean decode batch)",
            "whisper_decode_rows_total": "rows computed by decoder steps (a CUDA graph's size holding the highest "
                                         "slot in use; the rows above the tokens fed are free slots below it)",
            "whisper_slot_moves_total": "clips moved from a high slot into a free one below, so that steps compute "
                                        "fewer rows",
            "whisper_encoded_clips_total": "clips through the encoder",
            "whisper_joins_total": "encoder passes (÷ into clips encoded = clips a join: one costs about twice "
                                   "its share in a batch)",
            "whisper_preemptions_total": "clips that gave up their slot to a higher QoS class (and start again)",
            "whisper_decode_seconds_total": "time in decoder steps: their launch and the wait for their choices",
            "whisper_join_seconds_total": "time the engine's loop spent starting joins (on a GPU their launch)",
            "whisper_clips_left_total": "clips that left their slot (done or failed)",
            **{f"whisper_clip_{phase}_seconds_total": f"those clips' time {what}, summed" for phase, what in zip(
                PHASES, ("queued in the engine for a slot", "in a slot while their join ran",
                         "decoding, from their join's end to their own"))}}


@dataclass
class Request:
    """One request: its audio (encoded, or samples from an ensemble's first step; then as 30 s chunks) and its
    decoding options."""

    audio: bytes | np.ndarray
    language: str | None  # None: detected
    task: str
    max_tokens: int | None
    chunks: list[np.ndarray] | None = None
    seconds: float = 0.0  # of decoded audio


class TritonPythonModel(BatchedBackend[WhisperParams]):
    Params = WhisperParams

    @cached_property
    def decodes_only(self) -> bool:
        """An ensemble's first step: decodes and resamples, no engine."""
        return AUDIO in {t["name"] for t in self.model_config["output"]}

    def setup(self) -> None:
        self.metrics = None if self.decodes_only else CustomMetrics(self.pb, self.labels, GAUGES, COUNTERS)
        super().setup()

    def load(self) -> None:
        self.takes_samples = AUDIO in {t["name"] for t in self.model_config["input"]}
        self.engine = None if self.decodes_only else WhisperEngine(
            self.folder, self.params.dtype, self.device, self.params.max_batch, self.params.encoder_batch,
            self.params.cuda_graphs, self.params.qos_lower_share, self.params.join_min,
            self.params.join_wait_ms / 1000, self.params.fused_encoder)

    def batch_limit(self) -> int:
        return super().batch_limit() if self.decodes_only else self.params.max_batch

    def stepper(self) -> WhisperSteps | None:
        return None if self.decodes_only else WhisperSteps(self)

    def read(self, inputs: Inputs) -> list[Request]:
        if self.decodes_only:
            return [Request(inputs.blob("audio", "encoded audio file"), None, "transcribe", None)]
        audio = self.samples(inputs) if self.takes_samples else inputs.blob("audio", "encoded audio file")
        language = inputs.text("language") or None  # "" or absent: detected
        self.engine.check_language(language)
        task = inputs.text("task", "transcribe")
        if task not in TASKS:
            raise InvalidInput(f"task must be one of {TASKS}, got {task!r}")
        max_tokens = inputs.scalar("max_tokens", int)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidInput(f"max_tokens must be at least 1, got {max_tokens}")
        return [Request(audio, language, task, max_tokens)]

    def samples(self, inputs: Inputs) -> np.ndarray:
        audio = inputs.array(AUDIO)
        if audio is None or audio.dtype != np.float32 or audio.ndim != 2 or audio.shape[0] != 1:
            raise InvalidInput(f"{AUDIO} must hold one clip of float32 samples at {SAMPLE_RATE} Hz, shape [1, samples]")
        audio = audio[0].copy()  # a copy: with our batcher it is used after `execute` returns
        if not 0 < len(audio) <= self.params.max_audio_seconds * SAMPLE_RATE:
            raise InvalidInput(f"{AUDIO} holds {len(audio) / SAMPLE_RATE:.1f} s of audio; this model takes up to "
                               f"{self.params.max_audio_seconds:g} s")
        if not np.isfinite(audio).all():
            raise InvalidInput(f"{AUDIO} contains NaN or infinite samples")
        return audio

    def prepare(self, job: Request) -> Request:
        audio = job.audio if isinstance(job.audio, np.ndarray) else decode_audio(job.audio, self.params.limits)
        job.audio, job.seconds = audio, len(audio) / SAMPLE_RATE
        if not self.decodes_only:
            job.chunks = split(audio)
        return job

    def sizes(self, prepared: list[Request]) -> dict[str, float]:
        return {"audio_s": sum(job.seconds for job in prepared)}

    def infer(self, batch: list[list[Request]]) -> list[list[int]] | list[np.ndarray]:
        if self.decodes_only:
            return [job.audio for (job,) in batch]
        clips = [clips_of(job) for (job,) in batch]
        flat = [clip for request in clips for clip in request]
        results = iter(self.engine.transcribe([c.audio for c in flat], [c.language for c in flat],
                                              [c.task for c in flat], [c.budget for c in flat]))
        return [merge([next(results).tokens for _ in request]) for request in clips]

    def after_batch(self) -> None:
        if self.metrics is not None:
            engine = self.engine
            self.metrics.update(dict(zip(GAUGES, engine.occupancy())),
                                {"whisper_decode_steps_total": engine.steps, "whisper_decode_tokens_total": engine.fed,
                                 "whisper_decode_rows_total": engine.computed, "whisper_slot_moves_total": engine.moves,
                                 "whisper_encoded_clips_total": engine.encoded, "whisper_joins_total": engine.joins,
                                 "whisper_preemptions_total": engine.preemptions,
                                 "whisper_decode_seconds_total": engine.step_seconds,
                                 "whisper_join_seconds_total": engine.join_seconds,
                                 "whisper_clips_left_total": engine.left,
                                 **{f"whisper_clip_{phase}_seconds_total": seconds
                                    for phase, seconds in engine.phase_seconds.items()}})

    def finalize(self) -> None:
        super().finalize()
        if self.metrics is not None:
            self.metrics.close()

    def respond(self, output: list[int] | np.ndarray):
        if self.decodes_only:
            return self.pb.InferenceResponse([self.pb.Tensor(AUDIO, output.reshape(1, -1))])
        tokens = output
        text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        return self.pb.InferenceResponse([  # [1, ...]: each request is a batch of one
            self.pb.Tensor("text", np.array([[text.encode()]], dtype=np.object_)),
            self.pb.Tensor("tokens", np.array([tokens], dtype=np.int32).reshape(1, -1))])


def clips_of(job: Request) -> list[Clip]:
    return [Clip(chunk, job.language, job.task, job.max_tokens) for chunk in job.chunks]


@dataclass(eq=False)
class Running:
    """A request in the continuous batch: its batcher job and its chunks' tokens as they finish."""

    job: Job
    tokens: list[list[int] | None]
    answered: bool = False


class WhisperSteps:
    """The engine as our ContinuousBatcher's Stepper: a request's chunks run as clips; it is answered when its last
    one is done (their tokens merged) or when one fails."""

    def __init__(self, backend: TritonPythonModel):
        self.backend = backend
        self.failed: list[tuple[Job, Exception]] = []  # refused at admission, answered at the next step
        self.held: list[Running] = []

    @property
    def engine(self) -> WhisperEngine:
        return self.backend.engine

    @property
    def busy(self) -> bool:
        return bool(self.failed) or self.engine.has_work

    def room(self, waiting: Ticket | None) -> int:
        engine, now = self.engine, time.monotonic()
        if not engine.admits(waiting, now):  # a lower class, its share of the time spent: it waits (so do the rest)
            return 0
        if engine.room <= 0 and waiting is not None and engine.preempt_for(waiting, now):
            return 1  # the slot a lower-class clip gave up, for `waiting`'s request
        return max(0, engine.room)

    def admit(self, jobs: list[Job]) -> None:
        self.backend.pool.kick()  # room for more ahead of the engine (the QoS metrics follow with the batcher's after)
        for job in jobs:
            (request,), fault = job.work
            try:
                inject(fault, "infer")
                running, clips = Running(job, [None] * len(request.chunks)), clips_of(request)
                for i, clip in enumerate(clips):
                    clip.owner, clip.ticket = (running, i), job.ticket
                self.engine.add(*clips)
            except Exception as e:
                self.failed.append((job, e))
                continue
            self.held.append(running)

    def step(self) -> list[tuple[Job, Any]]:
        finished, self.failed = self.failed, []
        for clip in self.engine.step():
            running, index = clip.owner
            if running.answered:  # an earlier chunk of its request failed
                continue
            if clip.error is None:
                running.tokens[index] = clip.tokens
            if clip.error is not None or all(t is not None for t in running.tokens):
                running.answered = True
                finished.append((running.job, clip.error or merge(running.tokens)))
        self.held = [r for r in self.held if not r.answered]
        return finished

    def abort(self) -> list[Job]:
        self.engine.clear()
        jobs = [job for job, _ in self.failed] + [r.job for r in self.held]
        self.failed, self.held = [], []
        return jobs
