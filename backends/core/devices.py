"""Precision names and device choice shared by the PyTorch engines (llm, whisper, sam): "auto" is CUDA when
present, else the CPU."""
from __future__ import annotations

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, copied asynchronously from pinned memory (a copy from pageable
    memory may wait for the device's queue)."""
    if isinstance(values, np.ndarray):  # torch cannot pin a tensor made from an array
        values = values.tolist()
    return torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array; from a GPU through pinned memory, which the copy engine writes at the
    link's speed (a copy to pageable memory is staged through a driver buffer at a fraction of it: SAM's masks,
    megabytes a click)."""
    if tensor.device.type != "cuda":
        return tensor.numpy(force=True)
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor).numpy()
