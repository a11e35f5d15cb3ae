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


def whisper_tokens(checkpoint: Path):
    """tokens(clip, language, task, max_new): WhisperForConditionalGeneration.generate's greedy tokens on our float64
    log-mel features (see test_audio), without <|endoftext|>."""
    from transformers import WhisperForConditionalGeneration

    from backends.whisper.engine import WhisperEngine

    engine = WhisperEngine(checkpoint, "fp32", "cpu")
    model = WhisperForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def tokens(clip: np.ndarray, language: str | None = None, task: str = "transcribe", max_new: int = 20):
        with torch.inference_mode():
            out = model.generate(engine.features([clip], engine.device), language=language, task=task,
                                 max_new_tokens=max_new)[0]
        return [t for t in out.tolist() if t != engine.eot]
    return tokens


def llava_greedy(checkpoint: Path):
    """greedy_text(image, prompt, max_tokens): LlavaNextForConditionalGeneration.generate's answer."""
    import io

    from PIL import Image
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = LlavaNextForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def greedy_text(image: bytes, prompt: str, max_tokens: int) -> str:
        inputs = processor(images=Image.open(io.BytesIO(image)).convert("RGB"), text=prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        return processor.tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    return greedy_text
