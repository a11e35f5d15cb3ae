"""transformers reference outputs for the same tiny checkpoints the server was built from."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel, ViTForImageClassification

from backends.media.images import decode_image

# Served fp32 ONNX Runtime vs eager PyTorch: only kernel order differs.
ATOL = 1e-4


@lru_cache
def _vit(checkpoint: Path):
    return ViTForImageClassification.from_pretrained(checkpoint).eval(), AutoImageProcessor.from_pretrained(checkpoint)


@lru_cache
def _clip(checkpoint: Path):
    return (CLIPModel.from_pretrained(checkpoint).eval(), AutoImageProcessor.from_pretrained(checkpoint),
            AutoTokenizer.from_pretrained(checkpoint))


@torch.inference_mode()
def vit_logits(checkpoint: Path, images: list[bytes]) -> np.ndarray:
    model, processor = _vit(checkpoint)
    pixels = processor(images=[decode_image(b) for b in images], return_tensors="pt")["pixel_values"]
    return model(pixel_values=pixels).logits.numpy()


@torch.inference_mode()
def clip_outputs(checkpoint: Path, image: bytes, texts: list[str]):
    """CLIPModel's image_embeds [1, D], text_embeds [N, D] and logits_per_image [N], texts encoded one by one
    (no padding), as a client would see them individually."""
    model, processor, tokenizer = _clip(checkpoint)
    pixels = processor(images=[decode_image(image)], return_tensors="pt")["pixel_values"]
    text_embeds, logits, image_embeds = [], [], None
    for text in texts:
        out = model(input_ids=tokenizer([text], return_tensors="pt")["input_ids"], pixel_values=pixels)
        image_embeds = out.image_embeds.numpy()
        text_embeds.append(out.text_embeds.numpy()[0])
        logits.append(out.logits_per_image.item())
    return image_embeds, np.stack(text_embeds), np.array(logits, dtype=np.float32)
