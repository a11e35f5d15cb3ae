"""`mm_whisper`: Triton backend for `whisper`, audio bytes (+ optional language, task, max_tokens) -> text and tokens.

Triton's dynamic batcher hands `execute` several requests at once (or, with `batch_window` adaptive or fixed, our
batcher forms the batches: QoS order with audio seconds as the cost). Their audio is decoded and resampled on the
thread pool, each request checked on its own, clips longer than 30 s are cut into overlapping chunks, and the chunks
of every request go through the engine together (up to `max_batch` clips per engine call). Each request's chunks are
then merged back into one transcript.

As a Triton ensemble (`build_engines whisper --ensemble`) it runs as two models of this backend, told apart by their
tensors: `whisper_audio` (CPU instances) decodes and resamples, `_audio` out; `whisper_decoder` (the engine) takes
`_audio`, 16 kHz mono float32 samples, with the options.
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


AUDIO = "_audio"  # the tensor between an ensemble's steps: 16 kHz mono float32 samples


@dataclass
class Job:
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

    def load(self) -> None:
        self.decodes_only = AUDIO in {t["name"] for t in self.model_config["output"]}
        self.takes_samples = AUDIO in {t["name"] for t in self.model_config["input"]}
        self.engine = None if self.decodes_only else WhisperEngine(self.folder, self.params.dtype, self.device)

    def read(self, inputs: Inputs) -> list[Job]:
        if self.decodes_only:
            return [Job(inputs.blob("audio", "encoded audio file"), None, "transcribe", None)]
        audio = self.samples(inputs) if self.takes_samples else inputs.blob("audio", "encoded audio file")
        language = inputs.text("language") or None  # "" or absent: detected
        self.engine.check_language(language)
        task = inputs.text("task", "transcribe")
        if task not in TASKS:
            raise InvalidInput(f"task must be one of {TASKS}, got {task!r}")
        max_tokens = inputs.scalar("max_tokens", int)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidInput(f"max_tokens must be at least 1, got {max_tokens}")
        return [Job(audio, language, task, max_tokens)]

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

    def prepare(self, job: Job) -> Job:
        audio = job.audio if isinstance(job.audio, np.ndarray) else decode_audio(job.audio, self.params.limits)
        job.audio, job.seconds = audio, len(audio) / SAMPLE_RATE
        if not self.decodes_only:
            job.chunks = split(audio)
        return job

    def sizes(self, prepared: list[Job]) -> dict[str, float]:
        return {"audio_s": sum(job.seconds for job in prepared)}

    def infer(self, batch: list[list[Job]]) -> list[list[int]] | list[np.ndarray]:
        if self.decodes_only:
            return [job.audio for (job,) in batch]
        clips = [(job, chunk) for (job,) in batch for chunk in job.chunks]
        tokens: dict[int, list[list[int]]] = {id(job): [] for (job,) in batch}
        for start in range(0, len(clips), self.params.max_batch):
            part = clips[start:start + self.params.max_batch]
            results = self.engine.transcribe([chunk for _, chunk in part], [job.language for job, _ in part],
                                             [job.task for job, _ in part], [job.max_tokens for job, _ in part])
            for (job, _), result in zip(part, results):
                tokens[id(job)].append(result.tokens)
        return [merge(tokens[id(job)]) for (job,) in batch]

    def respond(self, output: list[int] | np.ndarray):
        if self.decodes_only:
            return self.pb.InferenceResponse([self.pb.Tensor(AUDIO, output.reshape(1, -1))])
        tokens = output
        text = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        return self.pb.InferenceResponse([  # [1, ...]: each request is a batch of one
            self.pb.Tensor("text", np.array([[text.encode()]], dtype=np.object_)),
            self.pb.Tensor("tokens", np.array([tokens], dtype=np.int32).reshape(1, -1))])
