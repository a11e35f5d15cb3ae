"""The served `whisper` against WhisperForConditionalGeneration.generate on the same tiny checkpoint: concurrent
requests of different lengths (sharing the engine's decoder steps: continuous batching), WAV/FLAC/OGG, a 3-minute clip through the
chunked path, the client CLI, and bad audio refused with the reason while the server keeps serving."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from backends.media.audio import decode_audio
from backends.mm_whisper.model import COUNTERS, GAUGES
from backends.whisper.chunking import merge, split
from client.sdk import Client
from perf.server_metrics import model_metrics
from tests.conftest import wav
from tests.integration.reference import whisper_tokens
from tests.integration.test_llm import metric

RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def reference(whisper_checkpoint):
    return whisper_tokens(whisper_checkpoint)


def test_concurrent_requests_equal_transformers(server, reference):
    clips = [RNG.normal(0, 0.1 * (i + 1), int(16000 * s)).astype(np.float32) for i, s in enumerate((1, 4, 9, 20, 2.5,
                                                                                                    14))]
    asks = [(clip, ("en", None, "de")[i % 3], ("transcribe", "translate")[i % 2], 8 + 3 * i)
            for i, clip in enumerate(clips)]
    def one(ask) -> tuple[str, list[int]]:
        with Client(server.http_url) as client:  # one HTTP client per thread: they are not thread-safe
            return client.transcribe(wav(ask[0], subtype="FLOAT"), *ask[1:])

    before = {name: metric(server, name, "whisper") for name in COUNTERS}
    answered = model_metrics(server.metrics_url, "whisper").get("qos_request_seconds_count", 0.0)
    with ThreadPoolExecutor(len(asks)) as pool:
        served = list(pool.map(one, asks))
    for (clip, language, task, budget), (text, tokens) in zip(asks, served):
        assert tokens == reference(clip, language, task, budget)
        assert text and len(tokens) <= budget
    deadline = time.monotonic() + 10  # the metrics follow the responses
    while metric(server, "whisper_encoded_clips_total", "whisper") - before["whisper_encoded_clips_total"] < len(
            asks) and time.monotonic() < deadline:
        time.sleep(0.05)
    done = {name: metric(server, name, "whisper") - before[name] for name in COUNTERS}
    assert done["whisper_encoded_clips_total"] == len(asks)
    # every clip fed its 4 prompt tokens and its tokens but the last, and clips shared decoder steps (continuous
    # batching)
    assert done["whisper_decode_tokens_total"] >= sum(3 + len(tokens) for _, tokens in served)
    assert done["whisper_decode_tokens_total"] > 1.5 * done["whisper_decode_steps_total"]
    assert done["whisper_decode_rows_total"] >= done["whisper_decode_tokens_total"]  # exported: a row per token fed
    idle = dict.fromkeys(GAUGES, 0.0)  # every request answered: no clip in a slot, joining or waiting
    while (gauges := {name: metric(server, name, "whisper") for name in GAUGES}) != idle and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert gauges == idle
    # each request's time in the model, arrival to answer: one observation each, no shorter than its wait to start
    after = model_metrics(server.metrics_url, "whisper")
    assert after["qos_request_seconds_count"] - answered == len(asks)
    assert after["qos_request_seconds_sum"] >= after["qos_wait_seconds_sum"] > 0


@pytest.mark.parametrize("fmt, subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_24"), ("OGG", "VORBIS")])
def test_audio_formats_at_other_rates(server, reference, fmt, subtype):
    clip = RNG.uniform(-0.3, 0.3, 44100 * 3).astype(np.float32)
    data = wav(np.stack([clip, clip[::-1]], axis=1), 44100, fmt, subtype)
    with Client(server.http_url) as client:
        _, tokens = client.transcribe(data, "en", max_tokens=12)
    assert tokens == reference(decode_audio(data), "en", max_new=12)


def test_three_minutes_go_through_chunks(server, reference):
    clip = RNG.normal(0, 0.1, 16000 * 180).astype(np.float32)
    with Client(server.http_url, timeout_s=300) as client:
        _, tokens = client.transcribe(wav(clip, subtype="FLOAT"), "en", max_tokens=10)
    chunks = split(clip)
    assert len(chunks) == 9
    assert tokens == merge([reference(chunk, "en", max_new=10) for chunk in chunks])


def test_cli_transcribes_a_file(server, tmp_path, capsys):
    from client.__main__ import main

    path = tmp_path / "clip.wav"
    sf.write(path, RNG.normal(0, 0.1, 16000 * 2).astype(np.float32), 16000)
    assert main(["--url", server.http_url, "transcribe", str(path), "--language", "en", "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip()


def bad_cases() -> dict[str, tuple[bytes, dict, str]]:
    from tests.unit.test_audio import silent_flac

    good = wav(RNG.normal(0, 0.1, 16000).astype(np.float32))
    return {
        "not audio": (b"GIF89a not audio", {}, "not a readable audio file"),
        "truncated header": (good[:20], {}, "not a readable audio file"),
        "0 samples": (wav(np.zeros(0, dtype=np.float32)), {}, "no samples"),
        "8 channels 96 kHz": (wav(RNG.normal(0, 0.1, (9600, 8)).astype(np.float32), 96000), {}, "8 channels"),
        "2 hours": (silent_flac(7200), {}, "7200 s long"),
        "NaN": (wav(np.full(1600, np.nan, dtype=np.float32), subtype="FLOAT"), {}, "NaN"),
        "unknown language": (good, {"language": "xx"}, "unknown language"),
        "bad task": (good, {"task": "summarize"}, "task must be one of"),
        "max_tokens 0": (good, {"max_tokens": 0}, "max_tokens must be at least 1"),
    }


def test_bad_audio_is_invalid_arg_and_server_keeps_serving(server):
    from tritonclient.utils import InferenceServerException

    with Client(server.http_url) as client:
        for name, (data, options, reason) in bad_cases().items():
            with pytest.raises(InferenceServerException, match=reason) as error:
                client.transcribe(data, **options)
            assert "400" in str(error.value.status()), name
        text, tokens = client.transcribe(wav(RNG.normal(0, 0.1, 16000).astype(np.float32)), "en", max_tokens=4)
    assert tokens and text
