"""Audio bytes -> 16 kHz mono, and the log-mel features the whisper engine computes from it, against
WhisperFeatureExtractor's numpy reference (80 and 128 mel bins, several lengths and sample rates); bad audio is
refused with the reason."""
from __future__ import annotations

import numpy as np
import pytest
import soxr
import torch
from transformers import WhisperFeatureExtractor

from backends.core.errors import InvalidInput
from backends.media.audio import AudioLimits, decode_audio
from backends.whisper.features import LogMel
from tests.conftest import wav

RNG = np.random.default_rng(3)


def noise(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    samples = RNG.uniform(-0.5, 0.5, (int(seconds * rate), channels)).astype(np.float32)
    return samples[:, 0] if channels == 1 else samples


@pytest.mark.parametrize("mels", [80, 128])
@pytest.mark.parametrize("seconds, rate", [(1.0, 16000), (7.3, 16000), (30.0, 16000), (12.5, 8000),
                                           (4.2, 22050), (9.9, 44100), (3.0, 48000)])
def test_features_equal_whisper_feature_extractor(mels, seconds, rate):
    """Our path (float WAV bytes -> decode -> soxr -> the engine's LogMel) against the extractor's numpy
    reference on the same resampled waveform (its torch path, float32, drifts ~1e-4 from it)."""
    extractor = WhisperFeatureExtractor(feature_size=mels)
    original = noise(seconds, rate)
    audio = decode_audio(wav(original, rate, subtype="FLOAT"))
    expected_wave = original if rate == 16000 else soxr.resample(original, rate, 16000, quality="HQ")
    np.testing.assert_allclose(audio, expected_wave, atol=1e-6)
    ours = LogMel(extractor)([audio], torch.device("cpu"))[0].numpy()
    padded = np.zeros((1, extractor.n_samples), dtype=np.float32)  # what the extractor's padding to 30 s does
    padded[0, :min(len(expected_wave), extractor.n_samples)] = expected_wave[:extractor.n_samples]
    reference = extractor._np_extract_fbank_features(padded, "cpu")[0]
    assert ours.shape == reference.shape == (mels, 3000)
    np.testing.assert_allclose(ours, reference, atol=1e-6)  # the acceptance asks 1e-4; float64 gives ~1e-7


@pytest.mark.parametrize("fmt, subtype", [("WAV", "PCM_16"), ("FLAC", "PCM_16"), ("OGG", "VORBIS")])
def test_formats_and_stereo_are_decoded_as_libsndfile_reads_them(fmt, subtype):
    import io

    import soundfile as sf

    stereo = noise(2.0, 16000, channels=2)
    data = wav(stereo, 16000, fmt, subtype)
    expected = sf.read(io.BytesIO(data), dtype="float32")[0].mean(axis=1)
    np.testing.assert_allclose(decode_audio(data), expected, atol=1e-6)


def silent_flac(seconds: float, rate: int = 8000) -> bytes:
    """Real audio of that length, small on the wire: FLAC codes silence in a few bytes per block."""
    import io

    import soundfile as sf

    out, block = io.BytesIO(), np.zeros(rate * 60, dtype=np.int16)
    with sf.SoundFile(out, "w", rate, 1, format="FLAC", subtype="PCM_16") as f:
        for _ in range(int(seconds // 60)):
            f.write(block)
    return out.getvalue()


BAD = {
    "not audio": (b"this is not audio at all", "not a readable audio file"),
    "truncated header": (wav(noise(1.0, 16000))[:20], "not a readable audio file"),
    "empty": (b"", "empty"),
    "0 samples": (wav(np.zeros(0, dtype=np.float32)), "no samples"),
    "8 channels 96 kHz": (wav(noise(0.2, 96000, channels=8), 96000), "8 channels"),
    "2 hours": (silent_flac(7200), "7200 s long"),
    "NaN samples": (wav(np.full(1600, np.nan, dtype=np.float32), subtype="FLOAT"), "NaN"),
    # 3,600 samples at 1 Hz: 7 KB that resampled to 16 kHz was an hour of audio (40 s of an instance's time)
    "1 Hz": (wav(np.zeros(3600, dtype=np.float32), 1), "sample rate 1 Hz is below"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_audio_is_refused_with_the_reason(case):
    data, reason = BAD[case]
    with pytest.raises(InvalidInput, match=reason):
        decode_audio(data)


def test_limits_are_configurable():
    with pytest.raises(InvalidInput, match="sample rate 44100 Hz"):
        decode_audio(wav(noise(0.1, 44100), 44100), AudioLimits(max_sample_rate=16000))
    assert decode_audio(wav(noise(0.1, 96000, channels=8), 96000), AudioLimits(max_channels=8,
                                                                              max_sample_rate=96000)).shape == (1600,)
