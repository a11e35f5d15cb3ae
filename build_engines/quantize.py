"""FP8 checkpoints from ordinary ones, in compressed-tensors' float-quantized layout (what llm-compressor writes and
vLLM and our engine read): every decoder projection's weight in E4M3 with its scale; embeddings, norms and the LM
head as they were."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from backends.llm.fp8 import Fp8Scheme, quantize_weight
from backends.llm.model import checkpoint_tensors

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(source: Path, out: Path, scheme: Fp8Scheme = Fp8Scheme()) -> None:
    """`out` gets the quantized safetensors, config.json with the quantization_config, and every other file of
    `source` (tokenizer, chat template, generation config)."""
    from safetensors.torch import save_file

    if scheme.activations != "token":
        raise ValueError("static activation scales need calibration, which is not built yet: use dynamic (token)")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(file, out / file.name)
    tensors = {}
    for name, tensor in checkpoint_tensors(source):
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = quantize_weight(tensor,
                                                                                                    scheme.weights)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = scheme.to_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
