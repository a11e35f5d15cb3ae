"""The whisper engine's greedy tokens against WhisperForConditionalGeneration.generate on the same tiny checkpoint
(one batch of clips of different lengths, languages given or detected, both tasks, different token budgets, 80 and
128 mel bins; clips joining and leaving a running batch at different steps, slots reused), and the long-audio chunk
layout and merge."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from backends.core.errors import InvalidInput
from backends.whisper.chunking import merge, split
from backends.whisper.engine import Clip, WhisperEngine
from build_engines.checkpoints import tiny_whisper

RNG = np.random.default_rng(11)


def reference_tokens(model, engine, clip, language, task, max_new_tokens) -> list[int]:
    features = engine.features([clip], engine.device)
    with torch.inference_mode():
        out = model.generate(features, language=language, task=task, max_new_tokens=max_new_tokens)[0]
    return [t for t in out.tolist() if t != engine.eot]


@pytest.fixture(scope="module")
def checkpoints(whisper_checkpoint, tmp_path_factory):
    return {80: whisper_checkpoint, 128: tiny_whisper(tmp_path_factory.mktemp("whisper-128") / "w", num_mel_bins=128)}


@pytest.mark.parametrize("mels", [80, 128])
def test_batched_greedy_tokens_equal_transformers_generate(checkpoints, mels):
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(checkpoints[mels], "fp32", "cpu")
    model = WhisperForConditionalGeneration.from_pretrained(checkpoints[mels], dtype=torch.float32).eval()
    clips = [RNG.normal(0, 0.05 * (i + 1), int(16000 * s)).astype(np.float32)
             for i, s in enumerate((1.5, 7.0, 29.9, 12.0, 0.3))]
    languages, tasks = ["en", None, "de", None, "fr"], ["transcribe", "transcribe", "translate", "transcribe",
                                                        "transcribe"]
    budgets = [40, 9, 40, 25, 3]  # clips of one batch finish at different steps
    results = engine.transcribe(clips, languages, tasks, budgets)
    for clip, language, task, budget, result in zip(clips, languages, tasks, budgets, results):
        assert result.tokens == reference_tokens(model, engine, clip, language, task, budget)
        assert len(result.tokens) <= budget and result.text == engine.tokenizer.decode(result.tokens,
                                                                                       skip_special_tokens=True)
        assert language is None or result.language == language
    assert len({tuple(r.tokens) for r in results}) > 1  # the audio changes the answer


def run_plan(engine: WhisperEngine, plan: list[tuple[int, float, str | None, str, int]]) -> tuple[list[Clip], dict]:
    """Adds the planned clips (added before step, seconds, language, task, budget) as the engine steps, to the end;
    the clips and how they shared the batch (the most distinct positions in one step, the most clips in one slot)."""
    rng = np.random.default_rng(3)
    clips = [Clip(rng.normal(0, 0.05 * (i + 1), int(16000 * s)).astype(np.float32), lang, task, budget)
             for i, (_, s, lang, task, budget) in enumerate(plan)]
    finished, slots, spreads, step = [], {}, [], 0
    while len(finished) < len(clips):
        for clip, (at, *_) in zip(clips, plan):
            if at == step:
                engine.add(clip)
        finished += engine.step()
        running = [c for c in engine.running if c is not None]
        spreads.append(len({c.position for c in running}))
        for c in running:
            slots.setdefault(c.slot, set()).add(id(c))
        step += 1
    assert all(c.error is None for c in finished) and set(finished) == set(clips)
    return clips, {"positions": max(spreads), "clips_per_slot": max(len(owners) for owners in slots.values())}


# more clips than slots, added while others run
PLAN = [(0, 3.0, "en", "transcribe", 12), (0, 20.0, None, "transcribe", 30), (0, 8.0, "de", "translate", 5),
        (2, 1.0, "en", "transcribe", 20), (6, 29.0, None, "translate", 8), (6, 5.0, "fr", "transcribe", 3),
        (15, 11.0, "en", "transcribe", 25)]


def test_clips_joining_and_leaving_a_running_batch_keep_transformers_tokens(whisper_checkpoint):
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=3, encoder_batch=2)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).eval()
    start = time.monotonic()
    clips, sharing = run_plan(engine, PLAN)
    elapsed = time.monotonic() - start
    for clip in clips:
        expected = reference_tokens(model, engine, clip.audio, clip.language, clip.task, clip.budget)
        assert engine.result(clip).tokens == expected
    # whisper_clip_*_seconds_total: seven clips for three slots, so some waited several steps for one (more than a
    # step's mean time in all); each clip's phases fit in the run
    phases = engine.phase_seconds
    assert engine.left == len(clips) and phases["decoding"] > phases["joining"] >= 0
    assert phases["waiting"] > engine.step_seconds / engine.steps
    assert sum(phases.values()) <= len(clips) * elapsed
    assert sharing["positions"] >= 3  # clips at three different positions shared a step
    assert sharing["clips_per_slot"] >= 2  # a slot freed by one clip served another
    assert not engine.has_work and engine.free_slots == 3
    assert engine.step_seconds > 0 and engine.join_seconds > 0  # the loop's time split (whisper_*_seconds_total)
    assert 0 < engine.joins < engine.encoded == len(clips)  # some joins took two clips (encoder_batch 2)


def test_a_clip_in_the_highest_slot_moves_down_when_a_lower_one_leaves(whisper_checkpoint):
    """Three clips fill three slots and the one in slot 0 ends first: the clip in slot 2 moves into it (its
    cross-attention and self-attention caches copied; slot 0 held another prompt's), the steps after compute two rows
    instead of three, and every clip keeps transformers' tokens."""
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=3)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).eval()
    audio = [RNG.normal(0, 0.05 * (i + 1), int(16000 * s)).astype(np.float32) for i, s in enumerate((2, 9, 5))]
    clips = [Clip(a, language, task, budget) for a, language, task, budget in
             zip(audio, ("de", "en", "en"), ("translate", "transcribe", "transcribe"), (1, 30, 30))]
    engine.add(*clips)
    rows, done = [], []

    def step() -> None:
        computed = engine.computed
        done.extend(engine.step())
        rows.append(engine.computed - computed)
    for _ in range(4):  # the prompt's four tokens: the fourth step gives slot 0's clip its one token
        step()
    assert done == [clips[0]] and engine.moves == 0
    step()
    assert engine.running[2] is None and engine.running[0] is clips[2] and engine.moves == 1
    while engine.has_work:
        step()
    assert rows[:5] == [3, 3, 3, 3, 2]
    for clip in clips:
        assert clip.error is None
        assert clip.tokens == reference_tokens(model, engine, clip.audio, clip.language, clip.task, clip.budget)


def test_self_attention_spans_widen_with_the_furthest_position(whisper_checkpoint):
    """A clip decoding past 64 positions (the first self-attention span) and one that joins after it: steps cover
    64, then 128 positions of the cache, and both clips keep transformers' tokens."""
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=2)
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).eval()
    spans, step = [], engine.decoder._step
    engine.decoder._step = lambda ids, at, span: (spans.append(span), step(ids, at, span))[1]
    audio = [RNG.normal(0, 0.05 * (i + 1), int(16000 * s)).astype(np.float32) for i, s in enumerate((6, 3))]
    long, late = Clip(audio[0], "en", "transcribe", 100), Clip(audio[1], "de", "translate", 12)
    engine.add(long)
    for _ in range(70):
        engine.step()
    engine.add(late)
    while engine.has_work:
        engine.step()
    assert len(long.tokens) > 70 and spans[0] == 64 and spans[-1] == 128 and set(spans) == {64, 128}
    for clip in (long, late):
        assert clip.tokens == reference_tokens(model, engine, clip.audio, clip.language, clip.task, clip.budget)


def test_a_higher_class_preempts_the_last_low_clip_which_restarts_with_the_same_tokens(whisper_checkpoint):
    from backends.core.qos import QosParams, QosPolicy

    policy = QosPolicy(QosParams())
    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=2)
    audio = [RNG.normal(0, 0.1, 16000 * s).astype(np.float32) for s in (3, 8, 2)]
    alone = engine.transcribe(audio, ["en"] * 3, ["transcribe"] * 3, [30, 30, 6])
    old_low, new_low = (Clip(a, "en", "transcribe", 30, ticket=policy.ticket("low", 0.5)) for a in audio[:2])
    engine.add(old_low)
    engine.step()
    engine.add(new_low)  # arrives later: last in QoS order
    for _ in range(3):
        engine.step()
    high = policy.ticket("high", 0.1)
    assert engine.room == 0 and not engine.preempt_for(policy.ticket("low", 0.0), time.monotonic())  # same class
    assert engine.preempt_for(high, time.monotonic())
    assert engine.preempted[0] is new_low and engine.room == 0 and engine.preemptions == 1
    urgent = Clip(audio[2], "en", "transcribe", 6, ticket=high)
    engine.add(urgent)
    done = []
    while engine.has_work:
        done += engine.step()
    assert done.index(urgent) < done.index(new_low)
    for clip, expected in zip((old_low, new_low, urgent), alone):
        assert clip.error is None and clip.tokens == expected.tokens  # the preempted clip started again


def test_lower_class_clips_join_in_their_share_of_time_while_a_higher_class_decodes(whisper_checkpoint):
    """While a high clip decodes, a low clip's encoder pass closes the gate for (1 - share) / share of its time:
    the next low clip waits (a preempted one too; an overdue one would not), and once the high clip is done it goes
    on; every clip keeps its tokens."""
    from backends.core.qos import QosParams, QosPolicy

    policy = QosPolicy(QosParams())
    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=4, lower_share=0.001)
    audio = [RNG.normal(0, 0.1, 16000 * s).astype(np.float32) for s in (2, 3, 4)]
    alone = engine.transcribe(audio, ["en"] * 3, ["transcribe"] * 3, [20, 4, 4])
    high = Clip(audio[0], "en", "transcribe", 20, ticket=policy.ticket("high", 0.1))
    engine.add(high)
    engine.step()
    low = policy.ticket("low", 0.5)
    assert engine.admits(low, time.monotonic())  # the gate is open
    first = Clip(audio[1], "en", "transcribe", 4, ticket=low)
    engine.add(first)
    engine.step()  # its encoder pass: the gate closes for about 1000 times that
    now = time.monotonic()
    assert first.joined and engine.lower.closed(now)
    assert not engine.admits(policy.ticket("low", 0.5), now) and engine.admits(policy.ticket("high", 0.5), now)
    assert engine.admits(policy.ticket("low", 0.5, arrival=now - 60), now)  # overdue
    waiter = Clip(audio[2], "en", "transcribe", 4, ticket=policy.ticket("low", 0.5))
    engine.preempted.append(waiter)  # as if preempted: it rejoins when allowed
    engine.step()
    assert engine.preempted[0] is waiter and waiter.slot == -1
    done = []
    while engine.has_work:
        done += engine.step()
    assert done.index(high) < done.index(waiter)  # it joined once no higher class decoded
    assert [c.tokens for c in (high, first, waiter)] == [a.tokens for a in alone]


def test_with_join_min_clips_wait_for_company_while_others_decode_and_keep_their_tokens(whisper_checkpoint):
    """join_min 2: a clip alone joins at once while nothing decodes; while one decodes, a second waits until a third
    comes (one encoder pass for both) or until it has waited join_wait_s."""
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=4, encoder_batch=4, join_min=2, join_wait_s=60)
    rng = np.random.default_rng(4)
    clips = [Clip(rng.normal(0, 0.05 * (i + 1), 16000 * (i + 2)).astype(np.float32), "en", "transcribe", 40)
             for i in range(4)]
    done = []
    engine.add(clips[0])
    done += engine.step()
    assert (engine.joins, engine.encoded) == (1, 1)  # nothing decoded: no waiting
    engine.add(clips[1])
    done += engine.step()
    assert clips[0] not in done, "the first clip must still decode for this test"
    assert (engine.joins, list(engine.waiting)) == (1, [clips[1]])  # alone beside a decoding clip: it waits
    engine.add(clips[2])
    done += engine.step()
    assert (engine.joins, engine.encoded) == (2, 3)  # the second and third joined in one pass
    engine.join_wait_s = 0.0
    engine.add(clips[3])
    done += engine.step()
    assert (engine.joins, engine.encoded) == (3, 4)  # alone, but it has waited join_wait_s
    while engine.has_work:
        done += engine.step()
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).eval()
    assert set(done) == set(clips)
    for clip in clips:
        assert clip.tokens == reference_tokens(model, engine, clip.audio, clip.language, clip.task, clip.budget)


def test_with_join_graphs_clips_join_in_whole_graphs_and_keep_their_tokens(whisper_checkpoint):
    """With join graphs of 1, 2 and 4 clips (encoder_batch 4), three clips that could join together join as two,
    then one at the next step: a graph's padding rows would write their garbage into other clips' slots. The graphs
    are stood in for by the op-by-op join here (the GPU test below replays real ones)."""
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu", slots=3, encoder_batch=4)
    sizes = []

    def replay(waves, slots):
        sizes.append(len(slots))
        return engine._encode_into(waves, slots)
    engine.join_graphs = replay
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).eval()
    clips, _ = run_plan(engine, PLAN)
    for clip in clips:
        assert clip.tokens == reference_tokens(model, engine, clip.audio, clip.language, clip.task, clip.budget)
    assert sizes[:2] == [2, 1] and set(sizes) <= {1, 2, 4} and sum(sizes) == len(PLAN)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (perf/gpu_bench.sh runs it)")
def test_cuda_graph_steps_keep_transformers_tokens(whisper_checkpoint):
    """Decoder steps and joins replayed from CUDA graphs (joins of 1, 2 or 4 clips) against op by op and
    transformers."""
    from transformers import WhisperForConditionalGeneration

    graphed = WhisperEngine(whisper_checkpoint, "fp32", "cuda", slots=3, encoder_batch=4)
    eager = WhisperEngine(whisper_checkpoint, "fp32", "cuda", slots=3, encoder_batch=4, cuda_graphs=False)
    assert graphed.decoder.graphs is not None and eager.decoder.graphs is None
    assert sorted(graphed.join_graphs.graphs) == [1, 2, 4] and eager.join_graphs is None
    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).cuda().eval()
    clips, _ = run_plan(graphed, PLAN)
    eager_clips, _ = run_plan(eager, PLAN)
    for clip, eager_clip in zip(clips, eager_clips):
        assert clip.tokens == eager_clip.tokens
        assert clip.tokens == reference_tokens(model, graphed, clip.audio, clip.language, clip.task, clip.budget)


@pytest.mark.parametrize("device, dtype", [
    ("cpu", torch.float32), ("cpu", torch.float16),
    pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_fused_encoder_states_equal_transformers_encoder(checkpoints, device, dtype):
    """FusedEncoder (one q/k/v projection, attention on views, compiled add + clamp + LayerNorm on a GPU) against
    WhisperEncoder.forward on the same weights, up to rounding; the engine uses it by default."""
    from transformers import WhisperForConditionalGeneration

    from backends.whisper.encoder import FusedEncoder

    for mels, checkpoint in checkpoints.items():
        model = WhisperForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
        encoder = model.model.encoder
        features = torch.randn(3, mels, 2 * encoder.config.max_source_positions, generator=torch.Generator()
                               .manual_seed(mels)).to(device, dtype)
        with torch.inference_mode():
            expected = encoder(features).last_hidden_state
            fused = FusedEncoder(encoder, compiled=device == "cuda")(features)
        error = (fused.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), (mels, error)
    assert isinstance(WhisperEngine(checkpoint, "fp32", "cpu").encoder, FusedEncoder)


def test_fused_decoder_steps_equal_the_unfused_ones(whisper_checkpoint):
    """SlotDecoder's fused step (one q/k/v projection, residual adds with the next LayerNorm; the engine's default)
    against three projections and separate kernels: the same choices and self-attention caches, step by step, for
    slots at different positions."""
    from transformers import WhisperForConditionalGeneration

    from backends.whisper.decoder import SlotDecoder

    model = WhisperForConditionalGeneration.from_pretrained(whisper_checkpoint, dtype=torch.float32).eval()
    fused, plain = SlotDecoder(model, 3, graphs=False), SlotDecoder(model, 3, graphs=False, fused=False)
    assert fused.qkv is not None and plain.qkv is None
    config = model.config
    encoded = torch.randn(3, config.max_source_positions, config.d_model, generator=torch.Generator().manual_seed(5))
    for decoder in (fused, plain):
        decoder.join(torch.arange(3), encoded)
    tokens, positions = [model.generation_config.decoder_start_token_id] * 3, [0, 3, 7]
    for _ in range(6):
        choices = fused.step(tokens, positions)
        assert choices == plain.step(tokens, positions)
        tokens, positions = [row[1] for row in choices], [p + 1 for p in positions]
    for mine, theirs in zip(fused.self_kv, plain.self_kv):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert fused.self_kv[0].abs().sum() > 0


def test_unknown_language_and_task_are_refused(whisper_checkpoint):
    engine = WhisperEngine(whisper_checkpoint, "fp32", "cpu")
    clip = np.zeros(1600, dtype=np.float32)
    with pytest.raises(InvalidInput, match="unknown language 'xx'"):
        engine.transcribe([clip], ["xx"], ["transcribe"])
    with pytest.raises(InvalidInput, match="task must be one of"):
        engine.transcribe([clip], ["en"], ["summarize"])


def test_long_audio_is_cut_like_the_chunked_pipeline():
    chunks = split(np.arange(16000 * 180, dtype=np.float32))  # 3 minutes: 30 s chunks every 20 s
    assert len(chunks) == 9 and all(len(c) == 16000 * 30 for c in chunks[:-1]) and len(chunks[-1]) == 16000 * 20
    assert [int(c[0]) // 16000 for c in chunks] == list(range(0, 180, 20))
    assert len(split(np.zeros(16000 * 30, dtype=np.float32))) == 1


def test_merge_recovers_the_text_across_known_overlaps():
    text = list(range(100, 200))
    # three chunks overlapping by 10 tokens, with garbled tokens where each chunk was cut (as Whisper does)
    pieces = [text[:40] + [7], [8] + text[32:70] + [9], [5] + text[61:]]
    assert merge(pieces) == text
    assert merge([text[:50], [1, 2, 3]]) == text[:50] + [1, 2, 3]  # no overlap: plain concatenation
    assert merge([text]) == text and merge([]) == []
