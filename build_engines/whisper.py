"""whisper: a Hugging Face Whisper checkpoint placed in the repository as it is (the engine in backends/whisper runs
transformers' encoder and decoder modules with its own KV cache), served by the `mm_whisper` backend."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backends.mm_whisper.model import AUDIO
from backends.whisper.engine import WhisperEngine, WhisperParams
from build_engines.common import (BuildOptions, Progress, clear_other_layout, instance_kind, place_and_verify,
                                  up_to_date)
from build_engines.export import VerificationError
from build_engines.repository import EnsembleConfig, PythonModelConfig, Tensor, write_engine_metadata

WHISPER_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                 "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "normalizer.json", "added_tokens.json", "special_tokens_map.json")


def build_whisper(opts: BuildOptions) -> None:
    """The `whisper` model from a Hugging Face Whisper checkpoint (the engine in backends/whisper runs
    transformers' encoder and decoder modules with its own KV cache): files linked or copied into
    model_repository/whisper/1, greedy tokens checked against transformers generate for small checkpoints. With
    --ensemble `whisper` is an ensemble of whisper_audio (CPU instances: decode, resample) and whisper_decoder (the
    engine, its files in whisper_decoder/1), the same tensors for clients."""
    if opts.runtime != "torch":
        raise RuntimeError(f"whisper runs on the PyTorch engine in backends/whisper (--runtime torch), not "
                           f"--runtime {opts.runtime}")
    name = opts.model_name("whisper")
    engine = f"{name}_decoder" if opts.ensemble else name
    if up_to_date(opts, [engine], name):
        return
    # our batcher by default: the engine batches continuously (requests join and leave its decoder batch per step)
    params = opts.parameters(WhisperParams, dtype=opts.precision, device=opts.device,
                             prepare_threads=opts.prepare_threads, batch_window="adaptive")
    progress = Progress(name, 3)
    version_dir = opts.repository / engine / "1"
    place_and_verify(opts.checkpoint, version_dir, WHISPER_FILES, verify_whisper, progress)
    options = [Tensor("language", "BYTES", [1], optional=True), Tensor("task", "BYTES", [1], optional=True),
               Tensor("max_tokens", "INT32", [1], optional=True)]
    audio, samples = Tensor("audio", "BYTES", [1]), Tensor(AUDIO, "FP32", [-1], ragged=True)
    outputs = [Tensor("text", "BYTES", [1]), Tensor("tokens", "INT32", [-1])]
    max_batch = min(opts.max_batch_size, 16)
    with progress.step("writing config.pbtxt"):
        opts.write(PythonModelConfig(
            engine, "mm_whisper", [samples if opts.ensemble else audio, *options], outputs, params,
            max_batch_size=max_batch, max_queue_delay_us=opts.max_queue_delay_us, instances=1,
            kind=instance_kind(opts), priority_levels=opts.priority_levels))
        write_engine_metadata(version_dir, runtime="torch", precision=opts.precision,
                              fingerprint=opts.fingerprint(engine), checkpoint=str(opts.checkpoint.resolve()))
        steps = (f"{name}_audio", f"{name}_decoder")
        clear_other_layout(opts, name, steps)
        if not opts.ensemble:
            return
        opts.write(PythonModelConfig(steps[0], "mm_whisper", [audio], [samples], params, max_batch_size=max_batch,
                                     max_queue_delay_us=opts.max_queue_delay_us, instances=opts.preprocess_instances,
                                     kind="KIND_CPU", priority_levels=opts.priority_levels))
        by_name = {t.name: t.name for t in options}
        opts.write(EnsembleConfig(name, [audio, *options], outputs,
                                  [(steps[0], {"audio": "audio"}, {AUDIO: AUDIO}),
                                   (steps[1], {AUDIO: AUDIO, **by_name}, {t.name: t.name for t in outputs})],
                                  max_batch))


def verify_whisper(checkpoint: Path, seconds=(2.0, 9.0), tokens: int = 12) -> None:
    from transformers import WhisperForConditionalGeneration

    engine = WhisperEngine(checkpoint, "fp32", "cpu")
    reference = WhisperForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    clips = [rng.normal(0, 0.1, int(16000 * s)).astype(np.float32) for s in seconds]
    ours = engine.transcribe(clips, ["en"] * len(clips), ["transcribe"] * len(clips), [tokens] * len(clips))
    for clip, result in zip(clips, ours):
        features = engine.features([clip], engine.device)
        with torch.inference_mode():
            expected = reference.generate(features, language="en", task="transcribe", max_new_tokens=tokens)[0]
        expected = [t for t in expected.tolist() if t != engine.eot]
        if result.tokens != expected:
            raise VerificationError(f"whisper greedy tokens differ from transformers: {result.tokens} vs {expected}")
