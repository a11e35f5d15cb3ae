"""FP8 checkpoints from ordinary ones, in compressed-tensors' float-quantized layout (what llm-compressor writes and
vLLM and our engine read): every decoder projection's weight in E4M3 with its scale, and the LM head's too where the
scheme quantizes it (`ignore` without "lm_head"); embeddings and norms as they were."""
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
    """Static scales from running `prompts` (token ids) through the float model: each projection's largest input
    magnitude / 448, keyed by the checkpoint's layer names (q/k/v share one input, as do gate/up), and each layer's
    largest key and value / 448 for an FP8 KV cache (`model.layers.N.self_attn.k_scale`, `.v_scale`)."""
    import torch

    from backends.llm.fp8 import FP8_MAX
    from backends.llm.model import load_model
    from backends.llm.scoring import sequence_logits

    model = load_model(source, torch.float32, "cpu")
    amax: dict[str, float] = {}

    def track(key: str, *values: torch.Tensor) -> None:
        amax[key] = max(amax.get(key, 0.0), *(v.abs().max().item() for v in values))

    model.lm_head.register_forward_pre_hook(lambda _, args: track("lm_head", args[0]))
    for i, layer in enumerate(model.layers):
        for fused in FUSED_PARTS:
            layer.get_submodule(fused).register_forward_pre_hook(
                lambda _, args, key=f"{i}.{fused}": track(key, args[0]))
        # after attention ran, the cache (zeroed per sequence by sequence_logits) holds this layer's keys and values
        layer.self_attn.register_forward_hook(lambda _, args, __, i=i: track(f"{i}.k", args[3][0]) or
                                              track(f"{i}.v", args[3][1]))
    for ids in prompts:
        sequence_logits(model, ids)
    scales = {}
    for key, value in amax.items():
        if key == "lm_head":
            scales["lm_head"] = value / FP8_MAX
            continue
        index, part = key.split(".", 1)
        names = [f"self_attn.{part}_scale"] if part in ("k", "v") else FUSED_PARTS[part]
        scales.update({f"model.layers.{index}.{name}": value / FP8_MAX for name in names})
    return scales


def quantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme = Fp8Scheme(),
                      scales: dict[str, float] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with every decoder projection's weight in E4M3 plus its scales (on the
    tensors' own device: the GPU benchmark quantizes its random weights there), and the calibrated `scales` the
    scheme uses (static input scales, KV cache scales)."""
    import torch

    static = lambda name: torch.tensor([scales[name]], dtype=torch.float32)  # noqa: E731
    head = scheme.quantizes("lm_head")
    embedding, head_written = None, False

    def quantized(layer: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        weight, scale = quantize_weight(tensor.detach(), scheme.weights)
        yield layer + ".weight", weight
        yield layer + ".weight_scale", scale
        if scheme.activations == "tensor":
            yield layer + ".input_scale", static(layer.removeprefix("language_model."))

    for name, tensor in tensors:
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            yield from quantized(name.removesuffix(".weight"), tensor)
        elif head and name.endswith("lm_head.weight"):
            head_written = True
            yield from quantized(name.removesuffix(".weight"), tensor)
        else:
            if head and name.endswith("embed_tokens.weight"):
                embedding = name, tensor
            yield name, tensor.contiguous()
    if head and not head_written and embedding:  # tied embeddings: the head gets an FP8 copy of its own
        yield from quantized(embedding[0].replace("model.embed_tokens.weight", "lm_head"), embedding[1])
    if scheme.kv_cache:
        yield from ((name, static(name)) for name in scales if name.endswith(("k_scale", "v_scale")))


def write_fp8_checkpoint(source: Path, out: Path, scheme: Fp8Scheme = Fp8Scheme(),
                         scales: dict[str, float] | None = None, gptq_prompts: list[list[int]] | None = None) -> None:
    """`out` gets the quantized safetensors, config.json with the quantization_config, and every other file of
    `source` (tokenizer, chat template, generation config). Static activations (scheme.activations "tensor") and an
    FP8 KV cache take their scales from `scales` (see `calibrate`). With `gptq_prompts` (token ids), the weights are
    rounded by build_engines/gptq.py instead of each to its nearest E4M3 value (same scales, same format)."""
    from safetensors.torch import save_file

    if scheme.calibrated != (scales is not None):
        raise ValueError("static activation and KV cache scales come from calibration: give scales exactly when the "
                         "scheme has static activations or an FP8 KV cache")
    write_fp8_metadata(source, out, scheme)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    tensors = dict(quantized_tensors(checkpoint_tensors(source), scheme, scales))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if gptq_prompts:
        from build_engines.gptq import gptq_weights

        rounded = gptq_weights(out, source, gptq_prompts)  # Hessians from the nearest-rounded model written above
        if unknown := sorted(set(rounded) - set(tensors)):
            raise ValueError(f"{source}: GPTQ produced weights the checkpoint does not name: {unknown[:3]}")
        tensors.update(rounded)
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
    if scheme.quantizes("lm_head"):  # the FP8 head is a tensor of its own, no longer the embeddings
        for part in (config, config.get("text_config") or {}):
            part["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
