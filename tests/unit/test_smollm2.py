"""The trained SmolLM2-135M-Instruct, imported from its GGUF file: our engine's greedy answers to chat prompts equal
transformers `generate` on the same converted checkpoint, alone and in one batch, and end at its end-of-turn token."""
from __future__ import annotations

import json

import pytest
import torch

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.sampling import SamplingParams
from tests.unit.greedy import run_cancelling

QUESTIONS = ["What is the capital of France?", "Write a haiku about GPUs.", "List three primary colors.",
             "How many legs does a spider have?", "Say hello in Spanish.", "What is 2 + 3?"]
TOKENS = 48


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


@pytest.fixture(scope="module")
def chats(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(smollm2_checkpoint, tokenizer, chats) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    out = []
    for chat in chats:
        ids = tokenizer(chat, return_tensors="pt")
        with torch.inference_mode():
            tokens = model.generate(**ids, max_new_tokens=TOKENS, do_sample=False)[0, ids.input_ids.shape[1]:]
        out.append(tokens.tolist())
    return out


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint) -> LLMEngine:
    return LLMEngine(smollm2_checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=64))


def test_the_gguf_became_an_ordinary_checkpoint(smollm2_checkpoint, tokenizer, chats):
    config = json.loads((smollm2_checkpoint / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == ("llama", 30, 576, 9, 3, 49152)
    assert "quantization_config" not in config
    assert chats[0].endswith("<|im_start|>assistant\n")  # its own chat template came along
    templated = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True)
    assert tokenizer(chats[0])["input_ids"] == list(templated["input_ids"])  # the engine tokenises the same way


def test_greedy_answers_equal_transformers_alone_and_batched(engine, chats, expected, tokenizer):
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in engine.eos_ids
    batched = engine.generate(chats, SamplingParams(max_tokens=TOKENS))
    for chat, seq, reference in zip(chats, batched, expected):
        ends = reference[-1] == end_of_turn
        assert seq.output_ids == (reference[:-1] if ends else reference), chat
        assert seq.finish_reason == ("stop" if ends else "length")
        assert "<|im_end|>" not in seq.text
    hits = engine.blocks.hit_tokens
    alone = engine.generate([chats[0]], SamplingParams(max_tokens=TOKENS))[0]  # its prompt's blocks are cached now
    assert alone.output_ids == batched[0].output_ids and engine.blocks.hit_tokens > hits
    assert sum(seq.finish_reason == "stop" for seq in batched) >= 4  # a trained model ends its turns
    assert "Paris" in batched[0].text


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_greedy_answers(smollm2_checkpoint, chats, expected, tokenizer, proposer,
                                                       tmp_path_factory):
    """On the trained model, with prompt lookup and with a draft cut from its first 8 layers (untrained: it is rarely
    right, which exercises the rollback): the same answers as transformers, all six chats at once in a 10-block KV
    cache (too small: sequences are preempted and recomputed) and one of them cancelled midway; every block comes
    back. With prompt lookup, most steps add more than one token where the answer quotes the prompt."""
    from build_engines.draft import truncated_draft

    config = {"speculative": proposer}
    if proposer == "draft":
        config["draft_model"] = str(truncated_draft(smollm2_checkpoint, tmp_path_factory.mktemp("draft"), 8))
    engine = LLMEngine(smollm2_checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_blocks=10, **config))
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    seqs = [engine.add(chat, SamplingParams(max_tokens=TOKENS)) for chat in chats]
    cancelled = seqs[3]
    run_cancelling(engine, cancelled, at_step=8)
    assert engine.scheduler.preemptions > 0 and engine.stats.proposed_tokens > 50
    for chat, seq, reference in zip(chats, seqs, expected):
        reference = reference[:-1] if reference[-1] == end_of_turn else reference
        if seq is cancelled:
            assert seq.finish_reason == "cancelled" and seq.output_ids == reference[:len(seq.output_ids)]
        else:
            assert seq.output_ids == reference, chat
    assert engine.blocks.num_free == engine.blocks.num_blocks
    if proposer == "draft":
        assert engine.proposer.blocks.num_free == engine.proposer.blocks.num_blocks and not engine.proposer.shadows
    if proposer == "ngram":
        quote = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat this sentence exactly: the quick "
                                                "brown fox jumps over the lazy dog near the river bank."}],
                                              add_generation_prompt=True, tokenize=False)
        before = engine.stats.accepted_tokens, engine.stats.decode_steps
        seq = engine.generate([quote], SamplingParams(max_tokens=TOKENS))[0]
        assert "quick brown fox jumps over the lazy dog" in seq.text
        accepted, steps = engine.stats.accepted_tokens - before[0], engine.stats.decode_steps - before[1]
        assert accepted >= len(seq.output_ids) / 2 and steps < len(seq.output_ids) * 0.6, (accepted, steps)
