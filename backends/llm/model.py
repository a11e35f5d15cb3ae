"""Decoder-only transformer (Llama and Qwen2 families) over the engine's paged KV cache.

Tokens of a step arrive flattened ([T] ids, [T] positions); `AttentionMetadata` says which sequence each belongs
to and where its keys live. The weights load straight from a Hugging Face checkpoint's safetensors (q/k/v and
gate/up fused on load, so a step runs two matmuls per attention block and two per MLP). The linear layers come from
`make_linear`: plain `torch.nn.Linear`, or `Fp8Linear` for an FP8 checkpoint (backends/llm/fp8.py). LoRA adapters
are not part of the model: a step hands `forward` its rows' adapters (backends/llm/lora.py), and each projection adds
their products to its output.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn

from backends.llm.attention import AttentionMetadata, paged_attention, varlen_causal, write_kv
from backends.llm.fp8 import FP8, Fp8Linear, Fp8Scheme, quantize_tokens, scaled_mm_available

if TYPE_CHECKING:
    from backends.llm.lora import LoraStep

GEMV_MAX_ROWS = 1  # steps of one token run their linear layers through backends/llm/gemv.py on a GPU
GEMV_DTYPES = (torch.bfloat16, torch.float16)

SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelArgs:
    """What the engine needs from config.json (Hugging Face names)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_checkpoint(cls, path: Path) -> ModelArgs:
        """From config.json through transformers (defaults filled in); a multimodal checkpoint's text model."""
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path).get_text_config()
        if c.model_type not in SUPPORTED:
            raise ValueError(f"{path}: model_type {c.model_type!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED)})")
        heads = c.num_attention_heads
        eos = c.eos_token_id
        return cls(c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers, heads,
                   c.num_key_value_heads or heads, getattr(c, "head_dim", None) or c.hidden_size // heads,
                   c.rms_norm_eps, c.max_position_embeddings, bool(c.tie_word_embeddings),
                   getattr(c, "attention_bias", c.model_type == "qwen2"),
                   tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]))


def make_linear(in_features: int, out_features: int, bias: bool, kernels: Kernels, fp8: Fp8Scheme | None = None,
                name: str = "") -> nn.Module:
    """The seam for FP8 linear layers: FP8 where the checkpoint's scheme quantizes this layer."""
    if fp8 is not None and fp8.quantizes(name):
        return Fp8Linear(in_features, out_features, bias, fp8.activations, kernels.quantize_tokens)
    return nn.Linear(in_features, out_features, bias=bias)


def gemv_operands(linear: nn.Module, x: torch.Tensor, kernels: Kernels) -> tuple | None:
    """(weight, weight_scale, input_scale, bias, quantize_input) where backends/llm/gemv.py runs `linear` at `x`'s
    rows, else None: one-token steps of plain or FP8 linear layers, on a GPU with Triton (FP8 from compute capability
    8.9)."""
    if not kernels.gemv or x.shape[0] > GEMV_MAX_ROWS or x.dtype not in GEMV_DTYPES:
        return None
    fp8 = isinstance(linear, Fp8Linear)
    if not (fp8 or type(linear) is nn.Linear) or not gemv_runs_on(x.device, fp8):
        return None
    from backends.llm.gemv import MAX_K

    if linear.in_features > MAX_K:
        return None
    return (linear.weight, linear.weight_scale, linear.input_scale, linear.bias, linear.activations != "none") if fp8 \
        else (linear.weight, None, None, linear.bias, False)


@functools.cache
def gemv_runs_on(device: torch.device, fp8: bool) -> bool:
    if device.type != "cuda" or (fp8 and not scaled_mm_available(device)):
        return False
    try:
        import backends.llm.gemv  # noqa: F401  (Triton)
    except ImportError:
        return False
    return True


def project(linear: nn.Module, x: torch.Tensor, kernels: Kernels, norm: RMSNorm | None = None, gated: bool = False,
            residual: torch.Tensor | None = None,
            lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None, early: bool = False) -> torch.Tensor:
    """g(linear(f(x)) (+ adapters(f(x)))) (+ residual), f = the RMSNorm `norm` or nothing, g = SiLU(gate) * up of the
    output's halves (`gated`) or nothing: one GEMV kernel with its neighbours fused where gemv_operands allows, else
    the separate ops (linear's forward sees its own input). With adapters, f(x) is made once for both products, and
    `lora(out, f(x))` adds theirs into the output before g and the residual (PEFT's order). `early`: gemv's (after
    attention)."""
    if lora is not None:
        x = x if norm is None else norm(x)
        out = project(linear, x, kernels)
        lora(out, x)
    elif (operands := gemv_operands(linear, x, kernels)) is not None:
        from backends.llm.gemv import gemv

        return gemv(x, *operands, norm=None if norm is None else (norm.weight, norm.eps), gated=gated,
                    residual=residual, early=early)
    else:
        out = linear(x if norm is None else norm(x))
    out = kernels.silu_mul(out) if gated else out
    return out if residual is None else residual + out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's: normalise in fp32, scale in the model dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split layout (Hugging Face's rotate_half). x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


class Kernels:
    """The elementwise pieces of a layer. `compiled()` gives torch.compile'd versions (one fused kernel each instead
    of five to ten small ones; worth it on GPU, where a decode step is mostly such kernels). `gemv`: whether
    one-token steps may run their projections through gemv.py (see `project`); `rope_cache`: whether steps that
    attend through the cache rotate q and k and write the cache in one kernel (rope_cache.py; on by `compiled()`)."""

    rms_norm, rotate, silu_mul = staticmethod(rms_norm), staticmethod(rotate), staticmethod(silu_mul)
    quantize_tokens = staticmethod(quantize_tokens)  # FP8 layers' activations

    def __init__(self, gemv: bool = True, rope_cache: bool = False):
        self.gemv, self.rope_cache = gemv, rope_cache

    @classmethod
    def compiled(cls, gemv: bool = True) -> Kernels:
        kernels = cls(gemv, rope_cache=True)
        for name in ("rms_norm", "rotate", "silu_mul", "quantize_tokens"):
            setattr(kernels, name, torch.compile(getattr(cls, name), dynamic=True))
        return kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.kernels = eps, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.kernels = kernels
        self.heads, self.kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = make_linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.attention_bias, kernels, fp8)
        self.o_proj = make_linear(self.q_size, args.hidden_size, False, kernels, fp8)
        self.fp8_kv_cache = fp8 is not None and fp8.kv_cache
        if self.fp8_kv_cache:  # the checkpoint's per-layer scales
            self.k_scale = nn.Parameter(torch.ones(()), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones(()), requires_grad=False)

    @property
    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.k_scale, self.v_scale) if self.fp8_kv_cache else None

    def forward(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """Rotary, the cache write and attention over the q/k/v projection's output: [T, heads * head_dim], the
        input of o_proj (DecoderLayer runs the projections, so it can fuse their neighbours)."""
        if self.kernels.rope_cache and meta.varlen is None and self.kv_scales is None:
            from backends.llm import rope_cache

            if rope_cache.fits(self.head_dim, kv, qkv):
                q = rope_cache.rope_write(qkv, cos, sin, kv, meta.slot_mapping, self.heads, self.kv_heads,
                                          self.head_dim)
                return paged_attention(q, kv, meta).reshape(-1, self.q_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.kernels.rotate(q.view(-1, self.heads, self.head_dim), cos, sin)
        k = self.kernels.rotate(k.view(-1, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(-1, self.kv_heads, self.head_dim)
        write_kv(kv, k, v, meta.slot_mapping, self.kv_scales)
        if meta.varlen is not None:  # fresh prompts: their own keys and values (see attention.py)
            return varlen_causal(q, k, v, *meta.varlen).reshape(-1, self.q_size)
        return paged_attention(q, kv, meta, self.kv_scales).reshape(-1, self.q_size)


class MLP(nn.Module):
    """The MLP's projections (checkpoint names mlp.*); DecoderLayer runs them: down(SiLU(gate) * up)."""

    def __init__(self, args: ModelArgs, kernels: Kernels, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.gate_up_proj = make_linear(args.hidden_size, 2 * args.intermediate_size, False, kernels, fp8)
        self.down_proj = make_linear(args.intermediate_size, args.hidden_size, False, kernels, fp8)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels, fp8: Fp8Scheme | None = None, index: int = 0):
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.self_attn = Attention(args, kernels, fp8)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.mlp = MLP(args, kernels, fp8)
        self.kernels = kernels

    def forward(self, x, cos, sin, kv, meta, lora: LoraStep | None = None):
        attn, mlp, kernels = self.self_attn, self.mlp, self.kernels
        delta = {} if lora is None else lora.layer(self.index)  # projection name -> its adapter products
        qkv = project(attn.qkv_proj, x, kernels, norm=self.input_layernorm, lora=delta.get("qkv_proj"))
        x = project(attn.o_proj, attn(qkv, cos, sin, kv, meta), kernels, residual=x, lora=delta.get("o_proj"),
                    early=True)
        hidden = project(mlp.gate_up_proj, x, kernels, norm=self.post_attention_layernorm, gated=True,
                         lora=delta.get("gate_up_proj"))  # SiLU(gate) * up
        return project(mlp.down_proj, hidden, kernels, residual=x, lora=delta.get("down_proj"))


class DecoderModel(nn.Module):
    def __init__(self, args: ModelArgs, kernels: Kernels | None = None, fp8: Fp8Scheme | None = None):
        super().__init__()
        self.args = args
        kernels = kernels or Kernels()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, kernels, fp8, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, kernels)
        self.lm_head = make_linear(args.hidden_size, args.vocab_size, False, kernels, fp8, "lm_head")
        self.kernels = kernels
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)

    def set_rope(self, hf_config) -> None:
        """cos/sin tables for every position, from transformers' own rotary code (any rope_type it supports)."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rope = LlamaRotaryEmbedding(hf_config)
        positions = torch.arange(self.args.max_position_embeddings, dtype=torch.float32)
        freqs = positions[:, None] * rope.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        self.cos = (angles.cos() * rope.attention_scaling).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * rope.attention_scaling).to(device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                lora: LoraStep | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the step (logits are computed only where they are read).
        `embeds` = (token indices, rows): input embeddings that replace those tokens' (image features); `lora`: the
        rows' adapters."""
        return self.layers_forward(self.embed(input_ids, embeds), positions, kv_cache, meta, lora)

    def embed(self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        return x

    def layers_forward(self, x: torch.Tensor, positions: torch.Tensor,
                       kv_cache: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                       lora: LoraStep | None = None) -> torch.Tensor:
        """`forward` from the input embeddings on (what a prefill graph captures)."""
        return self.norm(self.run_layers(x, self.rope(positions), kv_cache, meta, lora))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]

    def run_layers(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   kv_cache: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                   lora: LoraStep | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Layers [start, stop) (a decode graph may be captured in pieces, backends/llm/runner.py)."""
        for layer, kv in zip(self.layers[start:stop], kv_cache[start:stop]):
            x = layer(x, *rope, kv, meta, lora)
        return x

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return FP8 if self.layers[0].self_attn.fp8_kv_cache else self.embed_tokens.weight.dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(self.lm_head, hidden, self.kernels).float()


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a checkpoint's safetensors files, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


TEXT_MODEL_PARTS = ("embed_tokens", "layers", "norm", "lm_head")
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_model(path: Path, dtype: torch.dtype, device: str | torch.device,
               tensors: Iterable[tuple[str, torch.Tensor]] | None = None, compile_kernels: bool = False,
               gemv: bool = True) -> DecoderModel:
    """Build the model on `device` from config.json and copy the weights in (Hugging Face names; q/k/v and gate/up
    fused on the way). `tensors` defaults to the checkpoint's safetensors; a live transformers model's
    `named_parameters()` works too (benchmarks with random weights). `compile_kernels`, `gemv`: see `Kernels`."""
    from transformers import AutoConfig

    path = Path(path)
    args = ModelArgs.from_checkpoint(path)
    fp8 = Fp8Scheme.from_config(json.loads((path / "config.json").read_text()).get("quantization_config"))
    with torch.device("meta"):
        model = DecoderModel(args, Kernels.compiled(gemv) if compile_kernels else Kernels(gemv), fp8)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    for name, param in params.items():  # FP8 weights and their fp32 scales keep their types
        if name.endswith("input_scale"):
            param.data.zero_()  # the largest of the fused parts' scales is taken below
        elif param.dtype != FP8 and not name.endswith("_scale"):
            param.data = param.data.to(dtype)
    loaded: set[tuple[str, int]] = set()
    for key, tensor in checkpoint_tensors(path) if tensors is None else tensors:
        parts = key.removeprefix("language_model.").removeprefix("model.").split(".")
        if parts[0] not in TEXT_MODEL_PARTS:  # a multimodal checkpoint's vision tower and projector
            continue
        if len(parts) > 3 and parts[-2] in FUSED:
            target, shard = FUSED[parts[-2]]
            name = ".".join([*parts[:-2], target, parts[-1]])
            if name.endswith("input_scale"):  # one static scale for the fused input: the parts' largest
                params[name].data = torch.maximum(params[name].data, tensor.float().reshape(()).to(device))
            else:
                sizes = _shard_sizes(args, target, params[name].shape[0])
                start = sum(sizes[:shard])
                params[name].data[start:start + sizes[shard]].copy_(tensor)  # a per-tensor scale fills its rows
        else:
            name, shard = ".".join(parts), 0
            if name not in params:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            scalar = name.endswith(("input_scale", "k_scale", "v_scale"))
            params[name].data.copy_(tensor.reshape(params[name].shape) if scalar else tensor)
        loaded.add((name, shard))
    if ("lm_head.weight", 0) not in loaded:  # tied embeddings
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add(("lm_head.weight", 0))
    expected = {(n, s) for n in params for s in range(3 if "qkv_proj" in n else 2 if "gate_up" in n else 1)}
    if missing := sorted(expected - loaded):
        raise ValueError(f"{path}: checkpoint lacks {[n for n, _ in missing[:5]]}{' ...' if len(missing) > 5 else ''}")
    model.set_rope(AutoConfig.from_pretrained(path).get_text_config())
    return model.eval()


def _shard_sizes(args: ModelArgs, target: str, total: int) -> list[int]:
    if target == "qkv_proj":
        q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
        return [q, kv, kv]
    return [total // 2, total // 2]
