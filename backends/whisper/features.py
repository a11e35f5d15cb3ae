"""Whisper's log-mel spectrogram for a batch of clips, on the engine's device, in float64.

The steps are WhisperFeatureExtractor's (zero-pad or cut to 30 s, centred STFT with a periodic Hann window, power,
the extractor's own mel filter bank, log10, floor at 8 below the maximum, (x + 4) / 4). The extractor's torch path
runs them in float32 and drifts up to ~1e-4 from its numpy reference; float64 keeps this within 1e-6 of it, and
the FFTs of a batch of 30 s clips are cheap in float64 even on a GPU.
"""
from __future__ import annotations

import numpy as np
import torch


class LogMel:
    def __init__(self, extractor):
        self.n_fft, self.hop, self.n_samples = extractor.n_fft, extractor.hop_length, extractor.n_samples
        self.filters = torch.from_numpy(np.asarray(extractor.mel_filters, dtype=np.float64))  # [freqs, mels]
        self.window = torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64)
        self.num_mels = self.filters.shape[1]
        self.on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (window, filters) copies

    def __call__(self, clips: list[np.ndarray], device: torch.device) -> torch.Tensor:
        """16 kHz mono clips -> float32 [len(clips), mels, 3000] on `device`."""
        return self.from_waves(self.waves(clips).to(device))

    def waves(self, clips: list[np.ndarray], pinned: bool = False) -> torch.Tensor:
        """The clips zero-padded or cut to 30 s: float32 [len(clips), n_samples] on the host (half the bytes of
        float64 to copy); `pinned`: in page-locked memory, so that a copy to the GPU does not block the host."""
        batch = torch.zeros((len(clips), self.n_samples), dtype=torch.float32, pin_memory=pinned)
        for row, clip in zip(batch.numpy(), clips):
            row[:min(len(clip), self.n_samples)] = clip[:self.n_samples]
        return batch

    def from_waves(self, waves: torch.Tensor) -> torch.Tensor:
        """waves [n, n_samples] -> float32 [n, mels, 3000], on their device, each row on its own (no host copies:
        it can be captured in a CUDA graph once a call has put the window and filters on the device)."""
        if waves.device not in self.on_device:
            self.on_device[waves.device] = self.window.to(waves.device), self.filters.to(waves.device)
        window, filters = self.on_device[waves.device]
        stft = torch.stft(waves.double(), self.n_fft, self.hop, window=window, return_complex=True)
        power = stft[..., :-1].abs() ** 2
        log = (filters.T @ power).clamp(min=1e-10).log10()
        log = torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8.0)
        return ((log + 4.0) / 4.0).float()
