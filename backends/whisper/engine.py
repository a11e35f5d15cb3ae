"""Batched greedy Whisper decoding with a static KV cache, on transformers' own modules and weights.

One `transcribe` call runs the encoder over every clip of the batch at once, projects each decoder layer's
cross-attention keys/values once, picks each clip's language when it was not given (the language token with the
highest logit after <|startoftranscript|>, as transformers' detect_language), then prefills every clip's prompt
(<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>) in one step and decodes one token per clip per step.
Every clip is at the same position, so the self-attention cache is one preallocated tensor per layer and no step
needs a mask; a clip that produced <|endoftext|> keeps stepping with it and is dropped from the result. The
checkpoint's suppress_tokens (every step) and begin_suppress_tokens (first step) are applied as transformers does,
so tokens equal WhisperForConditionalGeneration.generate's greedy output.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from backends.core.devices import DTYPES, resolve_device
from backends.core.errors import InvalidInput
from backends.core.batcher import BatchingParams
from backends.core.params import bounded, choice, device
from backends.media.audio import AudioLimits
from backends.whisper.features import LogMel

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class WhisperParams(BatchingParams):
    """The `mm_whisper` backend's parameters."""

    dtype: str = choice("fp32", *(d for d in DTYPES if d != "fp32"))
    device: str = device()
    max_batch: int = bounded(32, 1)  # clips (30 s chunks) per engine call
    prepare_threads: int = bounded(4, 1, 256)  # audio decoding threads per instance
    max_audio_seconds: float = bounded(AudioLimits.max_seconds, 0, low_open=True)
    max_channels: int = bounded(AudioLimits.max_channels, 1)
    max_sample_rate: int = bounded(AudioLimits.max_sample_rate, 1)

    @property
    def limits(self) -> AudioLimits:
        return AudioLimits(self.max_audio_seconds, self.max_channels, self.max_sample_rate)


@dataclass
class Transcription:
    tokens: list[int]  # generated tokens, without the prompt and <|endoftext|>
    text: str
    language: str  # code, e.g. "en"


class WhisperEngine:
    def __init__(self, checkpoint: Path, dtype: str = "fp32", device: str = "auto"):
        from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

        self.device, self.dtype = resolve_device(device), DTYPES[dtype]
        self.model = WhisperForConditionalGeneration.from_pretrained(checkpoint, dtype=self.dtype)
        self.model.to(self.device).eval()
        self.features = LogMel(WhisperFeatureExtractor.from_pretrained(checkpoint))
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        config, gen = self.model.config, self.model.generation_config
        self.sot, self.eot = gen.decoder_start_token_id, gen.eos_token_id
        self.languages = {token[2:-2]: i for token, i in gen.lang_to_id.items()}  # "en" -> id
        self.tasks = dict(gen.task_to_id)
        self.no_timestamps = gen.no_timestamps_token_id
        self.suppress = torch.tensor(gen.suppress_tokens or [], dtype=torch.long, device=self.device)
        self.begin_suppress = torch.tensor(gen.begin_suppress_tokens or [], dtype=torch.long, device=self.device)
        self.language_ids = torch.tensor(sorted(self.languages.values()), device=self.device)
        self.max_positions = config.max_target_positions
        self.heads, self.head_dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads

    def check_language(self, language: str | None) -> None:
        if language is not None and language not in self.languages:
            raise InvalidInput(f"unknown language {language!r}; known: {', '.join(sorted(self.languages))}")

    @torch.inference_mode()
    def transcribe(self, audios: list[np.ndarray], languages: list[str | None], tasks: list[str],
                   max_new_tokens: list[int | None] | None = None) -> list[Transcription]:
        """16 kHz mono clips of at most 30 s -> one Transcription each (greedy; a clip ends at <|endoftext|> or
        after its own max_new_tokens, default: as many as the decoder's positions allow)."""
        for language, task in zip(languages, tasks):
            self.check_language(language)
            if task not in TASKS:
                raise InvalidInput(f"task must be one of {TASKS}, got {task!r}")
        limit = self.max_positions - 4
        budgets = [min(n or limit, limit) for n in (max_new_tokens or [None] * len(audios))]
        if min(budgets) < 1:
            raise InvalidInput("max_new_tokens must be at least 1")
        budget = torch.tensor(budgets, device=self.device)
        features = self.features(audios, self.device).to(self.dtype)
        encoded = self.model.model.encoder(features).last_hidden_state
        cross = [self._heads(layer.encoder_attn.k_proj(encoded)) + self._heads(layer.encoder_attn.v_proj(encoded))
                 for layer in self.model.model.decoder.layers]
        batch = len(audios)
        cache = [torch.empty(2, batch, self.heads, self.max_positions, self.head_dim, dtype=self.dtype,
                             device=self.device) for _ in cross]
        lang_ids = [self.languages[lang] if lang else None for lang in languages]
        if any(i is None for i in lang_ids):
            logits = self._step(torch.full((batch, 1), self.sot, device=self.device), 0, cache, cross)
            detected = self.language_ids[logits[:, self.language_ids].argmax(-1)].tolist()
            lang_ids = [i if i is not None else d for i, d in zip(lang_ids, detected)]
        prompt = torch.tensor([[self.sot, lang, self.tasks[task], self.no_timestamps]
                               for lang, task in zip(lang_ids, tasks)], device=self.device)
        logits = self._step(prompt, 0, cache, cross)
        steps = []
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        for step in range(max(budgets)):
            logits[:, self.suppress] = -torch.inf
            if step == 0:
                logits[:, self.begin_suppress] = -torch.inf
            token = torch.where(done, self.eot, logits.argmax(-1))
            steps.append(token)
            done |= (token == self.eot) | (budget == step + 1)
            if bool(done.all()):
                break
            logits = self._step(token[:, None], prompt.shape[1] + step, cache, cross)
        codes = {i: code for code, i in self.languages.items()}
        results = []
        for row, lang, n in zip(torch.stack(steps, dim=1).tolist(), lang_ids, budgets):
            tokens = row[:row.index(self.eot)] if self.eot in row[:n] else row[:n]
            results.append(Transcription(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True), codes[lang]))
        return results

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        """[B, T, d_model] -> ([B, heads, T, head_dim],)"""
        return (x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).transpose(1, 2),)

    def _step(self, ids: torch.Tensor, start: int, cache: list[torch.Tensor], cross: list) -> torch.Tensor:
        """Decoder over `ids` [B, T] at positions start..start+T-1 (the same for every row); logits of the last."""
        decoder = self.model.model.decoder
        end = start + ids.shape[1]
        x = decoder.embed_tokens(ids) + decoder.embed_positions.weight[start:end]
        for layer, kv, (cross_k, cross_v) in zip(decoder.layers, cache, cross):
            h = layer.self_attn_layer_norm(x)
            (q,), (k,), (v,) = (self._heads(proj(h)) for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                                   layer.self_attn.v_proj))
            kv[0, :, :, start:end], kv[1, :, :, start:end] = k, v
            attn = F.scaled_dot_product_attention(q, kv[0, :, :, :end], kv[1, :, :, :end], is_causal=end - start > 1)
            x = x + layer.self_attn.out_proj(attn.transpose(1, 2).flatten(2))
            (q,) = self._heads(layer.encoder_attn.q_proj(layer.encoder_attn_layer_norm(x)))
            attn = F.scaled_dot_product_attention(q, cross_k, cross_v)
            x = x + layer.encoder_attn.out_proj(attn.transpose(1, 2).flatten(2))
            x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
        return self.model.proj_out(decoder.layer_norm(x[:, -1])).float()
