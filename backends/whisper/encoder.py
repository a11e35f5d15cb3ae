"""Whisper's encoder on transformers' own weights, with fewer passes over memory than WhisperEncoder.forward.

transformers' encoder layer runs q, k and v as three projections, scales q in a kernel of its own, copies q, k and v
into heads-first tensors and attention's output back, and adds, clamps and normalises in separate kernels: joining 16
clips on an H100 spent 61 of its 136 ms of kernels in copies and elementwise kernels against 52 in GEMMs
(perf/results/h100/2026-12-07d-whisper-steps.md). Here q, k and v come from one projection and reach attention as
views of it (attention's `scale` instead of scaling q: exact, as Whisper's head size of 64 makes the scale 1/8),
attention's output reaches out_proj as a view, and each residual add runs with the fp16 clamp and the next LayerNorm
in one compiled kernel (`compiled`, on a GPU). The arithmetic is WhisperEncoder's, so the encoder states equal its
up to rounding (tests/unit/test_whisper.py). On that H100 a 16-clip join then took 104.6 against 138.1 ms
(perf/results/h100/2026-12-07e-whisper-steps.md). The joined q/k/v weights are a copy (large-v3: 315 MB).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


def add_norm(hidden: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
             clamp: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after `update` (clamped to +-clamp as WhisperEncoderLayer does in fp16) and its
    LayerNorm, the next sublayer's input."""
    hidden = hidden + update
    if clamp is not None:
        hidden = hidden.clamp(-clamp, clamp)
    return hidden, F.layer_norm(hidden, hidden.shape[-1:], weight, bias, eps)


class FusedEncoder:
    """`encoder(features)` = WhisperEncoder's last_hidden_state for mel features [clips, mels, 2 * frames]."""

    def __init__(self, encoder: nn.Module, compiled: bool = False):
        self.encoder = encoder
        self.layers = list(encoder.layers)
        self.heads = self.layers[0].self_attn.num_heads
        # q, k and v in one projection (k has no bias: zeros in its place), made once from the weights
        self.qkv = [(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                     torch.cat([a.q_proj.bias, torch.zeros_like(a.q_proj.bias), a.v_proj.bias]))
                    for a in (layer.self_attn for layer in self.layers)]
        self.add_norm: Callable = torch.compile(add_norm, dynamic=True) if compiled else add_norm

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        encoder = self.encoder
        x = F.gelu(encoder.conv2(F.gelu(encoder.conv1(features))))
        hidden = x.permute(0, 2, 1) + encoder.embed_positions.weight
        clips, frames, width = hidden.shape
        clamp = torch.finfo(hidden.dtype).max - 1000 if hidden.dtype == torch.float16 else None
        first = self.layers[0].self_attn_layer_norm
        normed = F.layer_norm(hidden, (width,), first.weight, first.bias, first.eps)
        for i, (layer, (qkv_weight, qkv_bias)) in enumerate(zip(self.layers, self.qkv)):
            attn = layer.self_attn
            qkv = F.linear(normed, qkv_weight, qkv_bias).view(clips, frames, 3, self.heads, width // self.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [clips, heads, frames, head size] views
            out = F.scaled_dot_product_attention(q, k, v, scale=attn.scaling)
            out = attn.out_proj(out.transpose(1, 2).reshape(clips, frames, width))
            norm = layer.final_layer_norm
            hidden, normed = self.add_norm(hidden, out, norm.weight, norm.bias, norm.eps, None)
            out = layer.fc2(layer.activation_fn(layer.fc1(normed)))
            norm = self.layers[i + 1].self_attn_layer_norm if i + 1 < len(self.layers) else encoder.layer_norm
            hidden, normed = self.add_norm(hidden, out, norm.weight, norm.bias, norm.eps, clamp)
        return normed
