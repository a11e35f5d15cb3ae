"""Export a PyTorch module to an engine artefact and prove the artefact computes what the module computes.

ONNX goes through the torch.export-based exporter with dynamic axes; the exported graph is then run with ONNX
Runtime on fresh random inputs at two batch sizes (which also checks the dynamic batch axis) and compared to PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np


class VerificationError(RuntimeError):
    """The exported engine does not compute what the PyTorch module computes."""


# Max |engine - torch| / max(1, |torch|) allowed on random inputs, by precision. fp32 differences come from kernel
# order only.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 1e-1}

MakeInputs = Callable[[int], dict[str, "torch.Tensor"]]  # batch size -> named example inputs  # noqa: F821


@dataclass(frozen=True)
class EngineSpec:
    """What to export: the module, how to make example inputs, which axes are dynamic, output names."""

    module: "torch.nn.Module"  # noqa: F821
    make_inputs: MakeInputs
    dynamic_axes: dict[str, dict[int, tuple[str, int]]]  # input name -> {axis: (symbolic name, max size)}
    outputs: list[str]
    keep_fp32: tuple[str, ...] = ()  # floating inputs that stay fp32 in every precision (e.g. pixel coordinates)


def _dynamic_shapes(spec: EngineSpec):
    import torch

    dims: dict[str, torch.export.Dim] = {}
    shapes = {}
    for name, axes in spec.dynamic_axes.items():
        shapes[name] = {axis: dims.setdefault(sym, torch.export.Dim(sym, max=top)) for axis, (sym, top) in axes.items()}
    return shapes


def export_onnx(spec: EngineSpec, path: Path) -> None:
    import logging

    import torch

    # the exporter warns once per torchvision op it cannot register; torchvision is not used here
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    example = spec.make_inputs(2)
    shapes = _dynamic_shapes(spec)
    program = torch.export.export(spec.module, (), kwargs=example, dynamic_shapes={k: shapes.get(k) for k in example},
                                  strict=False)
    onnx_program = torch.onnx.export(program, (), kwargs=example, input_names=list(example),
                                     output_names=spec.outputs, dynamo=True, verbose=False)
    onnx_program.save(str(path))


def export_torch(spec: EngineSpec, path: Path, device: str = "cpu") -> None:
    """A torch.export program traced on `device`: traced programs keep the device of constants they create, so the
    artefact serves on the device it was exported on."""
    import torch

    example = {k: v.to(device) for k, v in spec.make_inputs(2).items()}
    program = torch.export.export(spec.module.to(device), tuple(example.values()), dynamic_shapes=tuple(
        _dynamic_shapes(spec).get(name) for name in example), strict=False)
    torch.export.save(program, str(path))


def reference_outputs(spec: EngineSpec, inputs: dict) -> list[np.ndarray]:
    import torch

    with torch.inference_mode():
        out = spec.module(**inputs)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o.float().numpy() for o in out]


def verify(spec: EngineSpec, run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], precision: str,
           batches: tuple[int, ...] = (1, 3)) -> float:
    """Largest |engine - module| (relative to the output's largest value when above 1) over fresh random inputs;
    raises if above TOLERANCE[precision]."""
    worst = 0.0
    for batch in batches:
        inputs = spec.make_inputs(batch)
        expected = reference_outputs(spec, inputs)
        got = run({k: v.numpy() for k, v in inputs.items()})
        for name, ref in zip(spec.outputs, expected):
            if got[name].shape != ref.shape:
                raise VerificationError(f"{name}: engine shape {got[name].shape} != reference {ref.shape}")
            scale = max(1.0, float(np.abs(ref).max()))  # kernel-order differences grow with the values
            worst = max(worst, float(np.abs(got[name].astype(np.float32) - ref).max()) / scale)
    if worst > TOLERANCE[precision]:
        raise VerificationError(f"engine differs from PyTorch by {worst:.3g} > {TOLERANCE[precision]} ({precision})")
    return worst


def tensorrt_unavailable() -> str | None:
    """Why a TensorRT build cannot run here, or None when it can."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "--runtime tensorrt needs the tensorrt Python package, which is not installed"
    import torch

    if not torch.cuda.is_available():
        return "--runtime tensorrt needs a CUDA GPU; none is visible"
    return None


def profile_shapes(spec: EngineSpec, max_batch: int) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shape per input for a TensorRT optimisation profile, from the spec's dynamic axes: the batch
    axis spans 1..max_batch, other dynamic axes 1..their declared maximum, static axes keep the example's size."""
    profiles = {}
    for name, tensor in spec.make_inputs(1).items():
        axes = spec.dynamic_axes.get(name, {})
        top = [(max_batch if axis == 0 else axes[axis][1]) if axis in axes else size
               for axis, size in enumerate(tensor.shape)]
        low = [1 if axis in axes else size for axis, size in enumerate(tensor.shape)]
        profiles[name] = (tuple(low), tuple(max(1, (a + b) // 2) for a, b in zip(low, top)), tuple(top))
    return profiles


def build_tensorrt(onnx_path: Path, plan_path: Path, precision: str,
                   profiles: dict[str, tuple[tuple[int, ...], ...]]) -> None:
    """fp32 ONNX -> TensorRT plan with the TensorRT 10 Python API; `precision` picks the builder's kernels.

    Not verified in our environment: tensorrt cannot be installed there (see `tensorrt_unavailable`).
    """
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    profile = builder.create_optimization_profile()
    for name, (low, opt, top) in profiles.items():
        profile.set_shape(name, low, opt, top)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the engine (see its log above)")
    plan_path.write_bytes(bytes(plan))
