"""backends/llm/fp8_gemm.py (FP8 weights, 16-bit inputs) against float64 products (Triton's interpreter on the CPU,
the kernel on a GPU)."""
from __future__ import annotations

import pytest
import torch

from backends.llm.fp8 import quantize_weight
from backends.llm.fp8_gemm import GemmConfig, default_config, fp8_weight_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [  # (M, N, K, config): one block, masked rows / columns / K, split-K with a short last span
    (3, 64, 128, GemmConfig(16, 32, 32, 1)),
    (17, 50, 100, GemmConfig(16, 32, 32, 1)),
    (5, 48, 200, GemmConfig(16, 16, 32, 3)),
    (40, 96, 256, GemmConfig(32, 32, 64, 2)),
    (17, 50, 100, GemmConfig(16, 64, 32, 1, swap=True)),  # the transposed product: masked, then split-K
    (40, 96, 256, GemmConfig(32, 64, 64, 2, swap=True)),
]


def operands(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight, scale = quantize_weight(torch.randn(n, k, generator=g) * 0.1)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    return x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE)


def reference(x, weight, scale, bias=None):
    out = x.double() @ (weight.double() * scale.double()).t()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("m,n,k,config", CASES)
def test_product_equals_the_dequantized_weights_product_in_fp32(m, n, k, config):
    x, weight, scale, bias = operands(m, n, k, torch.float32)
    for b in (None, bias):
        out = fp8_weight_matmul(x, weight, scale, b, config)
        assert out.dtype == torch.float32 and out.shape == (m, n)
        assert torch.allclose(out.double(), reference(x, weight, scale, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_are_rounded_once_at_the_end(dtype, swap):
    """The fp32 sum is scaled and rounded once: within one rounding of the output (the interpreter truncates to
    bf16 instead of rounding, hence the looser CPU bound)."""
    x, weight, scale, bias = operands(20, 96, 256, dtype)
    out = fp8_weight_matmul(x, weight, scale, bias, GemmConfig(32, 64, 64, 2, swap=swap))
    ref = reference(x, weight, scale, bias)
    assert out.dtype == dtype
    tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-3
    assert ((out.double() - ref).abs() <= tolerance * ref.abs() + 1e-2).all()


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, 1), GemmConfig(16, 64, 32, 3, swap=True)])
def test_fp8_inputs_with_row_scales_multiply_in_fp8(config):
    """W8A8: inputs quantized per token (fp8.quantize_tokens), both scales applied to the fp32 sum, then the bias."""
    from backends.llm.fp8 import quantize_tokens

    x, weight, scale, bias = operands(9, 50, 200, torch.float32)
    # Hopper's FP8 tensor cores keep fewer bits than fp32 in their sums (wgmma); the interpreter's are exact
    tolerance = 1e-3 if DEVICE == "cuda" else 1e-5
    per_tensor = x.abs().amax().reshape(1, 1) / 448
    for x_scale, b in ((None, None), (None, bias), (per_tensor.expand(9, 1), bias)):  # the last: a stride-0 view
        xq, x_scale = quantize_tokens(x, x_scale)
        out = fp8_weight_matmul(xq, weight, scale, b, config, x_scale=x_scale, out_dtype=torch.float32)
        ref = reference(xq.double() * x_scale.double(), weight, scale, b)
        assert out.dtype == torch.float32 and torch.allclose(out.double(), ref, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="input scale"):
        fp8_weight_matmul(xq, weight, scale, config=config, out_dtype=torch.float32)  # no scales for the rows


def test_default_configs_cover_the_rows():
    for m in (1, 16, 17, 33, 64, 65, 256):
        c = default_config(m, 4096, 4096)
        assert c.block_m >= min(m, 64) and c.block_m <= max(16, 2 * m)
    x, weight, scale, _ = operands(7, 32, 64, torch.float32)
    assert torch.allclose(fp8_weight_matmul(x, weight, scale).double(), reference(x, weight, scale), rtol=1e-5,
                          atol=1e-5)


def test_mismatched_operands_are_refused():
    x, weight, scale, _ = operands(4, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="fp8_weight_matmul"):
        fp8_weight_matmul(x[:, :32], weight, scale)
    with pytest.raises(ValueError, match="fp8_weight_matmul"):
        fp8_weight_matmul(x, weight.float(), scale)


def test_weights_only_engine_through_the_kernel_decodes_the_fallbacks_tokens(tmp_path, monkeypatch):
    """A weights-only FP8 engine whose multi-row steps (prefills, batched decode) run the kernel decodes, batched,
    what the dequantized fp32 product decodes (on the CPU in the interpreter, on a GPU inside the decode graphs)."""
    from backends.llm import fp8, fp8_gemm
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.fp8 import Fp8Scheme
    from backends.llm.sampling import SamplingParams
    from build_engines.checkpoints import tiny_checkpoint
    from build_engines.quantize import write_fp8_checkpoint
    from tests.conftest import ROOT

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    write_fp8_checkpoint(checkpoint, tmp_path / "w8a16", Fp8Scheme("channel", "none"))
    prompts = ["a photo of the cat", "x", "several words of a longer prompt here"]

    def decode() -> list[list[int]]:
        engine = LLMEngine(tmp_path / "w8a16", EngineConfig(dtype="fp32", device=DEVICE, kv_cache_memory_mb=8))
        return [s.output_ids for s in engine.generate(prompts, SamplingParams(max_tokens=12))]

    monkeypatch.setattr(fp8, "fp8_gemm_runs_on", lambda device: False)
    fallback = decode()
    rows = []
    monkeypatch.setattr(fp8, "fp8_gemm_runs_on", lambda device: True)
    monkeypatch.setattr(fp8_gemm, "fp8_weight_matmul",
                        lambda x, *a, **kw: rows.append(x.shape[0]) or fp8_weight_matmul(x, *a, **kw))
    assert decode() == fallback
    assert max(rows) > 8 and min(rows) <= 4  # the prompts' prefill and the batched decode steps ran it
