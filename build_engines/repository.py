"""Writes model folders: config.pbtxt rendered from Triton's own ModelConfig protobuf (unknown keys are errors) with
the backend's typed parameters, warm-up data, and the engine metadata the runtime layer reads."""
from __future__ import annotations

import io
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from backends.core.params import Parameters, parse_mapping
from backends.core.qos import CLASSES, DEFAULT_CLASS, QosParams

TYPES = {"BYTES": mc.TYPE_STRING, "FP32": mc.TYPE_FP32, "INT32": mc.TYPE_INT32, "INT64": mc.TYPE_INT64,
         "BOOL": mc.TYPE_BOOL, "UINT8": mc.TYPE_UINT8}


@dataclass
class Tensor:
    name: str
    dtype: str
    dims: list[int]
    label_filename: str | None = None  # enables Triton's classification extension on this output
    optional: bool = False  # an input a request may leave out
    ragged: bool = False  # an input whose length differs between requests of one dynamic batch


@dataclass
class PythonModelConfig:
    """A model served by one of our Python-based backends (backends/<backend>/model.py); `render()` gives the
    config.pbtxt text."""

    name: str
    backend: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    parameters: Parameters
    execution_env: str | None = None  # EXECUTION_ENV_PATH: the venv the python stub runs in
    max_batch_size: int = 64
    max_queue_delay_us: int | None = 2000  # None: no dynamic batcher
    instances: int = 1
    kind: str = "KIND_CPU"
    warmup_file: str | None = None  # a file under <model>/warmup/ holding one serialized BYTES element
    decoupled: bool = False  # streaming: any number of responses per request (gRPC streaming and HTTP SSE)
    priority_levels: bool = False  # the QoS classes as the dynamic batcher's priority levels (costs latency: README)
    # the dynamic batcher's queue: one more request is refused at once (UNAVAILABLE), so overload cannot grow it
    # without bound. None: unbounded (Triton's default): in Triton 2.51 a queue policy leaves the batcher asleep up
    # to 500 ms when a request arrives with no instance idle, or is refused (README, "Bounded queues")
    max_queue_size: int | None = None
    gpu_inputs: bool = False  # inputs reach the model where they are (GPU tensors from an ensemble step stay there)

    def render(self) -> str:
        config = mc.ModelConfig(name=self.name, backend=self.backend, max_batch_size=self.max_batch_size)
        add_tensors(config, self.inputs, self.outputs)
        # a model batched by our own batcher (backends.core.batcher) takes requests as they come
        if self.max_queue_delay_us is not None and getattr(self.parameters, "batch_window", "triton") == "triton":
            config.dynamic_batching.max_queue_delay_microseconds = self.max_queue_delay_us
            if self.priority_levels:
                priority_queues(config.dynamic_batching)
            elif self.max_queue_size:
                config.dynamic_batching.default_queue_policy.max_queue_size = self.max_queue_size
        if self.decoupled:
            config.model_transaction_policy.decoupled = True
        config.instance_group.add(count=self.instances, kind=getattr(mc.ModelInstanceGroup, self.kind))
        parameters = self.parameters.to_config()
        if self.execution_env:
            parameters["EXECUTION_ENV_PATH"] = self.execution_env
        if self.gpu_inputs:
            parameters["FORCE_CPU_ONLY_INPUT_TENSORS"] = "no"
        for key, value in sorted(parameters.items()):
            config.parameters[key].string_value = value
        if self.warmup_file:
            warmup = config.model_warmup.add(name=f"{self.inputs[0].name}_sample", batch_size=1)
            entry = warmup.inputs[self.inputs[0].name]
            entry.data_type = TYPES[self.inputs[0].dtype]
            entry.dims.extend(self.inputs[0].dims)
            entry.input_data_file = self.warmup_file
        return text_format.MessageToString(config)


@dataclass
class EnsembleConfig:
    """A Triton ensemble: `steps` run in order, each (model, {its input: ensemble tensor}, {its output: ensemble
    tensor}); clients call it by `name` with the same tensors as a single model."""

    name: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    steps: list[tuple[str, dict[str, str], dict[str, str]]]
    max_batch_size: int = 64

    def render(self) -> str:
        config = mc.ModelConfig(name=self.name, platform="ensemble", max_batch_size=self.max_batch_size)
        add_tensors(config, self.inputs, self.outputs)
        for model, inputs, outputs in self.steps:
            step = config.ensemble_scheduling.step.add(model_name=model, model_version=-1)
            step.input_map.update(inputs)
            step.output_map.update(outputs)
        return text_format.MessageToString(config)


def add_tensors(config: mc.ModelConfig, inputs: list[Tensor], outputs: list[Tensor]) -> None:
    for spec, tensors in ((config.input, inputs), (config.output, outputs)):
        for t in tensors:
            added = spec.add(name=t.name, data_type=TYPES[t.dtype], dims=t.dims)
            if t.label_filename:
                added.label_filename = t.label_filename
            if t.optional:
                added.optional = True
            if t.ragged and spec is config.input:
                added.allow_ragged_batch = True


def priority_queues(batching, params: QosParams = QosParams()) -> None:
    """The QoS classes in Triton's dynamic batcher: request priority 1, 2, 3 = high, normal, low (default normal),
    each level with its class's queue limit and timeout; a request over either is rejected (UNAVAILABLE)."""
    limits, timeouts = parse_mapping(params.qos_max_queued, CLASSES), parse_mapping(params.qos_timeout_s, CLASSES)
    batching.priority_levels = len(CLASSES)
    batching.default_priority_level = CLASSES.index(DEFAULT_CLASS) + 1
    for level, name in enumerate(CLASSES, 1):
        policy = batching.priority_queue_policy[level]
        policy.max_queue_size = int(limits[name])
        policy.default_timeout_microseconds = int(timeouts[name] * 1e6)
        policy.timeout_action = mc.ModelQueuePolicy.REJECT
        policy.allow_timeout_override = True


def serialize_bytes_tensor(items: list[bytes]) -> bytes:
    """Triton's raw layout for BYTES: each element as a 4-byte little-endian length + its bytes."""
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def sample_png(size: tuple[int, int] = (320, 240)) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def execution_env(choice: str, model_folder: Path) -> str | None:
    """EXECUTION_ENV_PATH for the python stub (it ignores PYTHONPATH and venvs, so point it at ours). `auto`: this
    venv, relative to the model folder through the python backend's $$TRITON_MODEL_DIRECTORY, so a repository and
    the venv beside it can move together (and the committed configs hold no machine's paths)."""
    if choice == "none":
        return None
    if choice == "auto":
        if sys.prefix == sys.base_prefix:
            return None
        return "$$TRITON_MODEL_DIRECTORY/" + os.path.relpath(sys.prefix, Path(model_folder).resolve())
    return str(Path(choice).resolve())


def write_model(repository: Path, config: PythonModelConfig | EnsembleConfig, warmup: bytes | None = None) -> Path:
    folder = repository / config.name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    if warmup is not None:
        (folder / "warmup").mkdir(exist_ok=True)
        (folder / "warmup" / config.warmup_file).write_bytes(serialize_bytes_tensor([warmup]))
    (folder / "config.pbtxt").write_text(config.render())
    return folder


def write_engine_metadata(version_dir: Path, **fields) -> None:
    (version_dir / "engine.json").write_text(json.dumps(fields, indent=2) + "\n")


def read_parameters(config_path: Path) -> dict[str, str]:
    """A written config.pbtxt's `parameters` (what the backend's schema reads)."""
    config = text_format.Parse(Path(config_path).read_text(), mc.ModelConfig())
    return {k: v.string_value for k, v in config.parameters.items()}
