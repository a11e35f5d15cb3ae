"""backends/llm/rope_cache.py (rotary embedding and cache write in one kernel) against the unfused ops it replaces,
and the engine's tokens with it. Triton's interpreter runs it on the CPU (tests/conftest.py), the compiled kernel on a
GPU."""
from __future__ import annotations

import pytest
import torch

from backends.llm.attention import write_kv
from backends.llm.kv_cache import allocate_kv_cache
from backends.llm.model import rotate

rope_cache = pytest.importorskip("backends.llm.rope_cache")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own numpy use


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 6, 32)])
def test_q_rotated_and_cache_written_as_the_unfused_ops(dtype, heads, kv_heads, head_dim):
    torch.manual_seed(heads + head_dim)
    tokens, block_size = 5, 4
    (kv,) = allocate_kv_cache(1, 6, block_size, kv_heads, head_dim, dtype, DEVICE)
    (expected_kv,) = allocate_kv_cache(1, 6, block_size, kv_heads, head_dim, dtype, DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim + 8, device=DEVICE).to(dtype)[:, 8:]  # strided rows
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    slots = torch.tensor([17, 4, 9, 23, 0], device=DEVICE)  # out of order, the scratch block's first slot too

    q = rope_cache.rope_write(qkv, cos, sin, kv, slots, heads, kv_heads, head_dim)
    q_ref, k, v = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref = rotate(q_ref.reshape(tokens, heads, head_dim), cos.float(), sin.float())  # in fp32, rounded once
    k = rotate(k.reshape(tokens, kv_heads, head_dim), cos.float(), sin.float())
    write_kv(expected_kv, k.to(dtype), v.reshape(tokens, kv_heads, head_dim).to(dtype), slots)
    # fp32: the GPU fuses multiply-adds (2e-7 apart on the H200); bf16: the interpreter truncates where the GPU rounds
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    assert q.shape == (tokens, heads, head_dim) and q.dtype == dtype
    torch.testing.assert_close(q.float(), q_ref.to(dtype).float(), **tolerance)
    torch.testing.assert_close(kv[0].float(), expected_kv[0].float(), **tolerance)
    assert torch.equal(kv[1], expected_kv[1])  # v copied as it is


def test_only_caches_of_the_activations_dtype_and_power_of_two_heads_fit():
    qkv = torch.zeros(2, 64)
    (kv,) = allocate_kv_cache(1, 2, 4, 2, 16, torch.float32, "cpu")
    assert rope_cache.fits(16, kv, qkv) and not rope_cache.fits(24, kv, qkv)
    assert not rope_cache.fits(16, (kv[0].to(torch.uint8), kv[1].to(torch.uint8)), qkv)  # an FP8 cache


def test_engine_decodes_the_same_tokens_with_the_fused_kernel():
    """Decode and cached-prefix steps attend through the cache the kernel wrote; fresh prompts keep the unfused path
    (their own keys): greedy tokens equal the unfused engine's, with a prefix-cache hit among the prompts."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.checkpoints import tiny_checkpoint
    from tests.conftest import ROOT

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    prompts = ["a photo of the cat on the red car by the tree", "a photo of the cat on the red car", "x"]

    def decode(fused: bool) -> list[list[int]]:
        engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device=DEVICE, kv_cache_memory_mb=8,
                                                    cuda_graphs=False, block_size=4))
        engine.model.kernels.rope_cache = fused
        calls = []
        original = rope_cache.rope_write
        rope_cache.rope_write = lambda *a: calls.append(1) or original(*a)
        try:
            out = [seq.output_ids for seq in engine.generate(prompts, SamplingParams(max_tokens=10))]
            out += [engine.generate([prompts[0]], SamplingParams(max_tokens=6))[0].output_ids]  # the cached prefix
        finally:
            rope_cache.rope_write = original
        assert bool(calls) == fused
        return out

    assert decode(True) == decode(False)
