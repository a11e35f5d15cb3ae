"""Precision names and device choice shared by the PyTorch engines (llm, whisper, sam): "auto" is CUDA when
present, else the CPU."""
from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
