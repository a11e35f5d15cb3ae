"""What every family's build shares: the options, progress lines, engine export + verification, the model config's
parameters (the backend's typed schema, with the user's overrides), up-to-date checks and checkpoint placement."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from backends.core.devices import DTYPES
from backends.core.params import Parameters
from build_engines.export import (
    EngineSpec,
    build_tensorrt,
    export_onnx,
    export_torch,
    profile_shapes,
    tensorrt_unavailable,
    verify,
)
from build_engines.repository import (EnsembleConfig, PythonModelConfig, execution_env, write_engine_metadata,
                                      write_model)

BACKENDS = Path(__file__).resolve().parents[1] / "backends"
# where the backends' parameter schemas live: the configs written depend on them as on the builder's own code
SCHEMA_SOURCES = ("core/params.py", "vision/encoders.py", "vision/clip.py", "vision/anyres.py", "vision/llava_vision.py",
                  "llm/engine.py", "whisper/engine.py", "sam/engine.py")
BATCH = ("batch", 4096)  # dynamic batch axis of every engine (symbolic name, largest size)
VERIFY_BELOW_BYTES = 2**30  # greedy parity with transformers on the CPU: cheap only for small models (SmolLM2-135M: 0.5 GiB)
P = TypeVar("P", bound=Parameters)


@dataclass(frozen=True)
class BuildOptions:
    checkpoint: Path | None  # None: a model without weights (health)
    runtime: str = "onnxruntime"
    precision: str = "fp32"
    repository: Path = Path("model_repository")
    max_batch_size: int = 64
    max_queue_delay_us: int = 2000
    instances: int = 1
    device: str = "auto"
    execution_env: str = "auto"
    prepare_threads: int = 4
    force: bool = False
    name: str | None = None  # the model's name when it is not the family's default (a second checkpoint)
    overrides: dict[str, str] = field(default_factory=dict)  # backend parameters set on the command line
    calibration: Path | None = None  # fp8: text file, one request per line (default: build_engines/data/'s)
    fp8_activations: str = "none"  # fp8: "none" (weights only), "token" (dynamic) or "tensor" (static, calibrated)
    kv_cache_dtype: str = "auto"  # fp8: "fp8" stores the KV cache in E4M3 (calibrated scales)
    fp8_rounding: str = "gptq"  # fp8: GPTQ's error feedback over the calibration prompts, or "nearest"
    priority_levels: bool = False  # dynamically batched models: the QoS classes as Triton priority levels
    ensemble: bool = False  # vit, clip_vision, whisper, vlm: an ensemble of a preprocessing model and the engine's
    preprocess_instances: int = 2  # instances of an ensemble's preprocessing model (CPU ones unless on the device)
    max_queue_size: int | None = None  # Triton-batched models: requests waiting at most (None: unbounded)
    draft: Path | None = None  # llm: a draft model's checkpoint for speculative decoding (placed as <version>/draft)
    fp8_lm_head: bool = False  # fp8: the LM head in E4M3 too (llm-compressor's recipes leave it in bf16)

    def model_name(self, default: str) -> str:
        return self.name or default

    def fingerprint(self, family: str) -> str:
        """Changes whenever the checkpoint, an option that shapes the artefacts, the builder's own code or a
        backend's parameter schema changes."""
        weights = sorted(p for p in self.checkpoint.iterdir() if p.is_file())
        stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
        options = {k: str(v.resolve() if isinstance(v, Path) else v) for k, v in asdict(self).items() if k != "force"}
        if self.calibration:
            options["calibration_text"] = self.calibration.read_text()
        sources = [*sorted(Path(__file__).parent.glob("*.py")), *sorted(Path(__file__).parent.glob("data/*")),
                   *(BACKENDS / name for name in SCHEMA_SOURCES)]
        code = hashlib.sha256(b"".join(p.read_bytes() for p in sources))
        return hashlib.sha256(json.dumps([family, options, stamp, code.hexdigest()]).encode()).hexdigest()[:16]

    def parameters(self, schema: type[P], **builder_values) -> P:
        """The backend's parameters: what the build decides, then the user's overrides (those of this schema: an
        ensemble's steps have schemas of their own; the command line checked them against the family's), validated
        by the schema exactly as the backend will read them."""
        values = schema(**builder_values).to_config()
        fields = {f.name for f in dataclasses.fields(schema)}
        values.update({k: v for k, v in self.overrides.items() if k in fields})
        return schema.from_config(values)

    def write(self, config: PythonModelConfig | EnsembleConfig, warmup: bytes | None = None) -> Path:
        """config.pbtxt (with this build's EXECUTION_ENV_PATH) and warm-up data into the model's folder."""
        if isinstance(config, PythonModelConfig):
            config.execution_env = execution_env(self.execution_env, self.repository / config.name)
            config.max_queue_size = self.max_queue_size
        return write_model(self.repository, config, warmup)


class Progress:
    """One line per build step with its duration: long exports show where they are."""

    def __init__(self, name: str, steps: int):
        self.name, self.steps, self.done = name, steps, 0

    def step(self, what: str):
        self.done += 1
        print(f"[{self.name} {self.done}/{self.steps}] {what} ...", end="", flush=True)
        return _Timer()


class _Timer:
    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, exc_type, *_):
        print(f" {'failed' if exc_type else 'done'} in {time.perf_counter() - self.start:.1f}s", flush=True)


def instance_kind(opts: BuildOptions) -> str:
    """GPU or CPU instances as --device says; `auto` lets Triton place them (GPU where there is one)."""
    return {"cuda": "KIND_GPU", "cpu": "KIND_CPU"}.get(opts.device, "KIND_AUTO")


def clear_other_layout(opts: BuildOptions, name: str, steps: tuple[str, ...]) -> None:
    """Switching --ensemble on or off: remove the single model `name`'s folder (its name becomes the ensemble's) or
    the ensemble's `steps`, whichever this build does not write."""
    for stale in ([name] if opts.ensemble else steps):
        shutil.rmtree(opts.repository / stale, ignore_errors=True)


def up_to_date(opts: BuildOptions, names: list[str], label: str | None = None) -> bool:
    """Whether every named model was built from this checkpoint, these options and this code (then says so)."""
    for name in names:
        meta = opts.repository / name / "1" / "engine.json"
        if opts.force or not meta.exists() or not (opts.repository / name / "config.pbtxt").exists():
            return False
        if json.loads(meta.read_text()).get("fingerprint") != opts.fingerprint(name):
            return False
    print(f"{label or names[0]}: up to date")
    return True


def build_engine(spec: EngineSpec, version_dir: Path, opts: BuildOptions, progress: Progress) -> float:
    """Export in the requested precision, verify against the fp32 module, write engine.json. Returns max error.

    TensorRT builds from an fp32 ONNX graph (verified like any other) and applies the precision in its builder."""
    if opts.runtime == "tensorrt" and (reason := tensorrt_unavailable()):
        raise RuntimeError(reason)
    if opts.runtime == "onnxruntime" and opts.precision == "bf16":
        raise RuntimeError("onnxruntime has no bf16 kernels for these models: use --runtime torch for bf16")
    version_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.onnx", "model.onnx.data", "model.pt2", "model.plan"):
        (version_dir / stale).unlink(missing_ok=True)
    export_precision = "fp32" if opts.runtime == "tensorrt" else opts.precision
    dtype = DTYPES[export_precision]
    typed = EngineSpec(copy.deepcopy(spec.module).to(dtype),
                       lambda b: {k: v.to(dtype) if v.is_floating_point() and k not in spec.keep_fp32 else v
                                  for k, v in spec.make_inputs(b).items()},
                       spec.dynamic_axes, spec.outputs, spec.keep_fp32)
    if opts.runtime == "torch":
        from backends.core.runtime import TorchRuntime

        device = "cuda" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()) else "cpu"
        with progress.step(f"exporting torch program ({opts.precision}, {device})"):
            export_torch(typed, version_dir / "model.pt2", device)
        engine = TorchRuntime(version_dir / "model.pt2", spec.outputs, device)
    else:
        from backends.core.runtime import OnnxRuntime

        with progress.step(f"exporting ONNX ({export_precision}, dynamic batch)"):
            export_onnx(typed, version_dir / "model.onnx")
        engine = OnnxRuntime(version_dir / "model.onnx", "cpu")
    with progress.step("verifying the engine against PyTorch on random inputs"):
        error = verify(spec, engine.run, export_precision)
    if opts.runtime == "tensorrt":
        with progress.step("building TensorRT plan"):
            build_tensorrt(version_dir / "model.onnx", version_dir / "model.plan", opts.precision,
                           profile_shapes(spec, opts.max_batch_size))
    write_engine_metadata(version_dir, runtime=opts.runtime, precision=opts.precision, outputs=spec.outputs,
                          max_error_vs_torch=error,
                          fingerprint=opts.fingerprint(version_dir.relative_to(opts.repository).parts[0]),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"    max |engine - torch| = {error:.2e} of the largest output (tolerance: build_engines/export.py)")
    return error


def place_checkpoint(checkpoint: Path, version_dir: Path, patterns: tuple[str, ...]) -> None:
    """Put the checkpoint's files in the model version folder: hard links where the file system allows (an 8 B
    model is 16 GB: no second copy), copies otherwise. Weights of an earlier build are removed first."""
    version_dir.mkdir(parents=True, exist_ok=True)
    for stale in version_dir.glob("*.safetensors"):
        stale.unlink()
    for pattern in patterns:
        for file in checkpoint.glob(pattern):
            target = version_dir / file.name
            target.unlink(missing_ok=True)
            try:
                os.link(file, target)
            except OSError:
                shutil.copy2(file, target)


def place_and_verify(checkpoint: Path, version_dir: Path, patterns: tuple[str, ...], verify_copy,
                     progress: Progress) -> None:
    """place_checkpoint, then `verify_copy(version_dir)` (greedy tokens vs transformers on the CPU) when the weights
    are small enough for that to be cheap."""
    with progress.step(f"copying {checkpoint} into {version_dir}"):
        place_checkpoint(checkpoint, version_dir, patterns)
    size = sum(f.stat().st_size for f in version_dir.glob("*.safetensors"))
    if size < VERIFY_BELOW_BYTES:
        with progress.step("greedy tokens vs transformers generate on the CPU"):
            verify_copy(version_dir)
    else:
        print(f"    parity check skipped: {size / 2**30:.1f} GiB of weights (tests cover the engine on tiny models)")
