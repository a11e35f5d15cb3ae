"""FP8 checkpoints from ordinary ones, in compressed-tensors' float-quantized layout (what llm-compressor writes and
vLLM and our engine read): every decoder projection's weight in E4M3 with its scale; embeddings, norms and the LM
head as they were."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from backends.llm.fp8 import Fp8Scheme, quantize_weight
from backends.llm.model import checkpoint_tensors

if TYPE_CHECKING:
    import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
               "mlp.down_proj": ("mlp.down_proj",)}


def calibrate(source: Path, prompts: list[list[int]]) -> dict[str, float]:
    """Static input scales: the largest input magnitude each projection sees over `prompts` (token ids), / 448,
    keyed by the checkpoint's layer names (q/k/v share one input, as do gate/up)."""
    import torch

    from backends.llm.fp8 import FP8_MAX
    from backends.llm.model import load_model
    from backends.llm.scoring import sequence_logits

    model = load_model(source, torch.float32, "cpu")
    amax: dict[str, float] = {}
    for i, layer in enumerate(model.layers):
        for fused in FUSED_PARTS:
            module = layer.get_submodule(fused)
            key = f"{i}.{fused}"
            module.register_forward_pre_hook(lambda _, args, key=key: amax.__setitem__(
                key, max(amax.get(key, 0.0), args[0].abs().max().item())))
    for ids in prompts:
        sequence_logits(model, ids)
    return {f"model.layers.{key.split('.', 1)[0]}.{part}": value / FP8_MAX for key, value in amax.items()
            for part in FUSED_PARTS[key.split(".", 1)[1]]}


def quantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme = Fp8Scheme(),
                      input_scales: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with every decoder projection's weight in E4M3 plus its scales (on the
    tensors' own device: the GPU benchmark quantizes its random weights there)."""
    import torch

    for name, tensor in tensors:
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            layer = name.removesuffix(".weight")
            weight, scale = quantize_weight(tensor.detach(), scheme.weights)
            yield name, weight
            yield layer + ".weight_scale", scale
            if input_scales is not None:
                yield layer + ".input_scale", torch.tensor([input_scales[layer]], dtype=torch.float32)
        else:
            yield name, tensor.contiguous()


def write_fp8_checkpoint(source: Path, out: Path, scheme: Fp8Scheme = Fp8Scheme(),
                         input_scales: dict[str, float] | None = None) -> None:
    """`out` gets the quantized safetensors, config.json with the quantization_config, and every other file of
    `source` (tokenizer, chat template, generation config). Static activations (scheme.activations "tensor") take
    their scales from `input_scales` (see `calibrate`)."""
    from safetensors.torch import save_file

    if (scheme.activations == "tensor") != (input_scales is not None):
        raise ValueError("static activation scales come from calibration: give input_scales exactly when the "
                         "scheme's activations are 'tensor'")
    write_fp8_metadata(source, out, scheme)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    tensors = dict(quantized_tensors(checkpoint_tensors(source), scheme, input_scales))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_fp8_metadata(source: Path, out: Path, scheme: Fp8Scheme) -> None:
    """Everything of an FP8 checkpoint but its weights: `source`'s tokenizer, chat template and generation config,
    and its config.json with the quantization_config added."""
    out.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json",
                                                                                 "model.safetensors.index.json"):
            shutil.copy2(file, out / file.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = scheme.to_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
