"""The LLM engine against transformers on the same tiny checkpoints: greedy tokens identical alone and batched,
under preemption, after cancellation; sampling, stop strings, min_tokens and input limits."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.core.errors import InvalidInput
from backends.llm.attention import AttentionMetadata, paged_attention, varlen_causal, write_kv
from backends.llm.detokenizer import pending_text
from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.runner import ModelRunner
from backends.llm.sampling import SamplingParams
from backends.llm.wait_queue import WaitQueue
from build_engines.checkpoints import tiny_checkpoint
from tests.conftest import ROOT
from tests.unit.greedy import transformers_greedy

PROMPTS = ["a photo of the cat", "red car", "the dog is on the grass and the person is in the tree with a blue car",
           "x", "tree tree tree", "it was a cat that sat on the red car by the tree", "blue", "of"]


@pytest.fixture(scope="module", params=["llm", "qwen2"])
def checkpoint(request):
    return tiny_checkpoint(request.param, ROOT / ".checkpoints")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers_greedy(checkpoint)


def make_engine(checkpoint, **overrides) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(**{"dtype": "fp32", "device": "cpu", "kv_cache_memory_mb": 8,
                                                 **overrides}))


def test_greedy_batch_of_mixed_lengths_equals_transformers(checkpoint, reference):
    engine = make_engine(checkpoint)
    seqs = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    for prompt, seq in zip(PROMPTS, seqs):
        assert seq.output_ids == reference(prompt, 24), prompt
        assert seq.text == engine.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    assert engine.stats.max_decode_batch == len(PROMPTS)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_long_contexts_leave_the_fixed_shape_path_with_the_same_tokens(checkpoint, reference):
    # graphs cover 16 tokens of context here: longer decode steps run the eager path
    engine = make_engine(checkpoint, graph_max_context=16)
    seqs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=24))
    assert [s.output_ids for s in seqs] == [reference(p, 24) for p in PROMPTS[:3]]


def test_32_concurrent_sequences_equal_their_solo_runs(checkpoint):
    prompts = [PROMPTS[i % len(PROMPTS)] + " the" * (i % 5) for i in range(32)]
    lengths = [4 + (i * 7) % 29 for i in range(32)]
    solo = []
    for prompt, n in zip(prompts, lengths):
        engine = make_engine(checkpoint)
        solo.append(engine.generate([prompt], SamplingParams(max_tokens=n))[0].output_ids)
    engine = make_engine(checkpoint)
    seqs = [engine.add(p, SamplingParams(max_tokens=n)) for p, n in zip(prompts, lengths)]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == solo
    assert engine.stats.max_decode_batch == 32 and engine.stats.decode_tokens > engine.stats.decode_steps


def test_preempted_sequences_recompute_to_the_same_tokens(checkpoint, reference):
    # 12 blocks of 4 tokens cannot hold 8 sequences growing to ~30 tokens: decode steps must preempt
    engine = make_engine(checkpoint, block_size=4, kv_cache_blocks=12)
    seqs = engine.generate(PROMPTS[:4] + PROMPTS[6:], SamplingParams(max_tokens=16))
    assert engine.scheduler.preemptions > 0
    for prompt, seq in zip(PROMPTS[:4] + PROMPTS[6:], seqs):
        assert seq.output_ids == reference(prompt, 16), prompt
    assert engine.blocks.num_free == 12


def test_cancel_frees_blocks_at_once_and_others_continue(checkpoint, reference):
    engine = make_engine(checkpoint)
    keep, drop = engine.add(PROMPTS[0], SamplingParams(max_tokens=20)), engine.add(PROMPTS[2], SamplingParams(
        max_tokens=20))
    for _ in range(5):
        engine.step()
    held = len(drop.block_table)
    free_before = engine.blocks.num_free
    engine.cancel(drop)
    assert drop.finish_reason == "cancelled" and engine.blocks.num_free == free_before + held > free_before
    while engine.has_work:
        engine.step()
    assert keep.output_ids == reference(PROMPTS[0], 20)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_seeded_sampling_is_reproducible_in_any_batch(checkpoint):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    alone = make_engine(checkpoint).generate([PROMPTS[0]], params)[0].output_ids
    batched = make_engine(checkpoint).generate([PROMPTS[3], PROMPTS[0], PROMPTS[1]], params)[1].output_ids
    other_seed = make_engine(checkpoint).generate([PROMPTS[0]], dataclasses.replace(params, seed=99))[0].output_ids
    assert alone == batched and alone != other_seed
    greedy = make_engine(checkpoint).generate([PROMPTS[0]], SamplingParams(max_tokens=16))[0].output_ids
    top1 = make_engine(checkpoint).generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=5.0,
                                                                          top_k=1))[0].output_ids
    assert top1 == greedy


def test_stop_string_cuts_the_text_and_finishes(checkpoint):
    full = make_engine(checkpoint).generate([PROMPTS[0]], SamplingParams(max_tokens=30))[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    engine = make_engine(checkpoint)
    seq = engine.add(PROMPTS[0], SamplingParams(max_tokens=30, stop=(stop,)))
    streamed = ""
    while engine.has_work:
        for s in engine.step():
            streamed += pending_text(s)
    assert seq.finish_reason == "stop" and seq.text == full.text[:full.text.find(stop)] == streamed
    assert stop not in streamed


def test_overlapped_steps_give_the_same_tokens_text_stops_and_cancellations(checkpoint, reference):
    """With `overlap_steps` each call launches the next step before decoding its own tokens' text: a stop string
    found then, or a cancellation between calls, leaves that sequence's row of the launched step unused (no token,
    its blocks free at once), and everything else is as without it."""
    params = SamplingParams(max_tokens=24)
    engine = make_engine(checkpoint, overlap_steps=True)
    seqs = engine.generate(PROMPTS, params)
    assert [s.output_ids for s in seqs] == [reference(p, 24) for p in PROMPTS]
    assert [s.text for s in seqs] == [engine.tokenizer.decode(s.output_ids, skip_special_tokens=True) for s in seqs]
    full = seqs[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    stopped = engine.add(PROMPTS[0], SamplingParams(max_tokens=24, stop=(stop,)))
    keep, drop = engine.add(PROMPTS[1], params), engine.add(PROMPTS[2], params)
    streamed, steps = "", 0
    while engine.has_work:
        advanced = engine.step()
        assert engine.pending is None or engine.pending.seqs  # the next step is under way while text is decoded
        streamed += "".join(pending_text(s) for s in advanced if s is stopped)
        steps += 1
        if steps == 4:
            assert drop in engine.pending.seqs
            engine.cancel(drop)
            assert drop.block_table == [] and drop.finish_reason == "cancelled"
            cancelled_at = len(drop.output_ids)
    assert stopped.finish_reason == "stop" and stopped.text == full.text[:full.text.find(stop)] == streamed
    assert stopped.output_ids == full.output_ids[:len(stopped.output_ids)]  # nothing from the step after its stop
    assert keep.output_ids == reference(PROMPTS[1], 24) and len(drop.output_ids) == cancelled_at
    assert engine.pending is None and engine.blocks.num_free == engine.blocks.num_blocks


def test_decode_steps_launched_ahead_of_their_tokens_keep_every_token(checkpoint, reference):
    """With `overlap_steps`, a decode step goes before the last step's tokens are on the host
    (its input ids taken on the device, in the order the scheduler gives, which is turned around here every step):
    the same tokens as transformers with different lengths and preemption (14 blocks of 4 tokens cannot hold them),
    and as one step at a time with EOS and min_tokens, and with seeded sampling; blocks back to idle."""
    lengths = [5, 16, 9, 12, 1, 16, 3, 14]
    engines = [make_engine(checkpoint, block_size=4, kv_cache_blocks=14, overlap_steps=overlap)
               for overlap in (False, True)]
    ahead = engines[1]
    taken = []
    real_taken = ahead._taken
    ahead._taken = lambda after, seqs: taken.append(len(seqs)) or real_taken(after, seqs)
    turned = ahead.scheduler.policy
    ahead.scheduler.policy = lambda seq, now: tuple(-v for v in turned(seq, now)[-1:])  # newest first
    ahead.scheduler.waiting = WaitQueue(order=lambda seq: (-seq.seq_id,))

    def run(engine, eos_ids, min_tokens, **sampling):
        engine.eos_ids = eos_ids
        seqs = [engine.add(p, SamplingParams(max_tokens=n, min_tokens=min_tokens(n), seed=i, **sampling))
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        while engine.has_work:
            assert all(not s.placeholder and not s.ending for s in engine.step())
        assert engine.blocks.num_free == 14 and engine.pending is None
        return [s.output_ids for s in seqs]

    plain = run(ahead, (), lambda n: 0)
    assert plain == [reference(p, n) for p, n in zip(PROMPTS, lengths)]
    assert ahead.scheduler.preemptions > 0 and len(taken) > 10
    eos = next(o[i] for o, n in zip(plain, lengths) for i in range(n // 2, n - 1))  # met after min_tokens
    ended = [run(engine, (eos,), lambda n: n // 2) for engine in engines]
    assert ended[0] == ended[1] and any(len(o) < n for o, n in zip(ended[1], lengths))
    drawn = [run(engine, (), lambda n: 0, temperature=0.9, top_p=0.95) for engine in engines]  # seeded sampling
    assert drawn[0] == drawn[1] != plain
    # prompts that arrive while sequences decode (too long to ride a decode step: prompt_rows 0) prefill in a step
    # launched ahead of the running ones' tokens
    engine = make_engine(checkpoint, overlap_steps=True, prompt_rows=0)
    launch, prefills = engine._launch, []

    def counted(after=None):
        step = launch(after)
        prefills.append(after is not None and step.is_prefill)
        return step

    engine._launch = counted
    seqs = [engine.add(p, SamplingParams(max_tokens=10)) for p in PROMPTS[:2]]
    for prompt in PROMPTS[2:6]:
        engine.step()
        engine.step()
        seqs.append(engine.add(prompt, SamplingParams(max_tokens=10)))
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == [reference(p, 10) for p in PROMPTS[:6]] and any(prefills)
    # a step launched ahead preempts a sequence whose token is still on its way: that token joins it all the same
    engine = make_engine(checkpoint, block_size=4, kv_cache_blocks=12, overlap_steps=True)
    preempt, in_flight = engine.scheduler.preempt, []
    engine.scheduler.preempt = lambda seq: in_flight.append(seq.placeholder) or preempt(seq)
    seqs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=20))
    assert any(in_flight) and [s.output_ids for s in seqs] == [reference(p, 20) for p in PROMPTS[:3]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: what waits for the device")
def test_a_step_launched_ahead_never_waits_for_the_device(checkpoint, monkeypatch):
    """Drawing a step's tokens on the device and launching the next step ahead of them (scheduling, the inputs, the
    graph's replay) make no call that waits for the device (torch's sync debug mode raises on one), greedy (EOS
    masked before min_tokens: until 2026-12-05 that mask waited for the whole stream) or sampled."""
    import backends.llm.engine as engine_module

    engine = make_engine(checkpoint, device="cuda", dtype="bf16", overlap_steps=True)
    calls, failures = [], []

    def strict(work):
        def checked(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                calls.append(work(*args, **kwargs))
            except Exception as e:  # the engine would hand it to the step: keep it for the assertion
                failures.append(e)
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")
            return calls[-1]
        return checked

    launch = engine._launch
    engine._launch = lambda after=None: launch() if after is None else strict(launch)(after)
    monkeypatch.setattr(engine_module, "draw", strict(engine_module.draw))
    engine.generate(PROMPTS[:4], SamplingParams(max_tokens=12, min_tokens=8))  # EOS masked in the first 8
    engine.generate(PROMPTS[:4], SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3))
    ahead = [c for c in calls if hasattr(c, "seqs")]
    assert not failures and len(ahead) > 10 and len(calls) > 2 * 10
    assert all(step.error is None for step in ahead)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh runs it)")
def test_drawn_tokens_reach_the_host_without_waiting_for_work_launched_after_them():
    """`chosen` waits for the copies `draw` started, not for the stream: a step launched ahead (here one long sleep
    kernel) still runs when the tokens are read. (The H200 run of 2026-12-05 read them with `.tolist()`, which
    queued the copy behind the step launched ahead, so overlap_steps could not overlap anything.)"""
    from backends.llm.sampling import chosen, draw
    from backends.llm.sequence import Sequence

    logits = torch.randn(3, 100, device="cuda")
    seqs = [Sequence([1], SamplingParams(max_tokens=4)), Sequence([1], SamplingParams(temperature=0.7, seed=1)),
            Sequence([1], SamplingParams(max_tokens=4))]
    drawn = draw(logits, seqs, ())
    torch.cuda._sleep(4_000_000_000)  # about 2 s on the GPU, queued behind the copies
    tokens = chosen(drawn)
    assert not torch.cuda.current_stream().query()  # the sleep still runs
    greedy = logits.argmax(-1).tolist()
    assert tokens[0] == greedy[0] and tokens[2] == greedy[2] and 0 <= tokens[1] < 100
    torch.cuda.synchronize()


def test_text_of_ids_equals_the_tokenizers_decode(checkpoint):
    """The detokeniser's shortcut to the fast tokenizer's backend gives `decode(ids, skip_special_tokens=True)`,
    special tokens, partial UTF-8 and all."""
    from transformers import AutoTokenizer

    from backends.llm.detokenizer import text_of

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert text_of(tokenizer).func == tokenizer.backend_tokenizer.decode  # the shortcut is taken
    generator = torch.Generator().manual_seed(0)
    special = list(tokenizer.all_special_ids)
    for length in (1, 2, 5, 17):
        for _ in range(30):
            ids = torch.randint(0, len(tokenizer), (length,), generator=generator).tolist()
            ids[::4] = [special[i % len(special)] for i in range(len(ids[::4]))] if special else ids[::4]
            assert text_of(tokenizer)(ids) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_eos_ends_output_unless_min_tokens(checkpoint):
    engine = make_engine(checkpoint)
    first = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8))[0].output_ids[0]
    engine.eos_ids = (first,)  # make the greedy first token the end of text
    assert engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8))[0].output_ids == []
    held = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, min_tokens=3))[0]
    assert len(held.output_ids) >= 3 and first not in held.output_ids[:3]


def test_requests_that_cannot_fit_are_invalid(checkpoint):
    engine = make_engine(checkpoint, max_model_len=64)
    with pytest.raises(InvalidInput, match="exceeds the context length 64"):
        engine.add("the " * 40, SamplingParams(max_tokens=30))
    with pytest.raises(InvalidInput, match="exceeds the whole KV cache"):
        make_engine(checkpoint, kv_cache_blocks=2).add("cat", SamplingParams(max_tokens=40))


def test_prefill_attention_paths_agree_with_plain_causal_attention():
    """Fresh prompts take per-prompt causal SDPA, other prefills the masked gather path: both equal a plain
    per-prompt computation with the KV heads repeated, for two prompts spread over non-adjacent blocks."""
    torch.manual_seed(0)
    heads, kv_heads, dim, block, lengths = 8, 2, 16, 4, (5, 9)
    cache = (torch.zeros(12, block, kv_heads, dim), torch.zeros(12, block, kv_heads, dim))
    tables = torch.tensor([[3, 7, 0], [1, 10, 5]], dtype=torch.int32)  # block 0: scratch padding
    slots = torch.tensor([int(tables[b, p // block]) * block + p % block for b, n in enumerate(lengths)
                          for p in range(n)])
    q, k, v = torch.randn(sum(lengths), heads, dim), torch.randn(sum(lengths), kv_heads, dim), \
        torch.randn(sum(lengths), kv_heads, dim)
    write_kv(cache, k, v, slots)
    seq = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)])
    pos = torch.tensor([p for n in lengths for p in range(n)])
    padded = torch.tensor([list(range(n)) + [0] * (max(lengths) - n) for n in lengths])
    masked = paged_attention(q, cache, AttentionMetadata(slots, tables, padded, (seq, pos), max(lengths)))
    fresh = paged_attention(q, cache, AttentionMetadata(slots, tables, padded, (seq, pos), max(lengths), lengths))
    expected, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        expected.append(torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].repeat_interleave(heads // kv_heads, 1).transpose(0, 1),
            v[rows].repeat_interleave(heads // kv_heads, 1).transpose(0, 1), is_causal=True).transpose(0, 1))
        start += n
    torch.testing.assert_close(fresh, torch.cat(expected))
    torch.testing.assert_close(masked, torch.cat(expected))
    # their own keys between bounds, then padding (a prompt of 2 tokens) and empty prompts: a padded prefill graph's
    pad = lambda t: torch.cat([t, torch.randn(2, *t.shape[1:])])  # noqa: E731
    bounds = torch.tensor([0, 5, 14, 16, 16], dtype=torch.int32)
    torch.testing.assert_close(varlen_causal(pad(q), pad(k), pad(v), bounds, 16)[:14], torch.cat(expected))


def test_prefill_padded_to_graph_sizes_gives_the_same_tokens(checkpoint, reference, monkeypatch):
    """What a prefill graph runs (fresh prompts padded to a size, from the static inputs), eagerly on the CPU: the
    padding writes only the scratch block, so every sequence's greedy tokens stay transformers'."""
    engine = make_engine(checkpoint)
    runner = ModelRunner(engine.model, engine.kv_cache, engine.blocks, engine.decode_rows, 64, capture=False,
                         prefill_graph_tokens=100)
    assert runner.prefill_sizes == (16, 32, 64, 100)
    sizes = []
    monkeypatch.setattr(runner, "prefill_static", lambda size, real=runner.prefill_static: sizes.append(size)
                        or real(size))
    engine.runner = runner
    prompts = [PROMPTS[:3], PROMPTS[3:]]  # two prefill steps of different sizes
    for batch in prompts:
        for prompt, seq in zip(batch, engine.generate(batch, SamplingParams(max_tokens=12))):
            assert seq.output_ids == reference(prompt, 12), prompt
    tokens = [sum(len(engine.tokenizer.encode(p)) for p in batch) for batch in prompts]
    assert sizes == [next(s for s in runner.prefill_sizes if s >= n) for n in tokens]
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh runs it)")
def test_prefill_graphs_give_the_eager_tokens_on_a_gpu(checkpoint):
    params = SamplingParams(max_tokens=24, min_tokens=24)
    outputs = []
    for tokens in (2048, 0):
        engine = make_engine(checkpoint, dtype="bf16", device="cuda", kv_cache_memory_mb=64,
                             prefill_graph_tokens=tokens)
        assert len(engine.runner.prefill_sizes) == (10 if tokens else 0)
        outputs.append([[s.output_ids for s in engine.generate(batch, params)] for batch in (PROMPTS, PROMPTS[:1])])
    assert outputs[0] == outputs[1]


def test_graph_pieces_split_the_layers_evenly_or_doubling(monkeypatch):
    from backends.llm import runner

    monkeypatch.setattr(runner, "GRAPH_PIECES", 4)
    assert runner.piece_bounds(32) == [0, 8, 16, 24, 32] and runner.piece_bounds(2) == [0, 1, 2]
    monkeypatch.setattr(runner, "GRAPH_RAMP", True)
    assert runner.piece_bounds(32) == [0, 1, 3, 7, 15, 32]  # (a last piece of 1 layer joins the one before)
    assert runner.piece_bounds(80) == [0, 1, 3, 7, 15, 31, 80] and runner.piece_bounds(2) == [0, 1, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh runs it)")
def test_decode_graphs_in_pieces_give_the_whole_graphs_tokens(checkpoint, monkeypatch):
    from backends.llm import runner

    params = SamplingParams(max_tokens=24, min_tokens=24)
    outputs = []
    for pieces, ramp in ((2, False), (1, True), (1, False)):  # (2 layers: the ramp's pieces are 1 layer each too)
        monkeypatch.setattr(runner, "GRAPH_PIECES", pieces)
        monkeypatch.setattr(runner, "GRAPH_RAMP", ramp)
        engine = make_engine(checkpoint, dtype="bf16", device="cuda", kv_cache_memory_mb=64)
        graph, _ = engine.runner.graphs[1, 1]
        assert len(getattr(graph, "graphs", [graph])) == (2 if pieces > 1 or ramp else 1)
        outputs.append([[s.output_ids for s in engine.generate(batch, params)] for batch in (PROMPTS, PROMPTS[:1])])
    assert outputs[0] == outputs[1] == outputs[2]


def test_prefill_by_sequence_equals_the_padded_masked_path():
    """A step mixing a prompt chunk after a cached prefix, a decoding sequence and a prompt from its start: each
    sequence over its own keys (bottom-right causal) equals the padded, masked computation of all of them."""
    torch.manual_seed(1)
    heads, kv_heads, dim, block = 6, 2, 16, 4
    cache = (torch.randn(12, block, kv_heads, dim), torch.randn(12, block, kv_heads, dim))  # cached keys: random
    tables = torch.tensor([[3, 7, 0], [1, 10, 5], [2, 0, 0]], dtype=torch.int32)
    cached, new = (6, 8, 0), (3, 1, 4)
    positions = [list(range(c, c + n)) for c, n in zip(cached, new)]
    slots = torch.tensor([int(tables[b, p // block]) * block + p % block for b, ps in enumerate(positions)
                          for p in ps])
    q = torch.randn(sum(new), heads, dim)
    write_kv(cache, torch.randn(sum(new), kv_heads, dim), torch.randn(sum(new), kv_heads, dim), slots)
    seq = torch.tensor([b for b, n in enumerate(new) for _ in range(n)])
    index = torch.tensor([i for n in new for i in range(n)])
    padded = torch.tensor([ps + [0] * (max(new) - len(ps)) for ps in positions])
    args = (slots, tables, padded, (seq, index), max(c + n for c, n in zip(cached, new)))
    expected = paged_attention(q, cache, AttentionMetadata(*args))
    spans = tuple((n, c + n) for c, n in zip(cached, new))
    torch.testing.assert_close(paged_attention(q, cache, AttentionMetadata(*args, spans=spans)), expected)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_sequence_whose_sampling_fails_ends_alone(checkpoint, reference, overlap):
    """A failure inside one sequence's sampling finishes that sequence with its error and frees its blocks; the
    greedy and sampled sequences beside it run to the end with the tokens they would have had alone (with
    `overlap_steps`, the failing step's successor is already launched)."""
    from backends.core.errors import InjectedFault

    engine = make_engine(checkpoint, overlap_steps=overlap)
    good = engine.add(PROMPTS[0], SamplingParams(max_tokens=12))
    sampled = engine.add(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.8, seed=1))
    bad = engine.add(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.8, seed=13))
    for _ in range(4):
        engine.step()
    bad.fault = "sample"  # from its next step on
    while engine.has_work:
        engine.step()
    assert bad.finish_reason == "error" and isinstance(bad.error, InjectedFault) and 0 < len(bad.output_ids) < 6
    assert good.output_ids == reference(PROMPTS[0], 12) and good.error is None
    alone = make_engine(checkpoint).generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0.8, seed=1))[0]
    assert sampled.output_ids == alone.output_ids
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_failed_model_step_names_the_sequences_in_it(checkpoint, monkeypatch):
    """The adapter fails exactly these (and frees their blocks by cancelling them); the engine's other sequences are
    untouched and finish."""
    from backends.llm.engine import StepFailed

    # the second's prefill runs alone, not mixed with the first nor riding its decode step
    engine = make_engine(checkpoint, chunk_tokens=None, prompt_rows=0)
    first = engine.add(PROMPTS[0], SamplingParams(max_tokens=8))
    engine.step()  # prefill of the first alone
    second = engine.add(PROMPTS[1], SamplingParams(max_tokens=8))
    real = engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda seqs: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(StepFailed) as failed:
        while True:
            engine.step()
    assert failed.value.seqs == [second] and isinstance(failed.value.__cause__, RuntimeError)
    engine.cancel(second)
    monkeypatch.setattr(engine.runner, "prefill", real)
    while engine.has_work:
        engine.step()
    assert first.finish_reason in ("length", "stop") and second.finish_reason == "cancelled"
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_short_prompts_ride_decode_steps_with_the_same_tokens(checkpoint, reference):
    """Prompts of up to `prompt_rows` tokens join the running sequence's decode step (a row a token) and get their
    first token from it; a longer one still prefills in a step of its own."""
    engine = make_engine(checkpoint, prompt_rows=16)
    running = engine.add(PROMPTS[0], SamplingParams(max_tokens=30))
    engine.step()  # its prefill, alone
    short = [engine.add(p, SamplingParams(max_tokens=20)) for p in (PROMPTS[1], PROMPTS[3], PROMPTS[4])]
    assert all(len(s.prompt_ids) <= 16 for s in short)
    engine.step()
    assert len(running.output_ids) == 2 and all(len(s.output_ids) == 1 for s in short)
    assert engine.stats.prefill_steps == 1 and engine.stats.prefill_tokens == sum(
        len(s.prompt_ids) for s in [running, *short])
    long_prompt = " ".join(PROMPTS)
    late = engine.add(long_prompt, SamplingParams(max_tokens=12))
    assert len(late.prompt_ids) > 16
    engine.step()
    assert len(running.output_ids) == 2 and len(late.output_ids) == 1 and engine.stats.prefill_steps == 2
    while engine.has_work:
        engine.step()
    assert running.output_ids == reference(PROMPTS[0], 30) and late.output_ids == reference(long_prompt, 12)
    for prompt, seq in zip((PROMPTS[1], PROMPTS[3], PROMPTS[4]), short):
        assert seq.output_ids == reference(prompt, 20), prompt
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_chunked_prefill_keeps_the_decoding_pace_and_the_tokens(checkpoint, reference):
    engine = make_engine(checkpoint, chunk_tokens=8, block_size=4)
    running = engine.add(PROMPTS[0], SamplingParams(max_tokens=40))
    engine.step()  # its prefill, alone
    long_prompt = " ".join(PROMPTS)
    late = engine.add(long_prompt, SamplingParams(max_tokens=12))
    steps = 0
    while not late.output_ids:  # the long prompt prefills 7 tokens a step beside the running sequence
        before = len(running.output_ids)
        engine.step()
        steps += 1
        assert len(running.output_ids) == before + 1
    assert steps >= len(late.prompt_ids) // 7
    while engine.has_work:
        engine.step()
    assert running.output_ids == reference(PROMPTS[0], 40) and late.output_ids == reference(long_prompt, 12)


def test_chunked_prefill_under_preemption_recomputes_to_the_same_tokens(checkpoint, reference):
    engine = make_engine(checkpoint, block_size=4, kv_cache_blocks=14, chunk_tokens=6)
    first = engine.add(PROMPTS[2], SamplingParams(max_tokens=16))
    engine.step()
    prompts = PROMPTS[:2] + PROMPTS[3:5] + PROMPTS[6:]
    seqs = [engine.add(p, SamplingParams(max_tokens=16)) for p in prompts]
    while engine.has_work:
        engine.step()
    assert engine.scheduler.preemptions > 0
    for prompt, seq in zip([PROMPTS[2], *prompts], [first, *seqs]):
        assert seq.output_ids == reference(prompt, 16), prompt
    assert engine.blocks.num_free == 14


def test_sampling_is_safe_for_any_accepted_temperature_and_fails_only_non_finite_rows():
    from backends.llm.sampling import sample
    from backends.llm.sequence import Sequence

    logits = torch.randn(4, 50)
    logits[2] = float("nan")  # a broken row
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=0.7, top_k=3, seed=5),
              SamplingParams(temperature=1.0), SamplingParams(temperature=1e30, top_p=0.5)]
    seqs = [Sequence([1], p) for p in params]
    chosen = sample(logits.clone(), seqs, ())
    assert chosen[0] == logits[0].argmax().item()  # vanishing temperature: greedy
    assert chosen[1] in logits[1].topk(3).indices.tolist()
    assert isinstance(chosen[2], RuntimeError) and "not finite" in str(chosen[2])
    assert isinstance(chosen[3], int) and 0 <= chosen[3] < 50


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    from backends.llm.sampling import sample
    from backends.llm.sequence import Sequence

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(200):
        (token,) = sample(logits.clone(), [Sequence([1], SamplingParams(temperature=1.0, top_p=0.75, seed=seed))], ())
        seen.add(token)
    assert seen == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3: the two most likely tokens, never the others
