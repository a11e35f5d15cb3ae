"""Thin adapter between Triton's python backend and the pure encoders: requests in, responses out.

Every request of an `execute` call is validated on its own (a bad one gets INVALID_ARG, the others still run), then
all good requests go through the engine as one batch: that is where Triton's dynamic batching pays off.
"""
from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from backends.encoders import prepare_requests
from backends.errors import InvalidInput

log = logging.getLogger(__name__)


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


def model_parameters(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def optional_input(pb, request, name: str) -> np.ndarray | None:
    """A request's input as numpy, or None when the request left it out."""
    tensor = pb.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def bytes_items(array: np.ndarray) -> list[bytes]:
    """A BYTES tensor of any shape -> flat list of bytes objects."""
    return [item if isinstance(item, bytes) else bytes(item) for item in array.reshape(-1)]


class BatchedTritonModel:
    """Python-backend model whose requests are prepared in parallel, each validated on its own, and inferred together.

    `encoder_factory(version_dir, params)` builds an object with prepare_item(bytes) and infer(list[list[item]]);
    params are the model config's parameters (`prepare_threads` sizes the preprocessing pool).
    """

    def __init__(self, encoder_factory: Callable[[Path, dict[str, str]], Any]):
        self.encoder_factory = encoder_factory

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        route_logs_to_triton(pb_utils)
        config = json.loads(args["model_config"])
        self.params = model_parameters(config)
        self.input_name = config["input"][0]["name"]
        self.output_name = config["output"][0]["name"]
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.encoder = self.encoder_factory(version_dir, self.params)
        self.pool = ThreadPoolExecutor(int(self.params.get("prepare_threads", 4)))

    def execute(self, requests: list) -> list:
        pb = self.pb
        responses: list = [None] * len(requests)
        items = [bytes_items(pb.get_input_tensor_by_name(r, self.input_name).as_numpy()) for r in requests]
        prepared: list[tuple[int, Any]] = []
        for i, result in enumerate(prepare_requests(self.encoder, self.pool, items)):
            if isinstance(result, InvalidInput):
                responses[i] = pb.InferenceResponse(error=pb.TritonError(str(result), pb.TritonError.INVALID_ARG))
            else:
                prepared.append((i, result))
        if prepared:
            try:
                outputs = self.encoder.infer([p for _, p in prepared])
            except Exception as exc:  # engine failure: report it on each request, keep the model alive
                log.exception("inference failed")
                error = pb.TritonError(f"inference failed: {type(exc).__name__}: {exc}", pb.TritonError.INTERNAL)
                outputs = [error] * len(prepared)
            for (i, _), output in zip(prepared, outputs):
                if isinstance(output, np.ndarray):
                    responses[i] = pb.InferenceResponse([pb.Tensor(self.output_name, output.astype(np.float32))])
                else:
                    responses[i] = pb.InferenceResponse(error=output)
        return responses

    def finalize(self) -> None:
        self.pool.shutdown()
        self.encoder = None
