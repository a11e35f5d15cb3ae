"""LoRA in the engine: adapters' weights in fixed device slots, and the product that adds them to a mixed batch.

Each of a layer's projections holds, for every slot, A [r_max, in] per part (q|k|v and gate|up are fused in the
engine, so their parts are stacked) and B [r_max, out] per part; ranks below r_max are padded with zeros, which add
nothing. A step gives each token row up to two (slot, weight) pairs, the weight being the adapter's alpha/r times its
share (1, or the router's mix); rows without an adapter have weight 0. The layer then adds, for every row,
sum over slots of W[row, slot] * (x A_slot^T) B_slot: one matmul over all slots' A, a mask of the rows' weights, one
matmul per part over all slots' B added in place into the projection's output. So the base matmul runs once for the
batch, any mix of adapters shares a step, and the shapes never change: CUDA graphs captured once stay valid while
adapters come and go in the slots.

Computing every slot for every row costs `slots` times the arithmetic of one adapter (small beside the base matmul
at ranks up to 64) and reads every slot's weights each step, used or not.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from backends.llm.adapters import LoraAdapter, projection_shapes
from backends.llm.model import ModelArgs

# the engine's fused projections and the PEFT modules they hold, in order
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}
MIXED = 2  # adapters one row may combine (Top-2 routing)


@dataclass
class ProjectionSlots:
    """One projection's slots: a [parts, S, r_max, in], b[part] [S, r_max, out_part]."""

    a: torch.Tensor
    b: list[torch.Tensor]

    def add_to(self, out: torch.Tensor, x: torch.Tensor, mix: torch.Tensor) -> None:
        """out [T, out] += each row's adapter products, weighted by mix [T, S]. The parts' products
        are added into their column ranges of `out` in place, so a projection costs 2 + parts kernels."""
        parts, slots, rank, n_in = self.a.shape
        xa = (x @ self.a.view(-1, n_in).t()).view(-1, parts, slots, rank) * mix[:, None, :, None]
        xa = xa.view(-1, parts, slots * rank)
        start = 0
        for p, b in enumerate(self.b):
            width = b.shape[-1]
            out[:, start:start + width].addmm_(xa[:, p], b.view(slots * rank, width))
            start += width


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
                layer[name] = ProjectionSlots(
                    torch.zeros(len(modules), num_slots, max_rank, n_in, dtype=dtype, device=device),
                    [torch.zeros(num_slots, max_rank, shapes[m][1], dtype=dtype, device=device) for m in modules])
            self.layers.append(layer)
        self.where = {m: (name, p) for name, modules in PARTS.items() for p, m in enumerate(modules)}

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (what the slot held before is overwritten; untargeted projections become 0)."""
        for layer in self.layers:
            for projection in layer.values():
                projection.a[:, slot].zero_()
                for b in projection.b:
                    b[slot].zero_()
        for (index, module), (a, b) in adapter.weights.items():
            name, part = self.where[module]
            projection = self.layers[index][name]
            projection.a[part, slot, :adapter.rank].copy_(a, non_blocking=True)
            projection.b[part][slot, :adapter.rank].copy_(b.t(), non_blocking=True)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + sum(b.nbytes for b in p.b) for layer in self.layers for p in layer.values())


@dataclass
class LoraStep:
    """The adapters of one step's token rows: slots [T, MIXED] and weights [T, MIXED] (0: no adapter)."""

    slots: LoraSlots
    rows_slot: torch.Tensor
    rows_weight: torch.Tensor

    def __post_init__(self):
        # [T, S]: every row's weight per slot, made once per step and shared by every projection
        self.mix = torch.zeros(self.rows_slot.shape[0], self.slots.num_slots, device=self.rows_slot.device,
                               dtype=torch.float32).scatter_add_(1, self.rows_slot, self.rows_weight)
        self.mix = self.mix.to(self.slots.dtype)

    def layer(self, index: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        """Projection name -> (out, x) -> out += its adapter products, for layer `index`."""
        return {name: functools.partial(projection.add_to, mix=self.mix)
                for name, projection in self.slots.layers[index].items()}
