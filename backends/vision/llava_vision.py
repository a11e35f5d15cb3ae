"""LLaVA-NeXT's image side: CLIP vision tower over all tiles of all images in one batch, the 2-layer projector, then
per image the thumbnail's features followed by the tiles' features laid out as one grid, padding removed and a
newline embedding closing each row. The result is what the language model reads at the image placeholder.

The vision tower is transformers' own module (CLIPVisionModel) with the checkpoint's weights; only the vision and
projector tensors are read, never the language model's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from backends.core.params import bounded
from backends.llm.engine import EngineConfig
from backends.vision.anyres import AnyResPlan, AnyResTiler


@dataclass(frozen=True)
class VLMParams(EngineConfig):
    """The `mm_vlm` backend's parameters: the LLM engine's, plus how images are prepared."""

    prepare_threads: int = bounded(4, 1, 256)  # image decode + tiling threads per instance
    preprocess_on_device: bool = False  # decode (nvJPEG) and resize on the model's device instead of Pillow
    decode_reduced: bool = False  # Pillow: JPEGs decoded at the smallest DCT scale the resizes allow: faster, not
    # pixel-exact with transformers' processor (backends.media.images.decode_reduced)
    visual_keep_ratio: float = bounded(1.0, 0, 1, low_open=True)  # share of tile tokens kept (highest norm)
    image_cache: int = bounded(8, 0)  # visual features of this many recent images kept on the device (0: off);
    # outside the KV budget: an 8B model's 2,000-token image takes 16 MB
    encode_ahead: int = bounded(4, 1)  # requests of a class or higher admitted (their images encoded) and not started
    qos_lower_prepare: bool = False  # while a higher class is in flight, lower classes' images are prepared one at
    # a time within qos_lower_share of the time too (backends.core.qos.QosPool; off: no gain measured, README QoS)


def expand_placeholder(ids: list[int], placeholder_id: int, count: int) -> list[int]:
    """The prompt with its one image placeholder token repeated once per visual token."""
    at = ids.index(placeholder_id)
    return ids[:at] + [placeholder_id] * count + ids[at + 1:]

PROJECTOR_ACTIVATIONS = {"gelu": nn.GELU, "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU}


class LlavaVision(nn.Module):
    def __init__(self, checkpoint: Path, tiler: AnyResTiler, dtype: torch.dtype = torch.float32, device="cpu"):
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModel

        super().__init__()
        config = AutoConfig.from_pretrained(checkpoint)
        self.tiler, self.feature_layer = tiler, config.vision_feature_layer
        if not isinstance(self.feature_layer, int):
            raise ValueError("several vision_feature_layer values are not supported")
        self.tower = AutoModel.from_config(config.vision_config)
        text_hidden, bias = config.text_config.hidden_size, getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = nn.Linear(config.vision_config.hidden_size, text_hidden, bias=bias)
        self.act = PROJECTOR_ACTIVATIONS[config.projector_hidden_act]()
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.image_newline = nn.Parameter(torch.zeros(text_hidden))
        names = {f"vision_tower.{k}": ("tower." + k) for k in self.tower.state_dict()}
        names.update({f"multi_modal_projector.{n}.{w}": f"{n}.{w}" for n in ("linear_1", "linear_2")
                      for w in ("weight", "bias")}, image_newline="image_newline")
        state = {}
        index = Path(checkpoint) / "model.safetensors.index.json"
        files = sorted({Path(checkpoint) / f for f in json.loads(index.read_text())["weight_map"].values()}) \
            if index.exists() else sorted(Path(checkpoint).glob("*.safetensors"))
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    name = names.get(key.removeprefix("model."))
                    if name is not None:
                        state[name] = f.get_tensor(key)
        self.load_state_dict(state, strict=True)
        self.to(device=device, dtype=dtype).eval()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, plans: list[AnyResPlan]) -> list[torch.Tensor]:
        """pixel_values [sum of tiles, 3, S, S] (each image's thumbnail first) -> per image [tokens, hidden]."""
        hidden = self.tower(pixel_values, output_hidden_states=True).hidden_states[self.feature_layer]
        if self.tiler.drop_cls:
            hidden = hidden[:, 1:]
        features = self.linear_2(self.act(self.linear_1(hidden)))
        side = self.tiler.tile // self.tiler.patch
        out = []
        for plan, tiles in zip(plans, features.split([p.num_tiles for p in plans])):
            rows, cols = plan.grid
            grid = tiles[1:].view(rows, cols, side, side, -1).permute(0, 2, 1, 3, 4).reshape(rows * side,
                                                                                              cols * side, -1)
            kept_rows, kept_cols = self.tiler.unpadded_window(*plan.image_size, plan.canvas)
            grid = grid[kept_rows, kept_cols]
            newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, -1)
            tokens = torch.cat((grid, newline), dim=1)  # [rows, cols + 1, hidden]
            if self.tiler.keep_ratio < 1:  # prune: keep the highest-norm grid tokens, in order, and every newline
                norms = grid.norm(dim=-1).flatten()
                keep = torch.zeros_like(norms, dtype=torch.bool)
                keep[norms.topk(self.tiler.kept_grid_tokens(norms.numel())).indices] = True
                mask = torch.cat((keep.view(grid.shape[:2]), keep.new_ones(grid.shape[0], 1)), dim=1)
                out.append(torch.cat((tiles[0], tokens[mask])))
            else:
                out.append(torch.cat((tiles[0], tokens.flatten(0, 1))))
        return out
