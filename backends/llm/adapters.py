"""LoRA adapters in PEFT's format, read from one adapter root and checked before any tensor reaches the engine.

A served model names one root folder; an adapter is a subfolder of it holding `adapter_config.json` and
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them. Names come from clients, so a name is a
plain folder name ([A-Za-z0-9._-]{1,64}, not "." or ".."), and the folder and its files must resolve inside the root
(a symlink leaving it is refused before anything is opened). Only safetensors: PEFT's older `adapter_model.bin` is a
pickle, which can run code when loaded. The rank, the target modules and every tensor's shape are checked against
the base model and the engine's limits, and options the engine does not implement (DoRA, per-module ranks, extra
trained modules) are refused with the reason rather than ignored.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.core.errors import InvalidInput, NotFound
from backends.llm.model import ModelArgs

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\."
                 r"(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")  # a LLaVA checkpoint's text model too
UNSUPPORTED = {"use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
               "modules_to_save": "extra trained modules", "layers_to_transform": "a subset of layers"}


class AdapterError(InvalidInput):
    """The adapter cannot be served; the message says why (the client's mistake or the adapter author's)."""


class AdapterNotFound(AdapterError, NotFound):
    """No adapter of that name can be served (not in the root, or unloaded): Triton's NOT_FOUND."""


@dataclass(frozen=True)
class AdapterLimits:
    max_rank: int = 64
    targets: tuple[str, ...] = PROJECTIONS


@dataclass
class LoraAdapter:
    """One adapter's weights: for (layer, projection), A [r, in] and B [out, r]; the output adds scaling * x A^T B^T."""

    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    key: bytes = field(default_factory=lambda: os.urandom(16))  # this load of it, in prefix-cache keys
    users: int = 0  # sequences of the engine using it (the engine loop counts them)


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection LoRA may target."""
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    h, i = args.hidden_size, args.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}


def adapter_dir(root: Path, name: str) -> Path:
    """The adapter's folder, once its name is a plain folder name and the folder resolves inside `root`."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or name in (".", ".."):
        raise AdapterError(f"adapter name {name!r}: use 1-64 letters, digits, '.', '_' or '-'")
    path = inside(root, root / name, name)
    if not path.is_dir():
        raise AdapterNotFound(f"adapter {name!r} is not in the adapter root")
    return path


def inside(root: Path, path: Path, name: str) -> Path:
    resolved, base = path.resolve(), root.resolve()
    if not resolved.is_relative_to(base):
        raise AdapterError(f"adapter {name!r}: {path.name} leads outside the adapter root")
    return resolved


def load_adapter(root: Path, name: str, args: ModelArgs, limits: AdapterLimits = AdapterLimits(),
                 dtype: torch.dtype = torch.float32) -> LoraAdapter:
    """Read and check adapter `name` from `root` for a base model of `args` (tensors in `dtype`, on the CPU)."""
    from safetensors import safe_open

    folder = adapter_dir(root, name)
    config_file = inside(root, folder / "adapter_config.json", name)
    weights_file = inside(root, folder / "adapter_model.safetensors", name)
    if not weights_file.is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl"))
        raise AdapterError(f"adapter {name!r}: no adapter_model.safetensors"
                           f"{f' (only safetensors are read, not {pickled})' if pickled else ''}")
    if not config_file.is_file():
        raise AdapterError(f"adapter {name!r}: no adapter_config.json")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not JSON ({exc})") from None
    rank, scaling = check_config(name, config, limits)
    shapes = projection_shapes(args)
    weights: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():
            match = KEY.fullmatch(key)
            if not match or match[2] not in limits.targets:
                raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of a supported projection")
            layer, module, part = int(match[1]), match[2], match[3]
            if layer >= args.num_hidden_layers:
                raise AdapterError(f"adapter {name!r}: {key} is for layer {layer}; the model has "
                                   f"{args.num_hidden_layers}")
            n_in, n_out = shapes[module]
            expected = (rank, n_in) if part == "A" else (n_out, rank)
            tensor = f.get_tensor(key)
            if tuple(tensor.shape) != expected:
                raise AdapterError(f"adapter {name!r}: {key} has shape {tuple(tensor.shape)}, the model needs "
                                   f"{expected} (another base model?)")
            weights.setdefault((layer, module), {})[part] = tensor.to(dtype)
    if incomplete := sorted(k for k, parts in weights.items() if len(parts) != 2):
        raise AdapterError(f"adapter {name!r}: layer {incomplete[0][0]} {incomplete[0][1]} lacks lora_A or lora_B")
    if not weights:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in adapter_model.safetensors")
    return LoraAdapter(name, rank, scaling, {k: (parts["A"], parts["B"]) for k, parts in weights.items()})


def check_config(name: str, config: dict, limits: AdapterLimits) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config the engine can apply exactly."""
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; LORA adapters are supported")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError(f"adapter {name!r}: {what} ({key}) are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(f"adapter {name!r}: trained biases are not supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or not 1 <= rank <= limits.max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank!r}; this model takes ranks 1 to {limits.max_rank}")
    if not isinstance(alpha, (int, float)):
        raise AdapterError(f"adapter {name!r}: lora_alpha {alpha!r} is not a number")
    targets = config.get("target_modules")  # a string is a regular expression: the tensors are checked one by one
    targets = [] if isinstance(targets, str) else targets or []
    if unknown := sorted(set(targets) - set(limits.targets)):
        raise AdapterError(f"adapter {name!r}: target modules {unknown} are not supported; {list(limits.targets)} are")
    return rank, alpha / (rank ** 0.5 if config.get("use_rslora") else rank)


@dataclass(frozen=True)
class Router:
    """Top-2 routing over adapters: a linear gate on the prompt's mean input embedding picks the two adapters with
    the highest scores and mixes their products by the softmax of those two scores."""

    adapters: tuple[str, ...]
    weight: torch.Tensor  # [n, hidden]
    bias: torch.Tensor  # [n]

    def choose(self, pooled: torch.Tensor) -> list[tuple[str, float]]:
        scores = self.weight @ pooled.float().cpu() + self.bias
        top = torch.topk(scores, 2)
        return list(zip((self.adapters[i] for i in top.indices.tolist()), torch.softmax(top.values, 0).tolist()))


ROUTER_FILES = ("router.json", "router.safetensors")


def load_router(root: Path, args: ModelArgs) -> Router | None:
    """The gate in the adapter root: router.json ({"adapters": [names]}) and router.safetensors (`weight` [n, hidden],
    optional `bias` [n]); None when the root has none."""
    from safetensors.torch import load_file

    names, weights = (inside(root, root / f, "router") for f in ROUTER_FILES)
    if not names.is_file():
        return None
    try:
        adapters = json.loads(names.read_text())["adapters"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise AdapterError(f"router.json: expected {{\"adapters\": [names]}} ({exc})") from None
    if not isinstance(adapters, list) or len(adapters) < 2 or not all(isinstance(a, str) and NAME.fullmatch(a)
                                                                       for a in adapters):
        raise AdapterError(f"router.json: adapters {adapters!r}: two or more adapter names")
    if not weights.is_file():
        raise AdapterError("router.json without router.safetensors")
    tensors = load_file(str(weights))
    weight = tensors.get("weight")
    bias = tensors.get("bias", torch.zeros(len(adapters)))
    if weight is None or tuple(weight.shape) != (len(adapters), args.hidden_size) or tuple(bias.shape) != \
            (len(adapters),):
        raise AdapterError(f"router.safetensors: needs weight [{len(adapters)}, {args.hidden_size}] and optional bias "
                           f"[{len(adapters)}]")
    return Router(tuple(adapters), weight.float(), bias.float())
