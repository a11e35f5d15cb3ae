"""One small interface over the engines a model version folder can hold.

    model.onnx -> ONNX Runtime (CPU; CUDA provider when present)
    model.pt2  -> PyTorch (torch.export program; eager, optional torch.compile; CUDA when present)
    model.plan -> TensorRT (only where the tensorrt module and a GPU exist)

`load_runtime` picks from the artefacts present unless the model config names a runtime. Every runtime takes and
returns numpy float32/int64 arrays so model classes never care which engine ran;
the torch and TensorRT runtimes also take torch tensors, which may already be on their device. Outputs named in
`keep` stay where the torch and TensorRT runtimes made them (torch tensors on their device, in their dtype), to feed
another engine or post-processing there without a round trip (SAM's cached image embeddings, its low-res masks).
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

ARTEFACTS = {"tensorrt": "model.plan", "torch": "model.pt2", "onnxruntime": "model.onnx"}
RUNTIMES = ("onnxruntime", "torch", "tensorrt")
PREFERENCE = ("tensorrt", "torch", "onnxruntime")  # fastest first when several are present


class RuntimeUnavailable(RuntimeError):
    """The requested engine cannot run on this machine (missing package or GPU)."""


class Runtime(ABC):
    name: str
    device: str

    @abstractmethod
    def run(self, feeds: dict[str, np.ndarray], keep: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """Run one batch; feeds and results are keyed by the engine's tensor names (`keep`: see above)."""


class OnnxRuntime(Runtime):
    name = "onnxruntime"

    def __init__(self, path: Path, device: str = "auto"):
        import onnxruntime as ort

        providers: list = ["CPUExecutionProvider"]
        if (device == "auto" or device.startswith("cuda")) and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": int(device.partition(":")[2] or 0)}))
        elif device.startswith("cuda"):
            raise RuntimeUnavailable("onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu)")
        self.session = ort.InferenceSession(str(path), providers=providers)
        self.device = "cpu" if providers[0] == "CPUExecutionProvider" else "cuda"
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}

    def run(self, feeds: dict[str, np.ndarray], keep: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        feeds = {name: array.astype(_ORT_TYPES[self.input_types[name]], copy=False) for name, array in feeds.items()}
        names = [o.name for o in self.session.get_outputs()]
        return {n: np.asarray(v, dtype=np.float32) for n, v in zip(names, self.session.run(names, feeds))}


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32}


class TorchRuntime(Runtime):
    name = "torch"

    def __init__(self, path: Path, output_names: list[str], device: str = "auto", compile: bool = False,
                 graph_batch: int = 0, graph_extents: Sequence[int] = ()):
        """`graph_batch`: on CUDA, replay batches up to this size from CUDA graphs (0: never), for the inputs'
        shapes after the batch as exported when they are fixed, else for each value in `graph_extents` given to
        their dynamic dimension (SAM's prompt tokens); inputs of other shapes run op by op."""
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeUnavailable("torch reports no CUDA device")
        self.torch, self.device = torch, device
        program = torch.export.load(str(path))
        self.input_names = [spec.arg.name for spec in program.graph_signature.input_specs
                            if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
        exported = {node.name: node.meta["val"] for node in program.graph.nodes if node.op == "placeholder"}
        self.input_dtypes = [exported[name].dtype for name in self.input_names]  # each input as the program was traced
        self.output_names = output_names  # a torch.export program's outputs carry no names
        module = program.module().to(device)
        self.module = torch.compile(module, dynamic=True) if compile else module
        shapes = [tuple(exported[name].shape[1:]) for name in self.input_names]
        self.graphs: dict[tuple, Callable] = {}  # the inputs' shapes after the batch -> their graphs
        if graph_batch and device.startswith("cuda"):
            from backends.core.cuda_graphs import try_graphs

            fixed = all(type(d) is int for s in shapes for d in s)
            variants = [shapes] if fixed else [[tuple(d if type(d) is int else extent for d in s) for s in shapes]
                                               for extent in graph_extents]
            for variant in variants:
                graphed = try_graphs(self.module, variant, self.input_dtypes, torch.device(device), graph_batch)
                if graphed is not None:
                    self.graphs[tuple(variant)] = graphed

    def run(self, feeds: dict[str, np.ndarray], keep: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        torch = self.torch
        args = [as_tensor(torch, feeds[name]).to(self.device, dtype)
                for name, dtype in zip(self.input_names, self.input_dtypes)]
        module = self.graphs.get(tuple(tuple(a.shape[1:]) for a in args), self.module)
        with torch.inference_mode():
            outputs = module(*args)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        # contiguous on the device: exported programs may return permuted strides, which numpy would gather on the CPU
        return {n: o.contiguous() if n in keep else device_to_numpy(o) for n, o in zip(self.output_names, outputs)}


def device_to_numpy(tensor) -> np.ndarray:
    """A torch output as float32 numpy, converted on its device and contiguous there: exported programs may return
    permuted strides, which numpy would gather on the CPU."""
    from backends.core.devices import to_host  # (torch is imported only by the runtimes that use it)

    return to_host(tensor.float().contiguous())


def as_tensor(torch, value):
    """A numpy array or a torch tensor (already on a device, e.g. from an ensemble's GPU step) as a torch tensor."""
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))


class TensorRTRuntime(Runtime):
    """TensorRT plan execution (TensorRT 10 tensor API). Not verified here: tensorrt cannot be installed in our env."""

    name = "tensorrt"
    device = "cuda"

    def __init__(self, path: Path):
        try:
            import tensorrt as trt
            import torch
        except ImportError as exc:
            raise RuntimeUnavailable(f"TensorRT runtime unavailable: {exc}") from None
        if not torch.cuda.is_available():
            raise RuntimeUnavailable("TensorRT runtime unavailable: no CUDA device")
        self.torch, self.trt = torch, trt
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def torch_dtype(self, name: str):
        return getattr(self.torch, np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name))).name)

    def run(self, feeds: dict[str, np.ndarray], keep: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        torch = self.torch
        stream = torch.cuda.current_stream()
        alive = []  # the inputs' device copies, until the engine has run
        for name in self.inputs:
            dtype = self.torch_dtype(name)
            tensor = as_tensor(torch, feeds[name]).to("cuda", dtype)
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
            alive.append(tensor)
        results = {}
        for name in self.outputs:
            dtype = self.torch_dtype(name)
            results[name] = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=dtype, device="cuda")
            self.context.set_tensor_address(name, results[name].data_ptr())
        self.context.execute_async_v3(stream.cuda_stream)
        stream.synchronize()
        return {n: t if n in keep else device_to_numpy(t) for n, t in results.items()}


def available_runtimes(version_dir: Path) -> list[str]:
    return [name for name in PREFERENCE if (version_dir / ARTEFACTS[name]).exists()]


def load_runtime(version_dir: str | Path, runtime: str = "auto", device: str = "auto", compile: bool = False,
                 graph_batch: int = 0, graph_extents: Sequence[int] = ()) -> Runtime:
    """Open the engine in a model version folder; `runtime="auto"` takes the fastest artefact present;
    `compile`, `graph_batch` and `graph_extents` (CUDA graphs: TorchRuntime) apply to the torch one."""
    version_dir = Path(version_dir)
    present = available_runtimes(version_dir)
    if runtime == "auto":
        if not present:
            raise FileNotFoundError(f"no engine in {version_dir} (expected one of {sorted(ARTEFACTS.values())}); "
                                    "run `python -m build_engines`")
        runtime = present[0]
    elif runtime not in ARTEFACTS:
        raise ValueError(f"unknown runtime {runtime!r}; choose from {sorted(ARTEFACTS)}")
    path = version_dir / ARTEFACTS[runtime]
    if not path.exists():
        raise FileNotFoundError(f"runtime {runtime!r} asked for but {path} was not built")
    if runtime == "onnxruntime":
        return OnnxRuntime(path, device)
    if runtime == "torch":
        meta = json.loads((version_dir / "engine.json").read_text())
        return TorchRuntime(path, meta["outputs"], device, compile, graph_batch, graph_extents)
    return TensorRTRuntime(path)
