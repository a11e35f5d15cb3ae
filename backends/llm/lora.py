"""LoRA in the engine: adapters' weights in fixed device slots, and the product that adds them to a mixed batch.

Each of a layer's projections holds, for every slot, A [r_max, in] per part (q|k|v and gate|up are fused in the
engine, so their parts are stacked) and B [r_max, out] with the parts side by side; ranks below r_max are padded with
zeros, which add nothing. A step gives each token row up to two (slot, weight) pairs, the weight being the adapter's
alpha/r times its share (1, or the router's mix). The base matmul runs once for the batch; then the rows with
adapters, grouped by their pairs into tiles of up to 16 rows (`plan_tiles`), get w (x A^T) B added into the
projection's output, each tile reading its adapters once (backends/llm/lora_kernels.py on a GPU, a loop over the
tiles elsewhere). Rows without adapters cost nothing, and a step's cost follows the adapters it uses, not the slots.
The tiles live in fixed-size buffers and the kernels read their number on the device, so CUDA graphs captured once
stay valid while adapters come and go in the slots.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from backends.llm.adapters import LoraAdapter, projection_shapes
from backends.llm.model import ModelArgs

# the engine's fused projections and the PEFT modules they hold, in order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}
MIXED = 2  # adapters one row may combine (Top-2 routing)
TILE_ROWS = 16  # rows of a tile (the kernels' block of rows: tl.dot needs at least 16)


@dataclass
class LoraPlan:
    """A step's rows with adapters, tile after tile: perm [rows] (row indices), tiles [n, 4] (start in perm, rows,
    slot of adapter 0, slot of adapter 1), weights [n, MIXED] (0: no second adapter)."""

    perm: np.ndarray
    tiles: np.ndarray
    weights: np.ndarray


def plan_tiles(segments: Iterable[tuple[int, int, list[int], list[float]]]) -> LoraPlan:
    """Tiles of `segments` = (first row, rows, slots, weights) runs of rows with the same adapters. Rows with equal
    (slots, weights) share tiles, so one adapter's rows across sequences are read with its weights once a tile."""
    groups: dict[tuple, list[int]] = {}  # (slot, weight) pairs -> their rows
    for first, count, slots, weights in segments:
        pairs = [(s, w) for s, w in zip(slots, weights) if w]
        if pairs:
            groups.setdefault(tuple(pairs + [(0, 0.0)] * (MIXED - len(pairs))), []).extend(range(first, first + count))
    perm, tiles, weights = [], [], []
    for key, rows in groups.items():
        for start in range(0, len(rows), TILE_ROWS):
            tiles.append([len(perm) + start, min(TILE_ROWS, len(rows) - start)] + [s for s, _ in key])
            weights.append([w for _, w in key])
        perm += rows
    return LoraPlan(np.array(perm, np.int64), np.array(tiles, np.int64).reshape(-1, 2 + MIXED),
                    np.array(weights, np.float32).reshape(-1, MIXED))


@dataclass
class ProjectionSlots:
    """One projection's slots: a [parts, S, r_max, in], b [S, r_max, out] (the parts' columns side by side)."""

    a: torch.Tensor
    b: torch.Tensor
    widths: tuple[int, ...]

    def add_to(self, out: torch.Tensor, x: torch.Tensor, step: LoraStep) -> None:
        """out [T, out] += each tiled row's w (x A^T) B, in place."""
        if out.is_cuda:
            from backends.llm.lora_kernels import add_lora

            add_lora(out, x, self.a, self.b, self.widths, step.perm, step.tiles, step.weights, step.tile_count)
            return
        bounds = np.cumsum((0,) + self.widths)
        for (start, count, *slots), weights in zip(step.tiles[:int(step.tile_count)].tolist(), step.weights.tolist()):
            rows = step.perm[start:start + count]
            xs, delta = x[rows], torch.zeros(count, out.shape[1], dtype=out.dtype, device=out.device)
            for slot, weight in zip(slots, weights):
                for part in range(len(self.widths)) if weight else ():
                    cols = slice(bounds[part], bounds[part + 1])
                    delta[:, cols] += (weight * (xs @ self.a[part, slot].t())) @ self.b[slot, :, cols]
            out[rows] += delta


class LoraSlots:
    """`num_slots` adapters of rank up to `max_rank` on the device, for every layer and projection."""

    def __init__(self, args: ModelArgs, num_slots: int, max_rank: int, dtype: torch.dtype, device):
        shapes = projection_shapes(args)
        self.num_slots, self.max_rank, self.dtype = num_slots, max_rank, dtype
        self.layers: list[dict[str, ProjectionSlots]] = []
        for _ in range(args.num_hidden_layers):
            layer = {}
            for name, modules in PARTS.items():
                n_in = shapes[modules[0]][0]
                widths = tuple(shapes[m][1] for m in modules)
                layer[name] = ProjectionSlots(
                    torch.zeros(len(modules), num_slots, max_rank, n_in, dtype=dtype, device=device),
                    torch.zeros(num_slots, max_rank, sum(widths), dtype=dtype, device=device), widths)
            self.layers.append(layer)
        # PEFT module -> (fused projection, part, its first output column)
        self.where = {m: (name, p, sum(shapes[n][1] for n in modules[:p]))
                      for name, modules in PARTS.items() for p, m in enumerate(modules)}

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (what the slot held before is overwritten; untargeted projections become 0)."""
        for layer in self.layers:
            for projection in layer.values():
                projection.a[:, slot].zero_()
                projection.b[slot].zero_()
        for (index, module), (a, b) in adapter.weights.items():
            name, part, first = self.where[module]
            projection = self.layers[index][name]
            projection.a[part, slot, :adapter.rank].copy_(a, non_blocking=True)
            projection.b[slot, :adapter.rank, first:first + b.shape[0]].copy_(b.t(), non_blocking=True)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for layer in self.layers for p in layer.values())


@dataclass
class LoraStep:
    """The adapters of one step's token rows as tiles (see LoraPlan), on the step's device: perm, tiles and weights
    may be longer than needed (fixed buffers of a graph); tile_count [1] says how many tiles are in use."""

    slots: LoraSlots
    perm: torch.Tensor
    tiles: torch.Tensor
    weights: torch.Tensor
    tile_count: torch.Tensor

    def layer(self, index: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        """Projection name -> (out, x) -> out += its adapter products, for layer `index`."""
        return {name: functools.partial(projection.add_to, step=self)
                for name, projection in self.slots.layers[index].items()}
