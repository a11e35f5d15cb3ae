"""FP8 E4M3 linear layers and the checkpoint layout they load from.

Weights are stored in float8_e4m3fn with a scale per output channel (a per-tensor scale is the same thing with equal
rows, which is also how fused q/k/v and gate/up projections keep each part's own scale); activations are quantized
per token at run time (dynamic), with one calibrated scale (static), or not at all (weights only, "W8A16": the
weights' bytes halved, the inputs kept in bf16). On Hopper and Ada, one-token steps run the
Triton kernel of gemv.py (the model's `project` routes them) and larger ones `torch._scaled_mm`; weights-only steps of
up to 256 rows run the Triton GEMM of fp8_gemm.py on any CUDA GPU; elsewhere the same
product is computed from the dequantized operands in fp32, so CPU tests check the arithmetic the GPU runs (up to the
order of the fp32 accumulation).

Checkpoints follow compressed-tensors' "float-quantized" format, which llm-compressor writes and vLLM reads:
`<linear>.weight` in float8_e4m3fn, `<linear>.weight_scale` ([out, 1] per channel or [1] per tensor),
`<linear>.input_scale` for static activations, and a `quantization_config` in config.json. An FP8 KV cache (the
config's `kv_cache_scheme`) takes one calibrated scale per layer for keys and one for values:
`self_attn.k_scale`, `self_attn.v_scale`.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or token still gets a usable scale


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's linear layers are quantized (compressed-tensors' names)."""

    weights: str = "channel"  # "channel" or "tensor"
    activations: str = "token"  # "token" (dynamic), "tensor" (static, calibrated input_scale) or "none" (weights only)
    ignore: tuple[str, ...] = ("lm_head",)
    kv_cache: bool = False  # keys and values stored in E4M3 with a per-tensor scale per layer

    @classmethod
    def from_config(cls, quantization_config: dict | None) -> Fp8Scheme | None:
        """The scheme of a compressed-tensors float-quantized config; None for an unquantized checkpoint."""
        if not quantization_config:
            return None
        method, fmt = quantization_config.get("quant_method"), quantization_config.get("format")
        if method != "compressed-tensors" or fmt != "float-quantized":
            raise ValueError(f"quantization {method!r} / {fmt!r} is not supported; FP8 checkpoints in "
                             "compressed-tensors' float-quantized format are")
        groups = list(quantization_config["config_groups"].values())
        if len(groups) != 1:
            raise ValueError(f"{len(groups)} quantization groups; one (all Linear layers) is supported")
        weights, inputs = groups[0]["weights"], groups[0].get("input_activations")
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or \
                (inputs and (inputs.get("type"), inputs.get("num_bits")) != ("float", 8)):
            raise ValueError("only 8-bit float weights and activations are supported")
        activations = "none" if not inputs else "token" if inputs.get("dynamic", True) else "tensor"
        ignore = tuple(quantization_config.get("ignore", ()))
        if any("lm_head" not in pattern for pattern in ignore):
            raise ValueError(f"ignore {list(ignore)}: only the LM head may stay unquantized")
        kv = quantization_config.get("kv_cache_scheme")
        if kv and (kv.get("type"), kv.get("num_bits"), kv.get("strategy"), kv.get("dynamic", False)) != \
                ("float", 8, "tensor", False):
            raise ValueError(f"kv_cache_scheme {kv}: only 8-bit float with static per-tensor scales is supported")
        return cls(weights["strategy"], activations, ignore, bool(kv))

    @property
    def calibrated(self) -> bool:
        """Whether the scheme has static scales that come from calibration (activations, KV cache)."""
        return self.activations == "tensor" or self.kv_cache

    def quantizes(self, name: str) -> bool:
        """Whether the layer `name` ("" for a decoder projection, "lm_head") is FP8."""
        return not any(name and (p == name or (p.startswith("re:") and re.fullmatch(p[3:], name))) for p in self.ignore)

    def to_config(self) -> dict:
        kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(self.ignore),
                "kv_cache_scheme": kv if self.kv_cache else None,
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": self.weights, "symmetric": True,
                                "dynamic": False},
                    "input_activations": None if self.activations == "none" else {
                        "num_bits": 8, "type": "float", "strategy": self.activations, "symmetric": True,
                        "dynamic": self.activations == "token"}}}}


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to E4M3 (saturating at +-448)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def weight_scale(weight: torch.Tensor, strategy: str) -> torch.Tensor:
    """[out, 1] for "channel", [1] for "tensor": the largest magnitude maps to 448."""
    amax = weight.abs().float().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().float().amax()[None]
    return (amax / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_weight(weight: torch.Tensor, strategy: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight_scale(weight, strategy)
    return quantize(weight, scale.view(-1, 1) if scale.numel() > 1 else scale), scale


def token_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token activation scales [T, 1]."""
    return (x.abs().float().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_tokens(x: torch.Tensor, x_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] in E4M3 and their scales [T, 1]: per token, or the given static ones. The model's
    `Kernels.compiled()` makes this one fused kernel on the GPU instead of six."""
    x_scale = token_scales(x) if x_scale is None else x_scale
    return quantize(x, x_scale), x_scale


@functools.cache
def scaled_mm_available(device: torch.device) -> bool:
    """Once per device: every linear layer of every step asks."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


FP8_GEMM_MAX_ROWS = 256  # weights-only steps of up to this many rows run backends/llm/fp8_gemm.py on a GPU
W8A8_GEMM_MAX_ROWS = 0  # W8A8 steps of up to this many rows run it too, on FP8 inputs (0: cuBLAS' _scaled_mm, which
# was faster on the H200 from 32 rows on, 2026-12-05; perf.llm_engine's `w8a8gemm` variants set it)


@functools.cache
def fp8_gemm_runs_on(device: torch.device) -> bool:
    """Whether backends/llm/fp8_gemm.py (Triton) runs weights-only FP8 products on `device`."""
    if device.type != "cuda":
        return False
    try:
        import backends.llm.fp8_gemm  # noqa: F401
    except ImportError:
        return False
    return True


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in E4M3 and per-row scales, x quantized per token, with a static scale, or not at all
    (`activations` "token", "tensor", "none")."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activations: str = "token",
                 quantize_inputs=quantize_tokens):
        super().__init__()
        self.quantize_inputs, self.activations = quantize_inputs, activations
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1), requires_grad=False)
        self.input_scale = nn.Parameter(torch.zeros(()), requires_grad=False) if activations == "tensor" else None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = self.quantized_input(x)
        if x_scale is None and x.shape[0] <= FP8_GEMM_MAX_ROWS and fp8_gemm_runs_on(x.device):
            from backends.llm.fp8_gemm import fp8_weight_matmul  # weights only: our GEMM reads them as E4M3

            return fp8_weight_matmul(x, self.weight, self.weight_scale, self.bias)
        if x_scale is not None and x.shape[0] <= W8A8_GEMM_MAX_ROWS and fp8_gemm_runs_on(x.device):
            from backends.llm.fp8_gemm import fp8_weight_matmul

            return fp8_weight_matmul(xq, self.weight, self.weight_scale, self.bias, x_scale=x_scale,
                                     out_dtype=x.dtype)
        if x_scale is None and x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16):
            # weights only, a long step (bound by arithmetic): E4M3 values are exact in x's dtype, so cuBLAS
            # multiplies them as they are; scale after
            return self.finish(F.linear(x, self.weight.to(x.dtype)).float() * self.weight_scale.view(-1), x.dtype)
        if x_scale is not None and scaled_mm_available(x.device) and x.dtype == torch.bfloat16 and \
                self.in_features % 16 == 0 == self.out_features % 16:  # cuBLAS' FP8 GEMM: dimensions multiples of 16
            return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale.contiguous(),
                                    scale_b=self.weight_scale.view(1, -1), out_dtype=x.dtype,
                                    bias=None if self.bias is None else self.bias.to(x.dtype))  # cuBLAS: bf16 only
        return self.finish(self.computed_input(x, (xq, x_scale)) @ (self.weight.float() * self.weight_scale).t(),
                           x.dtype)

    def quantized_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x in E4M3, its scales [T, 1]) as the scheme quantizes it, or (x, None) for weights only."""
        if self.activations == "none":
            return x, None
        return self.quantize_inputs(x, None if self.input_scale is None else self.input_scale.expand(x.shape[0], 1))

    def computed_input(self, x: torch.Tensor, quantized: tuple | None = None) -> torch.Tensor:
        """x as the product sees it, in fp32 (GPTQ's Hessians are made of these): `quantized_input(x)`, scaled back."""
        xq, x_scale = quantized or self.quantized_input(x)
        return xq.float() if x_scale is None else xq.float() * x_scale

    def finish(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (out if self.bias is None else out + self.bias.float()).to(dtype)
