"""The Triton paged decode kernel (backends/llm/paged_decode.py) against the gather + SDPA reference: ragged
lengths, block boundaries, GQA ratios, shuffled block tables, padded rows. On the CPU Triton's interpreter runs it
(TRITON_INTERPRET, set by tests/conftest.py); on a GPU (perf/gpu_bench.sh) the compiled kernel, bf16 and an FP8
cache too."""
from __future__ import annotations

import pytest
import torch

from backends.llm.attention import AttentionMetadata, paged_attention, write_kv
from backends.llm.fp8 import FP8
from backends.llm.kv_cache import allocate_kv_cache

paged_decode = pytest.importorskip("backends.llm.paged_decode")  # interpreted on the CPU (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own numpy use


def decode_case(lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                width: int | None = None, kv_dtype: torch.dtype | None = None, seed: int = 0):
    """Caches holding random keys/values of sequences of `lengths` tokens in shuffled blocks; the decode metadata of
    their newest tokens (block tables padded to `width` with the scratch block, as a CUDA-graph bucket pads them)."""
    torch.manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    width = width or max(needed)
    (kv,) = allocate_kv_cache(1, sum(needed), block_size, kv_heads, head_dim, kv_dtype or dtype, DEVICE)
    order = (torch.randperm(sum(needed)) + 1).tolist()  # block 0 is the scratch block
    tables, slots, first = [], [], 0
    for n, count in zip(lengths, needed):
        table = order[first:first + count]
        first += count
        tables.append(table + [0] * (width - count))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
    k = torch.randn(len(slots), kv_heads, head_dim, device=DEVICE) * 2
    v = torch.randn(len(slots), kv_heads, head_dim, device=DEVICE)
    scales = (torch.tensor(0.02, device=DEVICE), torch.tensor(0.01, device=DEVICE)) if kv_dtype == FP8 else None
    write_kv(kv, k.to(dtype), v.to(dtype), torch.tensor(slots, device=DEVICE), scales)
    q = torch.randn(len(lengths), heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.tensor([[n - 1] for n in lengths], device=DEVICE)
    meta = AttentionMetadata(torch.zeros(len(lengths), dtype=torch.int64, device=DEVICE),
                             torch.tensor(tables, dtype=torch.int32, device=DEVICE), positions, None,
                             width * block_size)
    return q, kv, meta, scales


def kernel_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping, meta.block_tables, meta.query_positions, None, meta.max_context_len,
                             decode_kernel=paged_decode.paged_decode_attention)


@pytest.mark.parametrize("lengths,heads,kv_heads,head_dim,block_size", [
    ([1, 15, 16, 17, 40], 4, 4, 16, 16),  # block boundaries, no GQA
    ([33, 7], 9, 3, 64, 16),  # SmolLM2's GQA 9/3, head_dim 64
    ([70, 1, 129], 8, 1, 32, 8),  # MQA, small blocks, several partitions of TOKENS keys
    ([20, 3], 6, 2, 80, 16),  # a head_dim that is not a power of two
])
@pytest.mark.parametrize("programs", [512, 1])  # several partitions combined by the last program; one partition
def test_kernel_equals_the_gather_reference(lengths, heads, kv_heads, head_dim, block_size, programs, monkeypatch):
    monkeypatch.setattr(paged_decode, "TARGET_PROGRAMS", programs)
    assert (paged_decode.partitions(len(lengths), kv_heads, 32 * block_size) == 1) == (programs == 1)
    q, kv, meta, _ = decode_case(lengths, heads, kv_heads, head_dim, block_size, torch.float32, width=32)
    expected = paged_attention(q.view(-1, heads, head_dim), kv, meta)
    for _ in range(2):  # the second call finds the counters the first one reset
        found = paged_attention(q.view(-1, heads, head_dim), kv, kernel_meta(meta))
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)


def test_strided_partitions_walk_several_chunks_each(monkeypatch):
    """2 partitions of a 129-key context: chunks 0, 2, 4 and 1, 3 of TOKENS keys; 3 keys: one partition writes."""
    monkeypatch.setattr(paged_decode, "TARGET_PROGRAMS", 6)
    lengths = [129, 64, 3]
    assert paged_decode.partitions(len(lengths), 1, 32 * 8) == 2
    q, kv, meta, _ = decode_case(lengths, 8, 1, 32, 8, torch.float32, width=32)
    expected = paged_attention(q, kv, meta)
    for _ in range(2):
        torch.testing.assert_close(paged_attention(q, kv, kernel_meta(meta)), expected, rtol=1e-5, atol=1e-5)


def test_partitions_follow_the_batch_and_the_widest_context():
    assert paged_decode.partitions(1, 8, 16384) == paged_decode.TARGET_PROGRAMS // 8
    assert paged_decode.partitions(1, 8, 256) == 256 // paged_decode.TOKENS  # a chunk each at most
    assert paged_decode.partitions(16, 8, 4096) == 16 and paged_decode.partitions(64, 8, 4096) == 4
    assert paged_decode.partitions(1, 3, 16) == 1 and paged_decode.partitions(4096, 8, 4096) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 and FP8 kernels on a GPU (perf/gpu_bench.sh runs them)")
@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_bf16_and_fp8_cache_kernel_on_gpu(kv_dtype):
    q, kv, meta, scales = decode_case([1, 300, 4095, 17], 32, 8, 128, 16, torch.bfloat16, width=256,
                                      kv_dtype=kv_dtype)
    expected = paged_attention(q, kv, meta, scales).float()
    found = paged_attention(q, kv, kernel_meta(meta), scales).float()
    torch.testing.assert_close(found, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine uses the kernel on CUDA (perf/gpu_bench.sh runs this)")
def test_engine_decodes_the_same_with_the_kernel_in_its_cuda_graphs():
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.checkpoints import tiny_checkpoint
    from tests.conftest import ROOT

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    prompts, params = ["a photo of the cat", "red car", "hello there"], SamplingParams(max_tokens=40, min_tokens=40)
    outputs = [[s.output_ids for s in LLMEngine(checkpoint, EngineConfig(
        dtype="fp32", device="cuda", decode_attention=kind, kv_cache_memory_mb=64)).generate(prompts, params)]
        for kind in ("paged", "gather")]
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(DEVICE != "cuda", reason="the engine's GPU paths (perf/gpu_bench.sh runs this)")
def test_engine_tokens_equal_with_prefix_caching_and_chunked_prefill_on_gpu():
    """Cached prefixes (prefill by sequence after them) and mixed steps (prompt chunks beside decoding sequences,
    the decoding ones through the paged kernel) give the tokens of the plain engine."""
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.checkpoints import tiny_checkpoint
    from tests.conftest import ROOT

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    system = "the dog is on the grass and the person is in the tree with a blue car and a red car. "
    prompts = [system + q for q in ("a photo of the cat", "red car", "x", "tree tree tree", "blue")]
    params = SamplingParams(max_tokens=24, min_tokens=24)
    config = dict(dtype="fp32", device="cuda", kv_cache_memory_mb=64, block_size=4)
    plain = LLMEngine(checkpoint, EngineConfig(prefix_caching=False, **config))
    expected = [plain.generate([p], params)[0].output_ids for p in prompts]
    engine = LLMEngine(checkpoint, EngineConfig(chunk_tokens=8, **config))
    first = engine.add(prompts[0], params)
    engine.step()  # decoding from now on: the others prefill in chunks beside it, after its cached prefix
    rest = [engine.add(p, params) for p in prompts[1:]]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in [first, *rest]] == expected
    assert engine.blocks.hit_tokens > 0 and engine.stats.prefill_steps > 2  # the four prompts' rest took 2+ steps


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch on a GPU (perf/gpu_bench.sh runs this)")
def test_engine_decodes_the_same_with_attention_launched_early(monkeypatch):
    """gemv.PDL_ATTENTION: the rotary + cache write kernel, this kernel and o_proj's GEMV launched with PDL, each
    waiting for the kernel before it ahead of its reads, inside the decode CUDA graphs (bf16: the GEMVs run): the same
    tokens as launched plainly."""
    from backends.llm import gemv
    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.llm.sampling import SamplingParams
    from build_engines.checkpoints import tiny_checkpoint
    from tests.conftest import ROOT

    checkpoint = tiny_checkpoint("llm", ROOT / ".checkpoints")
    prompts, params = ["a photo of the cat", "red car", "hello there"], SamplingParams(max_tokens=40, min_tokens=40)
    outputs = []
    for early in (False, True):
        monkeypatch.setattr(gemv, "PDL_ATTENTION", early)
        engine = LLMEngine(checkpoint, EngineConfig(dtype="bf16", device="cuda", kv_cache_memory_mb=64))
        outputs.append([[s.output_ids for s in engine.generate([p], params)] for p in prompts])  # batch 1: GEMVs
    assert outputs[0] == outputs[1]
