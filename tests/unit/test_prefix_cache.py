"""Prefix caching (backends/llm/kv_cache.py): full KV blocks shared by requests with the same prefix, reference
counted, kept when unused and evicted least recently freed first; the engine's tokens unchanged by it, under
preemption and cancellation too."""
from __future__ import annotations

import pytest

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.kv_cache import BlockManager
from backends.llm.sampling import SamplingParams
from backends.llm.sequence import Sequence
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT


def sequence(tokens, **fields) -> Sequence:
    return Sequence(list(tokens), SamplingParams(), **fields)


def computed(blocks: BlockManager, seq: Sequence) -> Sequence:
    """What the engine does after a step: every token is cached, full blocks are registered."""
    seq.num_cached = seq.num_tokens
    blocks.register(seq)
    return seq


def test_a_shared_prefix_is_computed_once_and_its_blocks_return_when_unused():
    blocks = BlockManager(num_blocks=8, block_size=4)
    first = sequence(range(10))  # blocks [0..3] [4..7] [8 9]
    assert blocks.admit(first) and first.num_cached == 0 and len(first.block_table) == 3
    computed(blocks, first)
    second = sequence([*range(8), 42, 43, 44])
    assert blocks.admit(second)
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert second.num_cached == 8 and blocks.hit_tokens == 8
    assert [blocks.users[b] for b in second.block_table] == [2, 2, 1]
    prefix = first.block_table[:2]
    blocks.release(first)
    blocks.release(second)
    assert blocks.num_free == 8  # the KV gauge is back to idle; the prefix stays registered in the free pool
    third = sequence([*range(8), 9])
    assert blocks.admit(third) and third.num_cached == 8 and third.block_table[:2] == prefix


def test_the_block_of_the_last_prompt_token_is_always_computed():
    blocks = BlockManager(num_blocks=8, block_size=4)
    computed(blocks, blocks.admit(first := sequence(range(12))) and first)
    again = sequence(range(8))  # two full blocks, both cached: the second holds the token the step must compute
    assert blocks.admit(again) and again.num_cached == 4 and again.block_table[0] == first.block_table[0]
    assert again.block_table[1] != first.block_table[1]


def test_unregistered_blocks_are_reused_first_then_the_least_recently_freed():
    blocks = BlockManager(num_blocks=4, block_size=4)
    old, new = sequence(range(5)), sequence(range(100, 105))
    for seq in (old, new):
        assert blocks.admit(seq)
        computed(blocks, seq)
    old_prefix, new_prefix = old.block_keys[0], new.block_keys[0]
    blocks.release(old)
    blocks.release(new)  # their first blocks stay registered; their second blocks hold nothing registered
    assert blocks.admit(sequence(range(200, 208)))  # takes the two blocks holding nothing registered
    assert set(blocks.registered) == {old_prefix, new_prefix}
    assert blocks.admit(sequence(range(300, 304)))  # none left: evicts old's prefix, freed before new's
    assert set(blocks.registered) == {new_prefix} and blocks.num_free == 1


def test_a_pool_that_cannot_hold_the_sequence_changes_nothing():
    blocks = BlockManager(num_blocks=3, block_size=4)
    computed(blocks, blocks.admit(first := sequence(range(9))) and first)
    blocks.release(first)
    big = sequence([*range(8), *range(50, 60)])  # 2 cached blocks + 3 new > 3 free
    assert not blocks.admit(big)
    assert big.block_table == [] and big.num_cached == 0 and blocks.num_free == 3 and blocks.hit_tokens == 0


def test_image_blocks_hit_only_for_the_same_image():
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = [1, 2, 3, 4, 9, 9, 9, 9, 5, 6]  # the image's placeholders fill the second block

    def with_image(key: bytes) -> Sequence:
        return sequence(tokens, embed_positions=(4, 5, 6, 7), embeds_key=key)

    computed(blocks, blocks.admit(cat := with_image(b"cat")) and cat)
    dog = with_image(b"dog")
    assert blocks.admit(dog) and dog.num_cached == 4  # the text before the image is shared, the image is not
    assert blocks.admit(again := with_image(b"cat")) and again.num_cached == 8


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint("llm", ROOT / ".checkpoints")


SYSTEM = "the dog is on the grass and the person is in the tree with a blue car and a red car. "
QUESTIONS = ["a photo of the cat", "red car", "x", "tree tree tree", "it was a cat", "blue", "of", "the tree"]


def run(engine: LLMEngine, prompts: list[str], tokens: int = 16, cancel_after: int | None = None) -> list[list[int]]:
    seqs = [engine.add(p, SamplingParams(max_tokens=tokens)) for p in prompts]
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps == cancel_after:
            engine.cancel(seqs[1])
    return [s.output_ids for s in seqs]


def test_engine_tokens_are_the_same_with_prefix_caching(checkpoint, monkeypatch):
    """Prompts that find their prefix cached run the rest as rows of a decode step (on a GPU from its CUDA graphs;
    the prefill graphs take fresh prompts only)."""
    config = dict(dtype="fp32", device="cpu", kv_cache_memory_mb=8)
    plain = LLMEngine(checkpoint, EngineConfig(prefix_caching=False, **config))
    expected = [run(plain, [SYSTEM + q])[0] for q in QUESTIONS]
    cached = LLMEngine(checkpoint, EngineConfig(**config))
    prefilled = []
    monkeypatch.setattr(cached.runner, "prefill", lambda seqs, real=cached.runner.prefill: prefilled.extend(
        s.num_cached for s in seqs) or real(seqs))
    assert [run(cached, [SYSTEM + q])[0] for q in QUESTIONS] == expected  # one after another: later ones hit
    assert cached.blocks.hit_tokens >= 7 * 16 and plain.blocks.hit_tokens == 0
    assert prefilled == [0]  # the first prompt alone prefilled; the others' uncached tokens were decode rows
    assert run(cached, [SYSTEM + q for q in QUESTIONS]) == expected  # together, after the cache is warm
    assert cached.blocks.num_free == cached.blocks.num_blocks


def test_prefix_caching_under_chunked_prefill_preemption_and_cancellation(checkpoint):
    prompts = [SYSTEM + q for q in QUESTIONS]
    expected = run(LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", prefix_caching=False,
                                                      kv_cache_memory_mb=8)), prompts, tokens=20)
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", block_size=4, kv_cache_blocks=40,
                                                chunk_tokens=8))  # the crowd's prompts in chunks, beside decoders
    run(engine, prompts[:1], tokens=1)  # the shared prefix is cached before the crowd arrives
    found = run(engine, prompts, tokens=20, cancel_after=6)
    assert engine.scheduler.preemptions > 0 and engine.blocks.hit_tokens > 0
    assert [f for i, f in enumerate(found) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    assert found[1] == expected[1][:len(found[1])] and len(found[1]) < 20  # cancelled mid-way
    assert engine.blocks.num_free == 40
