"""Audio longer than Whisper's 30 s window: overlapping chunks, transcribed together, merged at their overlaps.

The layout is transformers' chunked ASR pipeline's (30 s chunks, 5 s of context on each side, so consecutive chunks
start 20 s apart); the merge keeps, for each pair of neighbours, the left tokens up to the middle of the best
token-level overlap and the right tokens after it, as its longest-common-sequence merge does.
"""
from __future__ import annotations

import numpy as np

from backends.media.audio import SAMPLE_RATE

CHUNK_S, STRIDE_S = 30.0, 5.0


def split(audio: np.ndarray, chunk_s: float = CHUNK_S, stride_s: float = STRIDE_S,
          rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """[samples] -> chunks of chunk_s seconds starting every chunk_s - 2 * stride_s seconds (one when it fits)."""
    chunk, step = int(chunk_s * rate), int((chunk_s - 2 * stride_s) * rate)
    if len(audio) <= chunk:
        return [audio]
    starts = range(0, len(audio) - 2 * int(stride_s * rate), step)
    return [audio[start:start + chunk] for start in starts]


def merge(sequences: list[list[int]], min_matches: int = 2) -> list[int]:
    """Join neighbouring chunks' tokens: where the end of the text so far and the start of the next chunk agree
    best (most matching tokens at one alignment, ties to the longer overlap), keep each side up to the middle."""
    merged = list(sequences[0]) if sequences else []
    for right in sequences[1:]:
        best, overlap = 0.0, 0
        for i in range(1, min(len(merged), len(right)) + 1):
            matches = sum(a == b for a, b in zip(merged[-i:], right[:i]))
            score = matches / i + i / 1e4
            if matches >= min_matches and score > best:
                best, overlap = score, i
        half = overlap // 2
        merged = merged[:len(merged) - overlap + half] + list(right[half:])
    return merged
