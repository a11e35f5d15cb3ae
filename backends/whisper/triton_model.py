"""Triton adapter for `whisper`: audio bytes (+ optional language, task, max_tokens) -> text and tokens.

Triton's dynamic batcher hands `execute` several requests at once; their audio is decoded and resampled in
parallel, each request is checked on its own (a bad one gets INVALID_ARG, the others still run), clips longer
than 30 s are cut into overlapping chunks, and the chunks of every request go through the engine as one batch
(up to `max_batch` clips per engine call). Each request's chunks are then merged back into one transcript.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends.audio import AudioLimits, decode_audio
from backends.errors import InvalidInput
from backends.triton_model import instance_device, model_parameters, optional_input, route_logs_to_triton
from backends.whisper.chunking import merge, split
from backends.whisper.engine import TASKS, WhisperEngine


class WhisperTritonModel:
    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        route_logs_to_triton(pb_utils)
        params = model_parameters(json.loads(args["model_config"]))
        device = instance_device(args, params.get("device", "auto"))
        self.engine = WhisperEngine(Path(args["model_repository"]) / args["model_version"],
                                    params.get("dtype", "fp32"), device)
        self.limits = AudioLimits(float(params.get("max_audio_seconds") or AudioLimits.max_seconds),
                                  int(params.get("max_channels") or AudioLimits.max_channels),
                                  int(params.get("max_sample_rate") or AudioLimits.max_sample_rate))
        self.max_batch = int(params.get("max_batch") or 32)
        self.pool = ThreadPoolExecutor(int(params.get("prepare_threads") or 4))

    def read(self, request) -> tuple[bytes, str | None, str, int | None]:
        """(audio bytes, language, task, max_tokens) of one request, or InvalidInput; on the model's thread (the
        python backend's request API is not for worker threads)."""
        audio = optional_input(self.pb, request, "audio")
        if audio is None or audio.size != 1:
            raise InvalidInput("audio must hold exactly one encoded audio file")
        language, task, max_tokens = (optional_input(self.pb, request, name) for name in ("language", "task",
                                                                                          "max_tokens"))
        language = (language.reshape(-1)[0].decode() if language is not None else "") or None  # "": detect
        self.engine.check_language(language)
        task = task.reshape(-1)[0].decode() if task is not None else "transcribe"
        if task not in TASKS:
            raise InvalidInput(f"task must be one of {TASKS}, got {task!r}")
        limit = None
        if max_tokens is not None:
            limit = int(max_tokens.reshape(-1)[0])
            if limit < 1:
                raise InvalidInput(f"max_tokens must be at least 1, got {limit}")
        return bytes(audio.reshape(-1)[0]), language, task, limit

    def chunks(self, data: bytes) -> list[np.ndarray]:
        return split(decode_audio(data, self.limits))

    def execute(self, requests: list) -> list:
        pb = self.pb
        responses: list = [None] * len(requests)
        decoding = {}
        for i, request in enumerate(requests):
            try:
                data, *options = self.read(request)
                decoding[i] = (self.pool.submit(self.chunks, data), *options)
            except InvalidInput as e:
                responses[i] = pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG))
        jobs = []  # (request index, chunks, language, task, max_tokens)
        for i, (future, *options) in decoding.items():
            try:
                jobs.append((i, future.result(), *options))
            except InvalidInput as e:
                responses[i] = pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG))
        clips = [(job, chunk) for job in jobs for chunk in job[1]]
        tokens: dict[int, list[list[int]]] = {job[0]: [] for job in jobs}
        try:
            for start in range(0, len(clips), self.max_batch):
                part = clips[start:start + self.max_batch]
                results = self.engine.transcribe([chunk for _, chunk in part], [job[2] for job, _ in part],
                                                 [job[3] for job, _ in part], [job[4] for job, _ in part])
                for (job, _), result in zip(part, results):
                    tokens[job[0]].append(result.tokens)
        except Exception as e:  # engine failure: report it on each request, keep the model alive
            error = pb.TritonError(f"transcription failed: {type(e).__name__}: {e}", pb.TritonError.INTERNAL)
            for job in jobs:
                responses[job[0]] = pb.InferenceResponse(error=error)
            return responses
        for job in jobs:
            merged = merge(tokens[job[0]])
            text = self.engine.tokenizer.decode(merged, skip_special_tokens=True)
            responses[job[0]] = pb.InferenceResponse([  # [1, ...]: each request is a batch of one
                pb.Tensor("text", np.array([[text.encode()]], dtype=np.object_)),
                pb.Tensor("tokens", np.array([merged], dtype=np.int32).reshape(1, -1))])
        return responses

    def finalize(self) -> None:
        self.pool.shutdown()
