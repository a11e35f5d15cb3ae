"""`make demo`: start a real tritonserver on the built repository, call every model once through the CLI, stop."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from PIL import Image, ImageDraw

from backends.server import TritonServer
from client.__main__ import main as cli


def sample_image(path: Path) -> Path:
    """A small synthetic photo-like picture (no downloads on a fresh machine)."""
    image = Image.new("RGB", (480, 320), (110, 170, 230))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 220, 480, 320), fill=(60, 150, 60))
    draw.ellipse((180, 120, 300, 240), fill=(230, 140, 40))
    image.save(path, "JPEG", quality=90)
    return path


def sample_speech(path: Path) -> Path:
    """Two seconds of a gliding tone with a little noise, as a WAV file (no downloads)."""
    import numpy as np
    import soundfile as sf

    t = np.arange(32000) / 16000
    tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * t) * t) + 0.01 * np.random.default_rng(0).normal(size=t.size)
    sf.write(path, tone.astype(np.float32), 16000)
    return path


def chat_prompt(model_folder: Path, question: str) -> str:
    """The question in the model's own chat template (the `llm`-style models take the templated text as is)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def openai_demo(grpc_url: str, port: int) -> None:
    """The OpenAI-compatible frontend (`make openai`) over the same server, called with the official client."""
    import threading
    import time

    import openai
    import uvicorn

    from frontend.app import create_app

    frontend = uvicorn.Server(uvicorn.Config(create_app(grpc_url, Path("model_repository")), host="127.0.0.1",
                                             port=port, log_level="warning"))
    threading.Thread(target=frontend.run, daemon=True).start()
    while not frontend.started:
        time.sleep(0.05)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    print(f"\n== the OpenAI-compatible API (make openai) on port {port}, with the openai client:", flush=True)
    print("models:", ", ".join(m.id for m in api.models.list()))
    answer = api.chat.completions.create(model="smollm2", max_tokens=32,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    print("chat (smollm2):", answer.choices[0].message.content)
    print("embedding (clip_text):", len(api.embeddings.create(model="clip_text", input="a dog").data[0].embedding),
          "floats")
    frontend.should_exit = True


def main() -> int:
    ports = {k: int(os.environ.get(k, d)) for k, d in (("HTTP_PORT", 8000), ("GRPC_PORT", 8001), ("METRICS_PORT", 8002))}
    with tempfile.TemporaryDirectory() as tmp, TritonServer(
            Path("model_repository"), ports["HTTP_PORT"], ports["GRPC_PORT"], ports["METRICS_PORT"],
            Path("logs/demo-tritonserver.log")) as server:
        image = sample_image(Path(tmp) / "field.jpg")
        steps = [
            ("classification (vit, HTTP)", ["--url", server.http_url, "classify", str(image), "--top-k", "3"]),
            ("embeddings (clip_vision + clip_text, gRPC)", ["--protocol", "grpc", "--url", server.grpc_url, "embed",
                                                            "--image", str(image), "--text", "a photo of a dog"]),
            ("similarity (clip pipeline)", ["--url", server.http_url, "similarity", str(image),
                                            "a photo of a dog", "a red car", "a tree on grass"]),
            ("generation (llm, gRPC streaming)", ["--url", server.grpc_url, "generate", "a photo of the cat",
                                                  "--max-tokens", "24", "--stream"]),
            ("chat with a trained model (smollm2 = SmolLM2-135M-Instruct, its chat template, gRPC streaming)",
             ["--url", server.grpc_url, "generate", chat_prompt(Path("model_repository/smollm2/1"),
                                                                "What is the capital of France?"),
              "--model", "smollm2", "--max-tokens", "48", "--stream"]),
            ("image tiling (anyres, HTTP)", ["--url", server.http_url, "tile", str(image)]),
            ("visual question (vlm, gRPC streaming)", ["--url", server.grpc_url, "generate", "what is in this picture?",
                                                       "--image", str(image), "--max-tokens", "16", "--stream"]),
            ("speech recognition (whisper, HTTP)", ["--url", server.http_url, "transcribe",
                                                    str(sample_speech(Path(tmp) / "tone.wav")), "--max-tokens", "16"]),
            ("segmentation (sam, HTTP; writes a PNG overlay)", ["--url", server.http_url, "segment", str(image),
                                                               "--point", "240,180"]),
        ]
        for title, args in steps:
            print(f"\n== {title}: python -m client {' '.join(args)}", flush=True)
            if cli(args) != 0:  # the CLI printed why
                return 1
        openai_demo(server.grpc_url, int(os.environ.get("OPENAI_PORT", 9000)))
        print("\n(apart from smollm2, tiny random-init models: their labels, scores and text are not meaningful; the "
              "serving path is real)")
    print("tritonserver stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
