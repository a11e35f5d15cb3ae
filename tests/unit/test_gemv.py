"""backends/llm/gemv.py against float64 references of the unfused ops (Triton's interpreter on the CPU, the kernel on
a GPU)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from backends.llm.fp8 import FP8, Fp8Scheme, quantize_tokens, quantize_weight
from backends.llm.gemv import WORKSPACE, GemvConfig, gemv
from backends.llm.model import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [GemvConfig(16, 32, 1, 4), GemvConfig(16, 32, 2, 4, 2), GemvConfig(8, 16, 4, 2, 2), GemvConfig(32, 64, 1, 4)]
SHAPES = [(48, 64), (50, 70), (64, 128), (33, 100)]  # (N, K): with and without masks, split-K spans left over


def reference(x, weight, weight_scale=None, bias=None, norm=None, gated=False, residual=None):
    """The unfused ops in x's dtype, the product in float64 (of the E4M3-quantized input for FP8 weights)."""
    if norm is not None:
        x = rms_norm(x, *norm)
    if weight.dtype == FP8:
        xq, x_scale = quantize_tokens(x, None)
        out = (xq.double() * x_scale.double()) @ (weight.double() * weight_scale.double()).t()
    else:
        out = x.double() @ weight.double().t()
    out = (out + (0 if bias is None else bias.double())).to(x.dtype)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out if residual is None else residual + out


def operands(n, k, fp8, dtype, gated, normed, with_residual, with_bias, rows=2):
    """n output features: a weight of 2n rows, [gate | up], when `gated`."""
    g = torch.Generator().manual_seed(n * k)
    weight = torch.randn(2 * n if gated else n, k, generator=g) * 0.1
    weight, scale = quantize_weight(weight) if fp8 else (weight.to(dtype), None)
    x = torch.randn(rows, k, generator=g).to(dtype)
    norm = ((torch.rand(k, generator=g) + 0.5).to(dtype).to(DEVICE), 1e-5) if normed else None
    residual = torch.randn(rows, n, generator=g).to(dtype).to(DEVICE) if with_residual else None
    bias = torch.randn(weight.shape[0], generator=g).to(DEVICE) if with_bias else None
    return (x.to(DEVICE), weight.to(DEVICE), None if scale is None else scale.to(DEVICE), bias), \
        dict(norm=norm, gated=gated, residual=residual)


@pytest.mark.parametrize("shape,config", list(zip(SHAPES, CONFIGS)))
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_computes_the_unfused_layer_in_fp32(shape, config, fp8):
    """fp32 activations: every prologue/epilogue, split-K and masking combination gives the reference product."""
    for fusion, with_residual, with_bias in itertools.product(["none", "norm", "gated", "norm+gated"], [False, True],
                                                               [False, True]):
        if "gated" in fusion and with_residual:
            continue  # (refused: test_mismatched_operands_are_refused)
        (x, w, scale, bias), fused = operands(*shape, fp8, torch.float32, "gated" in fusion, "norm" in fusion,
                                              with_residual, with_bias)
        out = gemv(x, w, scale, None, bias, config=config, **fused)
        ref = reference(x, w, scale, bias, **fused)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert torch.allclose(out.double(), ref.double(), rtol=1e-5, atol=1e-5), (fusion, with_residual, with_bias)


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_rounds_bf16_as_the_unfused_ops(fp8):
    """bf16: the fused RMSNorm / SiLU(gate) * up / residual give what the unfused model computes, within bf16 rounding
    (and, for FP8, an E4M3 step where a rounding difference moves an input across a boundary). Triton's interpreter
    truncates to bf16 instead of rounding, so on the CPU each rounding step may be one unit further off."""
    tolerance = 3e-2 if fp8 else 4e-3 if DEVICE == "cuda" else 2.5e-2
    for fusion, with_residual in [("none", False), ("none", True), ("norm", False), ("norm", True), ("gated", False),
                                  ("norm+gated", False)]:
        (x, w, scale, _), fused = operands(64, 128, fp8, torch.bfloat16, "gated" in fusion, "norm" in fusion,
                                           with_residual, False)
        out = gemv(x, w, scale, config=CONFIGS[1], **fused)
        ref = reference(x, w, scale, **fused)
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert ((out.double() - ref.double()).norm() / ref.double().norm()).item() < tolerance, fusion


def test_static_input_scale_is_used_as_given():
    (x, w, scale, _), _ = operands(48, 64, True, torch.float32, False, False, False, False)
    x_scale = torch.tensor(0.05, device=DEVICE)
    out = gemv(x, w, scale, x_scale, config=CONFIGS[0])
    xq = (x / x_scale).clamp(-448, 448).to(FP8).double() * 0.05
    ref = xq @ (w.double() * scale.double()).t()
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_weights_only_fp8_leaves_the_input_as_it_is():
    """quantize_input=False (weights-only FP8): the input times the dequantized weights, with the fused RMSNorm."""
    (x, w, scale, bias), fused = operands(48, 64, True, torch.float32, False, True, True, True)
    out = gemv(x, w, scale, None, bias, False, config=CONFIGS[1], **fused)
    ref = rms_norm(x, *fused["norm"]).double() @ (w.double() * scale.double()).t() + bias.double()
    assert torch.allclose(out.double(), fused["residual"].double() + ref, rtol=1e-5, atol=1e-5)


def test_e4m3_rounding_equals_torchs_cast():
    """The kernel rounds inputs to E4M3 in fp32 arithmetic (the interpreter's own fp8 cast mis-rounds): every E4M3
    value, every midpoint between neighbours (ties to even), subnormals and random values round as torch's cast."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    positive = grid[grid >= 0]
    midpoints = (positive[1:] + positive[:-1]) / 2
    values = torch.cat([grid, midpoints, -midpoints, torch.randn(4096) * 30, torch.randn(1024) * 0.01,
                        torch.tensor([448.0, -448.0, 1e-12, -1e-12, 0.0])]).clamp(-448, 448)
    n, k = values.numel(), 64
    padded = torch.zeros(-(-n // k) * k)
    padded[:n] = values
    x = padded.view(-1, k).to(DEVICE)  # times an identity weight at scale 1: the quantized inputs come out as they are
    eye, ones = torch.eye(k).to(FP8).to(DEVICE), torch.ones(k, 1, device=DEVICE)
    x_scale = torch.tensor(1.0, device=DEVICE)
    out = gemv(x, eye, ones, x_scale, config=GemvConfig(16, 32, 1, 4)).flatten()[:n].cpu()
    assert torch.equal(out, values.to(FP8).float())


def test_every_e4m3_weight_value_is_decoded_exactly():
    """All 254 finite E4M3 bytes (subnormals and -0 among them) as weights, times one-hot inputs at scale 1: each
    comes out as torch's value for it."""
    bytes_ = torch.arange(256, dtype=torch.uint8)
    finite = bytes_[bytes_.view(FP8).float().isfinite()]
    k = 32
    weight = torch.zeros(-(-finite.numel() // k) * k, dtype=torch.uint8)
    weight[:finite.numel()] = finite
    weight = weight.view(-1, k).view(FP8).to(DEVICE)
    x, ones = torch.eye(k, device=DEVICE), torch.ones(weight.shape[0], 1, device=DEVICE)
    out = gemv(x, weight, ones, torch.tensor(1.0, device=DEVICE), config=GemvConfig(8, 32, 1, 4))
    assert torch.equal(out.t().cpu(), weight.float().cpu())


def test_split_k_counters_are_reset_and_results_repeat():
    (x, w, scale, _), _ = operands(50, 70, True, torch.float32, False, False, False, False)
    first = gemv(x, w, scale, config=CONFIGS[2])
    second = gemv(x, w, scale, config=CONFIGS[2])
    assert torch.equal(first, second)
    locks = [t for held in WORKSPACE.buffers.values() for t in held if t.dtype == torch.int32]
    assert locks and all(int(t.abs().sum()) == 0 for t in locks)


def test_mismatched_operands_are_refused():
    (x, w, scale, _), _ = operands(48, 64, True, torch.float32, False, False, False, False)
    with pytest.raises(ValueError, match="gemv"):
        gemv(x, w, None)
    with pytest.raises(ValueError, match="gemv"):
        gemv(x[:, :32], w, scale)
    with pytest.raises(ValueError, match="gated"):  # SiLU(gate) * up has no residual add
        gemv(x, w, scale, gated=True, residual=torch.zeros(x.shape[0], 24, device=DEVICE))


@pytest.mark.parametrize("fp8", [None, "token", "none", "none+head"])
def test_one_token_steps_through_the_kernel_decode_the_unfused_models_tokens(fp8, tmp_path, monkeypatch):
    """The engine with its one-token steps routed through the kernel (norms, SiLU(gate) * up and residuals fused; the LM
    head too) decodes what the unfused model decodes, in fp32: on the CPU in the interpreter, on a GPU inside the
    decode CUDA graphs."""
    from backends.llm import gemv as gemv_module
    from backends.llm import model
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.checkpoints import tiny_checkpoint
    from build_engines.quantize import write_fp8_checkpoint
    from tests.conftest import ROOT

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    if fp8:  # FP8 activations per token, or FP8 weights only (+head: the LM head's too, --fp8-lm-head)
        activations, _, head = fp8.partition("+")
        write_fp8_checkpoint(checkpoint, tmp_path / "fp8", Fp8Scheme("channel", activations,
                                                                     () if head else ("lm_head",)))
        checkpoint = tmp_path / "fp8"
    prompts = ["a photo of the cat", "x"]

    def decode() -> list[list[int]]:
        engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device=DEVICE, kv_cache_memory_mb=8))
        return [engine.generate([p], SamplingParams(max_tokens=6))[0].output_ids for p in prompts]

    unfused = decode()
    calls = []
    monkeypatch.setattr(model, "GEMV_DTYPES", (torch.float32,))
    monkeypatch.setattr(model, "gemv_runs_on", lambda device, fp8: True)
    monkeypatch.setattr(gemv_module, "gemv", lambda *a, **kw: calls.append((a, kw)) or gemv(*a, **kw))
    assert decode() == unfused
    assert {kw["gated"] for _, kw in calls} == {True, False} and any(kw["norm"] for _, kw in calls)
    assert any(kw["residual"] is not None for _, kw in calls)
    vocab = model.ModelArgs.from_checkpoint(checkpoint).vocab_size
    heads = {a[1].dtype for a, _ in calls if a[1].shape[0] == vocab}  # the LM head's GEMVs
    assert heads == ({torch.float8_e4m3fn} if fp8 and fp8.endswith("+head") else {torch.float32})
