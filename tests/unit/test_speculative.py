"""Speculative decoding changes nothing the model would have said: greedy tokens equal the plain engine's and
transformers' (both proposers, concurrent batches, preemption, cancellation), and sampled tokens follow the model's
distribution (chi-square), which a wrong acceptance rule fails."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.sampling import SamplingParams, probabilities
from backends.llm.speculative import NgramProposer, accept, next_length
from build_engines.checkpoints import tiny_checkpoint
from tests.unit.greedy import run_cancelling, transformers_greedy
from build_engines.draft import truncated_draft

# repetitive prompts, so prompt lookup finds its suffixes; and the tiny random models repeat themselves
PROMPTS = ["the cat sat on the red car and the cat sat on the", "tree tree tree tree", "a photo of the dog",
           "red car blue car red car blue car red", "x", "it was a cat that sat on the red car by the tree", "of",
           "blue blue red blue blue red blue blue"]
SIGNIFICANCE = 1e-3
ROOT = Path(__file__).resolve().parents[2]  # (not tests.conftest: these tests also run alone on a GPU host)


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of `counts` against probabilities `expected` (cells with mass only)."""
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the model gives no probability was drawn"
    n, e = counts[keep].double(), expected[keep].double() * counts.sum()
    stat = ((n - e) ** 2 / e).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def resample_from_p(p, q, drafts, uniforms):
    """A wrong rule (a common mistake): after a rejection, draw from p instead of the residual max(0, p - q)."""
    accepted, _ = accept(p, q, drafts, uniforms)
    final = p[torch.arange(len(drafts)), accepted]
    cdf = final.cumsum(1)
    return accepted, torch.searchsorted(cdf, uniforms[:, -1:] * cdf[:, -1:], right=True)[:, 0]


def emitted(rule, p, q, drafts, uniforms, position: int) -> torch.Tensor:
    """Token emitted at `position` (0 or 1) by each trial that reached it; -1 where it stopped before."""
    accepted, token = rule(p, q, drafts, uniforms)
    k = drafts.shape[1]
    out = torch.full((len(drafts),), -1)
    reached = accepted >= position
    at = torch.where(accepted > position, drafts[:, min(position, k - 1)], token)
    out[reached] = at[reached]
    return out


@pytest.mark.parametrize("proposer", ["model", "point"])
@pytest.mark.parametrize("rule, exact", [(accept, True), (resample_from_p, False)])
def test_rejection_rule_keeps_the_target_distribution(proposer, rule, exact):
    trials, vocab, k = 200_000, 8, 2
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(vocab, generator=gen) ** 3
    p = torch.stack([p / p.sum(), torch.rand(vocab, generator=gen).softmax(0), torch.ones(vocab) / vocab])
    if proposer == "model":  # a draft that disagrees with the target, drawing its proposals from q
        q = torch.rand(k, vocab, generator=gen).pow(2)
        q = q / q.sum(-1, keepdim=True)
        drafts = torch.multinomial(q, trials, replacement=True, generator=gen).T
        q_rows = q.expand(trials, k, vocab)
    else:  # prompt lookup: fixed tokens, a likely one and an unlikely one
        drafts, q_rows = torch.tensor([[int(p[0].argmax()), int(p[1].argmin())]]).expand(trials, k), None
    uniforms = torch.rand(trials, k + 1, generator=gen)
    ps = p.expand(trials, k + 1, vocab)
    for position in (0, 1):  # the first token, and the second where the first was an accepted proposal
        tokens = emitted(rule, ps, q_rows, drafts, uniforms, position)
        counts = torch.bincount(tokens[tokens >= 0], minlength=vocab)
        assert counts.sum() > 10_000
        p_value = chi_square_p(counts, p[position])
        if exact:
            assert p_value > SIGNIFICANCE, (position, counts.tolist())
        elif position == 0:
            assert p_value < 1e-12  # the wrong rule is caught at the first position already


def test_next_length_grows_after_full_acceptance_and_shrinks_otherwise():
    assert next_length(4, 4, 4, 8) == 6 and next_length(7, 7, 7, 8) == 8
    assert next_length(4, 4, 1, 8) == 3 and next_length(1, 1, 0, 8) == 1
    assert next_length(3, 0, 0, 8) == 3  # nothing proposed: nothing learnt


def test_prompt_lookup_takes_the_latest_longest_match():
    lookup = NgramProposer(1, 3).lookup
    import numpy as np
    assert lookup(np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]), 3) == [7, 8, 1]  # the later of two matches
    assert lookup(np.array([5, 6, 4, 6, 1, 2, 6]), 2) == [1, 2]  # longest suffix first: [6] alone
    assert lookup(np.array([1, 2, 3]), 2) == []
    assert lookup(np.array([4, 5, 4]), 4) == [5, 4]  # what follows, up to the end


@pytest.fixture(scope="module", params=["llm", "qwen2"])
def checkpoint(request):
    return tiny_checkpoint(request.param, ROOT / ".checkpoints")


@pytest.fixture(scope="module")
def draft(checkpoint, tmp_path_factory):
    """A one-layer draft cut from the model: it agrees often, not always."""
    out = tmp_path_factory.mktemp("draft")
    truncated_draft(checkpoint, out, layers=1)
    return out


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers_greedy(checkpoint)


def make_engine(checkpoint, draft=None, **overrides) -> LLMEngine:
    config = {"dtype": "fp32", "device": "cpu", "kv_cache_memory_mb": 8, **overrides}
    if draft is not None:
        config.update(speculative="draft", draft_model=str(draft))
    return LLMEngine(checkpoint, EngineConfig(**config))


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_with_speculation_is_the_models_argmax_path(checkpoint, draft, reference, proposer):
    engine = make_engine(checkpoint, draft if proposer == "draft" else None,
                         **({"speculative": "ngram"} if proposer == "ngram" else {}))
    seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=40))
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_ids == reference(prompt, 40), prompt
    s = engine.stats
    assert s.speculated > 0 and 0 < s.accepted_tokens < s.proposed_tokens  # proposals were made, kept and refused
    assert s.decode_steps < s.generated_tokens - len(PROMPTS)  # fewer steps than tokens: speculation paid
    assert engine.blocks.num_free == engine.blocks.num_blocks
    if proposer == "draft":
        assert engine.proposer.blocks.num_free == engine.proposer.blocks.num_blocks and not engine.proposer.shadows


def test_the_model_as_its_own_draft_is_always_right(checkpoint):
    """The shadow caches' bookkeeping: a draft equal to the model proposes exactly the model's greedy tokens."""
    engine = make_engine(checkpoint, checkpoint.resolve(), speculative_schedule="fixed", num_speculative_tokens=5)
    engine.generate(PROMPTS, SamplingParams(max_tokens=40))
    s = engine.stats
    assert s.accepted_tokens == s.proposed_tokens > 0 and s.decode_steps <= 40 / 6 + 1


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_under_preemption_and_cancellation_keeps_tokens_and_frees_blocks(checkpoint, draft, proposer):
    plain = make_engine(checkpoint).generate(PROMPTS, SamplingParams(max_tokens=40))
    # a KV cache too small for all eight at once: sequences are preempted and recomputed
    engine = make_engine(checkpoint, draft if proposer == "draft" else None, kv_cache_blocks=14,
                         **({"speculative": "ngram"} if proposer == "ngram" else {}))
    seqs = [engine.add(p, SamplingParams(max_tokens=40)) for p in PROMPTS]
    cancelled = seqs[2]
    run_cancelling(engine, cancelled, at_step=6)
    assert engine.scheduler.preemptions > 0 and engine.stats.accepted_tokens > 0
    for seq, expected in zip(seqs, plain):
        if seq is cancelled:
            assert seq.finish_reason == "cancelled" and seq.output_ids == expected.output_ids[:len(seq.output_ids)]
        else:
            assert seq.output_ids == expected.output_ids
    assert engine.blocks.num_free == engine.blocks.num_blocks
    if proposer == "draft":
        assert engine.proposer.blocks.num_free == engine.proposer.blocks.num_blocks


def test_speculation_stops_at_max_tokens_stop_strings_and_min_tokens(checkpoint, draft):
    plain, spec = make_engine(checkpoint), make_engine(checkpoint, draft, num_speculative_tokens=6)
    for sampling in (SamplingParams(max_tokens=7), SamplingParams(max_tokens=30, min_tokens=12),
                     SamplingParams(max_tokens=30, stop=("car",))):
        expected = plain.generate(PROMPTS, sampling)
        got = spec.generate(PROMPTS, sampling)
        assert [s.output_ids for s in got] == [s.output_ids for s in expected]
        assert [s.text for s in got] == [s.text for s in expected]
        assert [s.finish_reason for s in got] == [s.finish_reason for s in expected]


def test_speculation_turns_off_above_its_batch_limit(checkpoint):
    engine = make_engine(checkpoint, speculative="ngram", speculative_max_batch=4)
    engine.generate(PROMPTS, SamplingParams(max_tokens=4))  # eight at once: none speculates
    assert engine.stats.speculated == 0
    engine.generate(PROMPTS[:4], SamplingParams(max_tokens=12))
    assert engine.stats.speculated > 0


def test_sampled_tokens_follow_the_models_distribution(checkpoint, draft):
    """The joint distribution of the first two sampled tokens (the second from a verified proposal) against the
    exact one from transformers' logits, top-k 3 keeping it to nine cells."""
    from transformers import AutoModelForCausalLM

    prompt, sampling = "the cat sat on", SamplingParams(max_tokens=3, temperature=1.5, top_k=3)
    # (prompts riding decode steps would make most steps run without speculation: a step with riders does)
    engine = make_engine(checkpoint, draft, max_batch=64, speculative_max_batch=64, num_speculative_tokens=2,
                         prompt_rows=0)
    ids = engine.tokenizer(prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        first = probabilities(model(torch.tensor([ids])).logits[0, -1:], [sampling])[0]
        cells = {}
        for a in first.nonzero()[:, 0].tolist():
            second = probabilities(model(torch.tensor([ids + [a]])).logits[0, -1:], [sampling])[0]
            for b in second.nonzero()[:, 0].tolist():
                cells[a, b] = float(first[a] * second[b])
    seqs = [engine.add(ids, sampling) for _ in range(3000)]
    while engine.has_work:
        engine.step()
    assert engine.stats.speculated > 1000 and engine.stats.accepted_tokens < engine.stats.proposed_tokens
    index = {cell: i for i, cell in enumerate(cells)}
    counts = torch.zeros(len(cells) + 1, dtype=torch.int64)
    for seq in seqs:
        counts[index.get(tuple(seq.output_ids[:2]), len(cells))] += 1
    expected = torch.tensor([*cells.values(), 0.0])
    assert chi_square_p(counts, expected / expected.sum()) > SIGNIFICANCE, counts.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the paged decode kernel need a GPU")
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_on_the_gpu_verify_steps_replay_the_decode_graphs_with_the_same_tokens(checkpoint, proposer):
    cuda = dict(dtype="fp32", device="cuda", kv_cache_memory_mb=64)  # fp32: no bf16 rounding between step shapes
    plain = LLMEngine(checkpoint, EngineConfig(**cuda)).generate(PROMPTS, SamplingParams(max_tokens=40))
    spec = {"speculative": "ngram"} if proposer == "ngram" else {"speculative": "draft",
                                                                  "draft_model": str(checkpoint.resolve())}
    engine = LLMEngine(checkpoint, EngineConfig(**cuda, **spec))
    graphs = len(engine.runner.graphs)
    seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=40))
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    assert engine.stats.accepted_tokens > 0 and len(engine.runner.graphs) == graphs  # no capture while serving
