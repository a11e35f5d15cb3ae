"""CLIP scoring of one image against N texts, and the `mm_clip` backend's parameters."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.core.params import Parameters, bounded


@dataclass(frozen=True)
class ClipParams(Parameters):
    logit_scale: float = bounded(100.0, 0, low_open=True)  # the checkpoint's exp(logit_scale)
    text_max_batch_size: int = bounded(64, 1)  # texts per call to clip_text (its max_batch_size)
    max_texts: int = bounded(1024, 1)


def similarity(image_embeds: np.ndarray, text_embeds: np.ndarray, logit_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """CLIP logits_per_image for one image (embeddings already L2-normalised) and their softmax over texts."""
    logits = logit_scale * (text_embeds @ image_embeds.reshape(-1))
    probs = np.exp(logits - logits.max())
    return logits.astype(np.float32), (probs / probs.sum()).astype(np.float32)
