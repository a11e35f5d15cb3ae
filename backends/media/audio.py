"""Audio bytes -> 16 kHz mono float32, checked before and after decoding.

libsndfile (soundfile) reads WAV/FLAC/OGG/MP3 and more; soxr resamples (high quality); channels are averaged, as
ffmpeg's downmix in transformers' ASR pipeline does. Limits are checked from the header, before any sample is
decoded, so a 2-hour upload is refused without reading it.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from backends.core.errors import InvalidInput

SAMPLE_RATE = 16_000


@dataclass(frozen=True)
class AudioLimits:
    max_seconds: float = 3600.0
    max_channels: int = 2
    max_sample_rate: int = 48_000
    min_sample_rate: int = 4_000  # below this nothing is speech; a 1 Hz header makes 7 KB an hour of audio


def decode_audio(data: bytes, limits: AudioLimits = AudioLimits(), rate: int = SAMPLE_RATE) -> np.ndarray:
    """Encoded audio -> float32 [samples] at `rate`, or InvalidInput saying what is wrong."""
    import soundfile as sf
    import soxr

    if not data:
        raise InvalidInput("audio is empty (0 bytes)")
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as exc:
        raise InvalidInput(f"audio bytes ({len(data)} bytes, starting {data[:8]!r}) are not a readable audio file "
                           f"(WAV, FLAC, OGG, MP3, ...): {exc}") from None
    if info.channels > limits.max_channels:
        raise InvalidInput(f"audio has {info.channels} channels; at most {limits.max_channels} are accepted")
    if info.samplerate > limits.max_sample_rate:
        raise InvalidInput(f"audio sample rate {info.samplerate} Hz is above the limit of {limits.max_sample_rate} Hz")
    if info.samplerate < limits.min_sample_rate:
        raise InvalidInput(f"audio sample rate {info.samplerate} Hz is below the lowest accepted, "
                           f"{limits.min_sample_rate} Hz")
    if info.frames > 0 and info.frames / info.samplerate > limits.max_seconds:
        raise InvalidInput(f"audio is {info.frames / info.samplerate:.0f} s long; the limit is "
                           f"{limits.max_seconds:.0f} s")
    try:
        samples, sample_rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as exc:
        raise InvalidInput(f"audio data is corrupt or truncated: {exc}") from None
    if samples.shape[0] == 0:
        raise InvalidInput("audio has no samples")
    if samples.shape[0] / sample_rate > limits.max_seconds:  # headers that did not say how long the audio is
        raise InvalidInput(f"audio is {samples.shape[0] / sample_rate:.0f} s long; the limit is "
                           f"{limits.max_seconds:.0f} s")
    if not np.isfinite(samples).all():
        raise InvalidInput("audio contains NaN or infinite samples")
    mono = samples.mean(axis=1, dtype=np.float32)
    return mono if sample_rate == rate else soxr.resample(mono, sample_rate, rate, quality="HQ").astype(np.float32)
