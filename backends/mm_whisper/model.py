"""`mm_whisper`: Triton backend for `whisper`, audio bytes (+ optional language, task, max_tokens) -> text and tokens.

Triton's dynamic batcher hands `execute` several requests at once (or, with `batch_window` adaptive or fixed, our
batcher forms the batches: QoS order with audio seconds as the cost). Their audio is decoded and resampled on the
thread pool, each request checked on its own, clips longer than 30 s are cut into overlapping chunks, and the chunks
of every request go through the engine together (up to `max_batch` clips per engine call). Each request's chunks are
then merged back into one transcript.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.core.adapter import BatchedBackend
from backends.core.errors import InvalidInput
from backends.core.inputs import Inputs
from backends.media.audio import SAMPLE_RATE, decode_audio
from backends.whisper.chunking import merge, split
from backends.whisper.engine import TASKS, WhisperEngine, WhisperParams


@dataclass
class Job:
    """One request: its audio (encoded, then as 30 s chunks) and its decoding options."""

    audio: bytes
    language: str | None  # None: detected
    task: str
    max_tokens: int | None
    chunks: list[np.ndarray] | None = None
    seconds: float = 0.0  # of decoded audio


class TritonPythonModel(BatchedBackend[WhisperParams]):
    Params = WhisperParams

    def load(self) -> None:
        self.engine = WhisperEngine(self.folder, self.params.dtype, self.device)

    def read(self, inputs: Inputs) -> list[Job]:
        audio = inputs.blob("audio", "encoded audio file")
        language = inputs.text("language") or None  # "" or absent: detected
        self.engine.check_language(language)
        task = inputs.text("task", "transcribe")
        if task not in TASKS:
            raise InvalidInput(f"task must be one of {TASKS}, got {task!r}")
        max_tokens = inputs.scalar("max_tokens", int)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidInput(f"max_tokens must be at least 1, got {max_tokens}")
        return [Job(audio, language, task, max_tokens)]

    def prepare(self, job: Job) -> Job:
        audio = decode_audio(job.audio, self.params.limits)
        job.chunks, job.seconds = split(audio), len(audio) / SAMPLE_RATE
        return job

    def sizes(self, prepared: list[Job]) -> dict[str, float]:
        return {"audio_s": sum(job.seconds for job in prepared)}

    def infer(self, batch: list[list[Job]]) -> list[list[int]]:
        clips = [(job, chunk) for (job,) in batch for chunk in job.chunks]
        tokens: dict[int, list[list[int]]] = {id(job): [] for (job,) in batch}
        for start in range(0, len(clips), self.params.max_batch):
            part = clips[start:start + self.params.max_batch]
            results = self.engine.transcribe([chunk for _, chunk in part], [job.language for job, _ in part],
                                             [job.task for job, _ in part], [job.max_tokens for job, _ in part])
            for (job, _), result in zip(part, results):
                tokens[id(job)].append(result.tokens)
        return [merge(tokens[id(job)]) for (job,) in batch]

    def respond(self, tokens: list[int]):
        text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        return self.pb.InferenceResponse([  # [1, ...]: each request is a batch of one
            self.pb.Tensor("text", np.array([[text.encode()]], dtype=np.object_)),
            self.pb.Tensor("tokens", np.array([tokens], dtype=np.int32).reshape(1, -1))])
