"""What each model family builds: wrappers that define the served tensors, and the model folders they fill."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from backends.devices import DTYPES
from build_engines.export import EngineSpec, VerificationError, build_tensorrt, export_onnx, export_torch, profile_shapes, \
    tensorrt_unavailable, verify
from build_engines.repository import PythonModelConfig, Tensor, execution_env, sample_png, write_engine_metadata, \
    write_model

BATCH = ("batch", 4096)  # dynamic batch axis of every engine (symbolic name, largest size)


@dataclass(frozen=True)
class BuildOptions:
    checkpoint: Path
    runtime: str = "onnxruntime"
    precision: str = "fp32"
    repository: Path = Path("model_repository")
    max_batch_size: int = 64
    max_queue_delay_us: int = 2000
    instances: int = 1
    device: str = "auto"
    execution_env: str = "auto"
    prepare_threads: int = 4
    force: bool = False

    def fingerprint(self, family: str) -> str:
        """Changes whenever the checkpoint, an option that shapes the artefacts or the builder's own code changes."""
        weights = sorted(p for p in self.checkpoint.iterdir() if p.is_file())
        stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in weights]
        options = {k: str(v.resolve() if isinstance(v, Path) else v) for k, v in asdict(self).items() if k != "force"}
        code = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).parent.glob("*.py"))))
        return hashlib.sha256(json.dumps([family, options, stamp, code.hexdigest()]).encode()).hexdigest()[:16]


class Progress:
    """One line per build step with its duration: long exports show where they are."""

    def __init__(self, name: str, steps: int):
        self.name, self.steps, self.done = name, steps, 0

    def step(self, what: str):
        self.done += 1
        print(f"[{self.name} {self.done}/{self.steps}] {what} ...", end="", flush=True)
        return _Timer()


class _Timer:
    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, exc_type, *_):
        print(f" {'failed' if exc_type else 'done'} in {time.perf_counter() - self.start:.1f}s", flush=True)


class ViTLogits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values=pixel_values).logits


class ClipImageEmbeds(torch.nn.Module):
    """L2-normalised projected image embedding, as CLIPModel's `image_embeds`."""

    def __init__(self, clip):
        super().__init__()
        self.vision, self.projection = clip.vision_model, clip.visual_projection

    def forward(self, pixel_values):
        embeds = self.projection(self.vision(pixel_values=pixel_values).pooler_output)
        return embeds / embeds.norm(p=2, dim=-1, keepdim=True)


class ClipTextEmbeds(torch.nn.Module):
    """L2-normalised projected text embedding, as CLIPModel's `text_embeds`."""

    def __init__(self, clip):
        super().__init__()
        self.text, self.projection = clip.text_model, clip.text_projection

    def forward(self, input_ids, attention_mask):
        embeds = self.projection(self.text(input_ids=input_ids, attention_mask=attention_mask).pooler_output)
        return embeds / embeds.norm(p=2, dim=-1, keepdim=True)


def image_inputs(height: int, width: int):
    def make(batch: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(batch, 3, height, width)}
    return make


def text_inputs(vocab_size: int, eos_id: int):
    def make(batch: int) -> dict[str, torch.Tensor]:
        seq = 6 + 3 * batch
        ids = torch.randint(0, vocab_size, (batch, seq))
        ids[:, -1] = eos_id
        mask = torch.ones(batch, seq, dtype=torch.long)
        if batch > 1:  # a shorter row, padded, exercises the attention mask
            ids[0, seq // 2] = eos_id
            mask[0, seq // 2 + 1:] = 0
        return {"input_ids": ids, "attention_mask": mask}
    return make


def build_engine(spec: EngineSpec, version_dir: Path, opts: BuildOptions, progress: Progress) -> float:
    """Export in the requested precision, verify against the fp32 module, write engine.json. Returns max error.

    TensorRT builds from an fp32 ONNX graph (verified like any other) and applies the precision in its builder."""
    if opts.runtime == "tensorrt" and (reason := tensorrt_unavailable()):
        raise RuntimeError(reason)
    if opts.runtime == "onnxruntime" and opts.precision == "bf16":
        raise RuntimeError("onnxruntime has no bf16 kernels for these models: use --runtime torch for bf16")
    version_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("model.onnx", "model.onnx.data", "model.pt2", "model.plan"):
        (version_dir / stale).unlink(missing_ok=True)
    export_precision = "fp32" if opts.runtime == "tensorrt" else opts.precision
    dtype = DTYPES[export_precision]
    typed = EngineSpec(copy.deepcopy(spec.module).to(dtype),
                       lambda b: {k: v.to(dtype) if v.is_floating_point() and k not in spec.keep_fp32 else v
                                  for k, v in spec.make_inputs(b).items()},
                       spec.dynamic_axes, spec.outputs, spec.keep_fp32)
    if opts.runtime == "torch":
        from backends.runtime import TorchRuntime

        device = "cuda" if instance_kind(opts) == "KIND_GPU" else "cpu"
        with progress.step(f"exporting torch program ({opts.precision}, {device})"):
            export_torch(typed, version_dir / "model.pt2", device)
        engine = TorchRuntime(version_dir / "model.pt2", spec.outputs, device)
    else:
        from backends.runtime import OnnxRuntime

        with progress.step(f"exporting ONNX ({export_precision}, dynamic batch)"):
            export_onnx(typed, version_dir / "model.onnx")
        engine = OnnxRuntime(version_dir / "model.onnx", "cpu")
    with progress.step("verifying the engine against PyTorch on random inputs"):
        error = verify(spec, engine.run, export_precision)
    if opts.runtime == "tensorrt":
        with progress.step("building TensorRT plan"):
            build_tensorrt(version_dir / "model.onnx", version_dir / "model.plan", opts.precision,
                           profile_shapes(spec, opts.max_batch_size))
    write_engine_metadata(version_dir, runtime=opts.runtime, precision=opts.precision, outputs=spec.outputs,
                          max_error_vs_torch=error,
                          fingerprint=opts.fingerprint(version_dir.relative_to(opts.repository).parts[0]),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"    max |engine - torch| = {error:.2e} of the largest output (tolerance: build_engines/export.py)")
    return error


def up_to_date(opts: BuildOptions, names: list[str]) -> bool:
    for name in names:
        meta = opts.repository / name / "1" / "engine.json"
        if opts.force or not meta.exists() or not (opts.repository / name / "config.pbtxt").exists():
            return False
        if json.loads(meta.read_text()).get("fingerprint") != opts.fingerprint(name):
            return False
    return True


def common_parameters(opts: BuildOptions) -> dict[str, str]:
    params = {"runtime": opts.runtime, "device": opts.device, "prepare_threads": str(opts.prepare_threads)}
    env = execution_env(opts.execution_env)
    if env:
        params["EXECUTION_ENV_PATH"] = env
    return params


def instance_kind(opts: BuildOptions) -> str:
    return "KIND_GPU" if opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available()) else "KIND_CPU"


def build_vit(opts: BuildOptions) -> None:
    from transformers import AutoImageProcessor, ViTForImageClassification

    if up_to_date(opts, ["vit"]):
        print("vit: up to date")
        return
    progress = Progress("vit", 4)
    version_dir = opts.repository / "vit" / "1"
    with progress.step(f"loading {opts.checkpoint}"):
        model = ViTForImageClassification.from_pretrained(opts.checkpoint, dtype=torch.float32).eval()
        processor = AutoImageProcessor.from_pretrained(opts.checkpoint)
        version_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(version_dir)
    size = model.config.image_size
    spec = EngineSpec(ViTLogits(model), image_inputs(size, size), {"pixel_values": {0: BATCH}}, ["logits"])
    build_engine(spec, version_dir, opts, progress)
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    (opts.repository / "vit" / "labels.txt").write_text("\n".join(labels) + "\n")
    with progress.step("writing config.pbtxt"):
        write_model(opts.repository, PythonModelConfig(
            "vit", [Tensor("image", "BYTES", [1])], [Tensor("logits", "FP32", [len(labels)], "labels.txt")],
            opts.max_batch_size, opts.max_queue_delay_us, opts.instances, instance_kind(opts),
            common_parameters(opts), "image"), sample_png())


def build_clip(opts: BuildOptions) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    names = ["clip_vision", "clip_text"]
    if up_to_date(opts, names):
        print("clip: up to date")
        return
    progress = Progress("clip", 6)
    with progress.step(f"loading {opts.checkpoint}"):
        clip = CLIPModel.from_pretrained(opts.checkpoint, dtype=torch.float32).eval()
        processor = AutoImageProcessor.from_pretrained(opts.checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(opts.checkpoint)
    vision_dir, text_dir = (opts.repository / n / "1" for n in names)
    vision_dir.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(vision_dir)
    size = clip.config.vision_config.image_size
    build_engine(EngineSpec(ClipImageEmbeds(clip), image_inputs(size, size), {"pixel_values": {0: BATCH}},
                            ["image_embeds"]), vision_dir, opts, progress)
    text_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(text_dir / "tokenizer")
    text_cfg = clip.config.text_config
    build_engine(EngineSpec(ClipTextEmbeds(clip), text_inputs(text_cfg.vocab_size, text_cfg.eos_token_id),
                            {name: {0: BATCH, 1: ("sequence", text_cfg.max_position_embeddings)}
                             for name in ("input_ids", "attention_mask")},
                            ["text_embeds"]), text_dir, opts, progress)
    dim = clip.config.projection_dim
    params, kind = common_parameters(opts), instance_kind(opts)
    with progress.step("writing config.pbtxt for clip_vision, clip_text, clip"):
        write_model(opts.repository, PythonModelConfig(
            "clip_vision", [Tensor("image", "BYTES", [1])], [Tensor("image_embeds", "FP32", [dim])],
            opts.max_batch_size, opts.max_queue_delay_us, opts.instances, kind, params, "image"), sample_png())
        write_model(opts.repository, PythonModelConfig(
            "clip_text", [Tensor("text", "BYTES", [1])], [Tensor("text_embeds", "FP32", [dim])],
            opts.max_batch_size, opts.max_queue_delay_us, opts.instances, kind, params, "text"), b"a photo of a cat")
        pipeline_params = {k: v for k, v in params.items() if k == "EXECUTION_ENV_PATH"}
        pipeline_params.update(logit_scale=repr(math.exp(clip.logit_scale.item())),
                               text_max_batch_size=str(opts.max_batch_size))
        write_model(opts.repository, PythonModelConfig(
            "clip", [Tensor("image", "BYTES", [1]), Tensor("text", "BYTES", [-1])],
            [Tensor("scores", "FP32", [-1]), Tensor("probs", "FP32", [-1])],
            max_batch_size=0, max_queue_delay_us=None, instances=2, kind="KIND_CPU", parameters=pipeline_params))



LLM_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "chat_template.jinja")
VERIFY_BELOW_BYTES = 512 * 2**20  # greedy parity with transformers on the CPU: cheap only for small models


def place_checkpoint(checkpoint: Path, version_dir: Path, patterns: tuple[str, ...]) -> None:
    """Put the checkpoint's files in the model version folder: hard links where the file system allows (an 8 B
    model is 16 GB: no second copy), copies otherwise. Weights of an earlier build are removed first."""
    version_dir.mkdir(parents=True, exist_ok=True)
    for stale in version_dir.glob("*.safetensors"):
        stale.unlink()
    for pattern in patterns:
        for file in checkpoint.glob(pattern):
            target = version_dir / file.name
            target.unlink(missing_ok=True)
            try:
                os.link(file, target)
            except OSError:
                shutil.copy2(file, target)


def place_and_verify(checkpoint: Path, version_dir: Path, patterns: tuple[str, ...], verify,
                     progress: Progress) -> None:
    """place_checkpoint, then `verify(version_dir)` (greedy tokens vs transformers on the CPU) when the weights are
    small enough for that to be cheap."""
    with progress.step(f"copying {checkpoint} into {version_dir}"):
        place_checkpoint(checkpoint, version_dir, patterns)
    size = sum(f.stat().st_size for f in version_dir.glob("*.safetensors"))
    if size < VERIFY_BELOW_BYTES:
        with progress.step("greedy tokens vs transformers generate on the CPU"):
            verify(version_dir)
    else:
        print(f"    parity check skipped: {size / 2**30:.1f} GiB of weights (tests cover the engine on tiny models)")


def build_llm(opts: BuildOptions) -> None:
    """Copy the checkpoint and tokenizer into model_repository/llm/1 (the engine in backends/llm loads them as
    they are), check greedy parity with transformers for small models, write the decoupled config."""

    from backends.generation import GENERATION_INPUTS
    from backends.llm.model import ModelArgs

    if opts.runtime == "tensorrt_llm":
        return build_tensorrt_llm(opts)
    if opts.runtime != "torch":
        raise RuntimeError(f"llm runs on the engine in backends/llm (--runtime torch) or TensorRT-LLM "
                           f"(--runtime tensorrt_llm), not --runtime {opts.runtime}")
    if up_to_date(opts, ["llm"]):
        print("llm: up to date")
        return
    ModelArgs.from_checkpoint(opts.checkpoint)  # an unsupported family fails here, before anything is copied
    progress = Progress("llm", 3)
    version_dir = opts.repository / "llm" / "1"
    place_and_verify(opts.checkpoint, version_dir, LLM_FILES, verify_llm, progress)
    with progress.step("writing config.pbtxt"):
        params = {k: v for k, v in common_parameters(opts).items() if k not in ("runtime", "prepare_threads")}
        params["dtype"] = opts.precision
        write_model(opts.repository, PythonModelConfig(
            "llm", [Tensor(n, d, dims, optional=o) for n, d, dims, o in GENERATION_INPUTS],
            [Tensor("text_output", "BYTES", [1])], max_batch_size=0, max_queue_delay_us=None, instances=1,
            kind=instance_kind(opts), parameters=params, decoupled=True))
        write_engine_metadata(version_dir, runtime="torch", precision=opts.precision,
                              fingerprint=opts.fingerprint("llm"), checkpoint=str(opts.checkpoint.resolve()))


def verify_llm(checkpoint: Path, prompts=("a photo of the cat", "red car"), tokens: int = 8) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.generation import SamplingParams
    from backends.llm.engine import EngineConfig, LLMEngine

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = LLMEngine(checkpoint, EngineConfig(dtype="fp32", device="cpu", kv_cache_memory_mb=16))
    for prompt, seq in zip(prompts, engine.generate(list(prompts), SamplingParams(max_tokens=tokens))):
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            expected = reference.generate(**ids, max_new_tokens=tokens, do_sample=False)[0, ids.input_ids.shape[1]:]
        expected = expected.tolist()
        if engine.eos_ids and expected[-1] in engine.eos_ids:
            expected = expected[:-1]
        if seq.output_ids != expected[:len(seq.output_ids)] or len(seq.output_ids) != len(expected):
            raise VerificationError(f"llm: greedy tokens for {prompt!r} differ from transformers: "
                                    f"{seq.output_ids} vs {expected}")


def tensorrt_llm_unavailable() -> str | None:
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:
        return ("tensorrt_llm is not installed (its wheels come from NVIDIA's index, which this environment cannot "
                "reach); build with --runtime torch")
    return None



def build_tensorrt_llm(opts: BuildOptions) -> None:
    """A TensorRT-LLM engine through its documented LLM API, for tensorrtllm_backend. NOT verified here: TensorRT-LLM
    cannot be installed in our environment, and the `llm` model in this repository serves the PyTorch engine only."""
    if reason := tensorrt_llm_unavailable():
        raise RuntimeError(reason)
    from tensorrt_llm import LLM, BuildConfig

    engine_dir = opts.repository / "llm" / "1" / "tensorrt_llm"
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[opts.precision]
    llm = LLM(model=str(opts.checkpoint), dtype=dtype, build_config=BuildConfig(max_batch_size=opts.max_batch_size))
    llm.save(str(engine_dir))
    print(f"llm: TensorRT-LLM engine saved to {engine_dir}; serve it with tensorrtllm_backend (the `llm` model here "
          "runs the PyTorch engine)")


def build_anyres(opts: BuildOptions) -> None:
    """The `anyres` model from a LLaVA-NeXT checkpoint: its tiling settings (pinpoints, tile, patch, feature
    selection) and image processor config; no weights."""

    from backends.anyres import image_processor_config, tiler_from_checkpoint

    if up_to_date(opts, ["anyres"]):
        print("anyres: up to date")
        return
    tiler = tiler_from_checkpoint(opts.checkpoint)  # a checkpoint that is not LLaVA-NeXT-like fails here
    version_dir = opts.repository / "anyres" / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(opts.checkpoint / "config.json", version_dir / "config.json")
    for name in ("processor_config.json", "preprocessor_config.json"):
        (version_dir / name).unlink(missing_ok=True)
    (version_dir / "preprocessor_config.json").write_text(json.dumps(image_processor_config(opts.checkpoint)))
    if (opts.checkpoint / "processor_config.json").exists():
        shutil.copy2(opts.checkpoint / "processor_config.json", version_dir / "processor_config.json")
    params = {k: v for k, v in common_parameters(opts).items() if k in ("EXECUTION_ENV_PATH", "prepare_threads")}
    write_model(opts.repository, PythonModelConfig(
        "anyres", [Tensor("image", "BYTES", [1])],
        [Tensor("pixel_values", "FP32", [-1, 3, tiler.tile, tiler.tile]), Tensor("num_image_tokens", "INT32", [1])],
        max_batch_size=0, max_queue_delay_us=None, instances=2, kind="KIND_CPU", parameters=params))
    write_engine_metadata(version_dir, runtime="none", fingerprint=opts.fingerprint("anyres"),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"anyres: {len(tiler.pinpoints)} grid pinpoints, {tiler.tile} px tiles, {tiler.patch} px patches")


def build_vlm(opts: BuildOptions) -> None:
    """The `vlm` model from a LLaVA-NeXT checkpoint: the whole checkpoint (vision tower, projector, language model,
    tokenizer, processor configs) copied into model_repository/vlm/1; parity is covered by the tests."""

    from backends.anyres import tiler_from_checkpoint
    from backends.generation import GENERATION_INPUTS

    if up_to_date(opts, ["vlm"]):
        print("vlm: up to date")
        return
    tiler_from_checkpoint(opts.checkpoint)  # a checkpoint that is not LLaVA-NeXT-like fails here
    version_dir = opts.repository / "vlm" / "1"
    place_checkpoint(opts.checkpoint, version_dir, (*LLM_FILES, "processor_config.json", "preprocessor_config.json"))
    params = {k: v for k, v in common_parameters(opts).items() if k != "runtime"}  # prepare_threads: image workers
    params["dtype"] = opts.precision
    write_model(opts.repository, PythonModelConfig(
        "vlm", [Tensor("image", "BYTES", [1]),
                *(Tensor(n, d, dims, optional=o) for n, d, dims, o in GENERATION_INPUTS)],
        [Tensor("text_output", "BYTES", [1])], max_batch_size=0, max_queue_delay_us=None, instances=1,
        kind=instance_kind(opts), parameters=params, decoupled=True))
    write_engine_metadata(version_dir, runtime="torch", precision=opts.precision, fingerprint=opts.fingerprint("vlm"),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"vlm: {opts.checkpoint} ({opts.precision})")


WHISPER_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                 "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "normalizer.json", "added_tokens.json", "special_tokens_map.json")


def build_whisper(opts: BuildOptions) -> None:
    """The `whisper` model from a Hugging Face Whisper checkpoint (the engine in backends/whisper runs
    transformers' encoder and decoder modules with its own KV cache): files linked or copied into
    model_repository/whisper/1, greedy tokens checked against transformers generate for small checkpoints."""
    if opts.runtime != "torch":
        raise RuntimeError(f"whisper runs on the PyTorch engine in backends/whisper (--runtime torch), not "
                           f"--runtime {opts.runtime}")
    if up_to_date(opts, ["whisper"]):
        print("whisper: up to date")
        return
    progress = Progress("whisper", 3)
    version_dir = opts.repository / "whisper" / "1"
    place_and_verify(opts.checkpoint, version_dir, WHISPER_FILES, verify_whisper, progress)
    with progress.step("writing config.pbtxt"):
        params = {k: v for k, v in common_parameters(opts).items() if k != "runtime"}
        params.update(dtype=opts.precision, max_audio_seconds="3600")
        write_model(opts.repository, PythonModelConfig(
            "whisper", [Tensor("audio", "BYTES", [1]), Tensor("language", "BYTES", [1], optional=True),
                        Tensor("task", "BYTES", [1], optional=True),
                        Tensor("max_tokens", "INT32", [1], optional=True)],
            [Tensor("text", "BYTES", [1]), Tensor("tokens", "INT32", [-1])], min(opts.max_batch_size, 16),
            opts.max_queue_delay_us, 1, instance_kind(opts), params))
        write_engine_metadata(version_dir, runtime="torch", precision=opts.precision,
                              fingerprint=opts.fingerprint("whisper"), checkpoint=str(opts.checkpoint.resolve()))


def verify_whisper(checkpoint: Path, seconds=(2.0, 9.0), tokens: int = 12) -> None:
    from transformers import WhisperForConditionalGeneration

    from backends.whisper.engine import WhisperEngine

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


def build_sam(opts: BuildOptions) -> None:
    """The `sam` model: the image encoder and the prompt encoder + mask decoder as two engines (segment-anything's
    ONNX interface, see build_engines/sam_graphs.py) from a Hugging Face SAM checkpoint, each verified against
    PyTorch, with SamProcessor's config beside them for preprocessing."""
    from transformers import SamModel, SamProcessor

    from build_engines.sam_graphs import SamImageEncoder, SamPromptMaskDecoder, decoder_inputs, encoder_inputs

    if up_to_date(opts, ["sam"]):
        print("sam: up to date")
        return
    progress = Progress("sam", 8 if opts.runtime == "tensorrt" else 6)
    version_dir = opts.repository / "sam" / "1"
    with progress.step(f"loading {opts.checkpoint}"):
        sam = SamModel.from_pretrained(opts.checkpoint, dtype=torch.float32).eval()
        processor = SamProcessor.from_pretrained(opts.checkpoint)
        version_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(version_dir)
    prompt_cfg, pad_size = sam.config.prompt_encoder_config, processor.image_processor.pad_size
    low_res = 4 * prompt_cfg.image_embedding_size  # the decoder's mask side (256)
    build_engine(EngineSpec(SamImageEncoder(sam), encoder_inputs(prompt_cfg.image_size), {"pixel_values": {0: BATCH}},
                            ["image_embeddings"]), version_dir / "image_encoder", opts, progress)
    points = ("points", 1024)
    build_engine(EngineSpec(
        SamPromptMaskDecoder(sam, pad_size["height"]), decoder_inputs(
            prompt_cfg.hidden_size, prompt_cfg.image_embedding_size, low_res, prompt_cfg.image_size),
        {"image_embeddings": {0: BATCH}, "point_coords": {0: BATCH, 1: points}, "point_labels": {0: BATCH, 1: points},
         "mask_input": {0: BATCH}, "has_mask_input": {0: BATCH}},
        ["masks", "iou_predictions", "low_res_masks"], keep_fp32=("point_coords",)),
        version_dir / "mask_decoder", opts, progress)
    params = {k: v for k, v in common_parameters(opts).items() if k != "prepare_threads"}
    params["embedding_cache_mb"] = "1024"
    with progress.step("writing config.pbtxt"):
        write_model(opts.repository, PythonModelConfig(
            "sam", [Tensor("image", "BYTES", [1]), Tensor("point_coords", "FP32", [-1, 2], optional=True),
                    Tensor("point_labels", "INT32", [-1], optional=True),
                    Tensor("boxes", "FP32", [-1, 4], optional=True),
                    Tensor("mask_input", "FP32", [1, low_res, low_res], optional=True),
                    Tensor("multimask_output", "BOOL", [1], optional=True)],
            [Tensor("masks", "BOOL", [-1, -1, -1]), Tensor("iou_scores", "FP32", [-1]),
             Tensor("low_res_logits", "FP32", [-1, low_res, low_res])],
            max_batch_size=0, max_queue_delay_us=None, instances=1, kind=instance_kind(opts), parameters=params))
    write_engine_metadata(version_dir, runtime=opts.runtime, precision=opts.precision,
                          fingerprint=opts.fingerprint("sam"), checkpoint=str(opts.checkpoint.resolve()))


FAMILIES = {"vit": build_vit, "clip": build_clip, "llm": build_llm, "anyres": build_anyres, "vlm": build_vlm,
            "whisper": build_whisper, "sam": build_sam}
DEFAULT_RUNTIME = {"vit": "onnxruntime", "clip": "onnxruntime", "llm": "torch", "anyres": "torch", "vlm": "torch",
                   "whisper": "torch", "sam": "onnxruntime"}
