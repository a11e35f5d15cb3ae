"""llm: a Llama / Qwen2 / Mistral checkpoint placed in the repository as it is (the engine in backends/llm loads it),
greedy parity with transformers checked for small models, served by the `mm_llm` backend with the engine's
parameters in the config; or a TensorRT-LLM engine (not verified here)."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.fp8 import Fp8Scheme
from backends.llm.model import ModelArgs
from backends.llm.requests import GENERATION_INPUTS
from build_engines.common import (BuildOptions, Progress, instance_kind, place_and_verify, place_checkpoint,
                                  up_to_date)
from build_engines.export import VerificationError
from build_engines.quantize import calibrate, write_fp8_checkpoint
from build_engines.repository import PythonModelConfig, Tensor, write_engine_metadata

LLM_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "chat_template.jinja")


def build_llm(opts: BuildOptions) -> None:
    """Copy the checkpoint and tokenizer into model_repository/llm/1 (the engine in backends/llm loads them as
    they are), check greedy parity with transformers for small models, write the decoupled config."""

    if opts.runtime == "tensorrt_llm":
        return build_tensorrt_llm(opts)
    if opts.runtime != "torch":
        raise RuntimeError(f"llm runs on the engine in backends/llm (--runtime torch) or TensorRT-LLM "
                           f"(--runtime tensorrt_llm), not --runtime {opts.runtime}")
    name = opts.model_name("llm")
    if up_to_date(opts, [name]):
        return
    ModelArgs.from_checkpoint(opts.checkpoint)  # an unsupported family fails here, before anything is copied
    fp8 = opts.precision == "fp8"  # FP8 weights; the rest of the model computes in bf16
    params = opts.parameters(EngineConfig, dtype="bf16" if fp8 else opts.precision, device=opts.device)
    progress = Progress(name, 4 if opts.draft else 3)
    version_dir = opts.repository / name / "1"
    if fp8:
        scheme = Fp8Scheme("channel", opts.fp8_activations, () if opts.fp8_lm_head else ("lm_head",),
                           opts.kv_cache_dtype == "fp8")
        needs_prompts = scheme.calibrated or opts.fp8_rounding == "gptq"
        prompts = calibration_prompts(opts.checkpoint, opts.calibration, opts.device) if needs_prompts else None
        scales = calibrate(opts.checkpoint, prompts) if scheme.calibrated else None
        activations = {"token": "per-token", "tensor": "calibrated static", "none": "bf16"}[scheme.activations]
        with progress.step(f"quantizing {opts.checkpoint} to FP8 E4M3 (per-channel weights rounded "
                           f"{'by GPTQ' if opts.fp8_rounding == 'gptq' else 'to nearest'}, {activations} activations"
                           f"{', FP8 LM head' if opts.fp8_lm_head else ''}"
                           f"{', FP8 KV cache' if scheme.kv_cache else ''})"):
            write_fp8_checkpoint(opts.checkpoint, version_dir, scheme, scales,
                                 prompts if opts.fp8_rounding == "gptq" else None)
    else:
        place_and_verify(opts.checkpoint, version_dir, LLM_FILES, verify_llm, progress)
    shutil.rmtree(version_dir / "draft", ignore_errors=True)  # an earlier build's
    if opts.draft:
        with progress.step(f"copying the draft model {opts.draft} into {version_dir / 'draft'}"):
            place_checkpoint(opts.draft, version_dir / "draft", LLM_FILES)
    with progress.step("writing config.pbtxt"):
        opts.write(generation_config(opts, name, "mm_llm", [], params))
        write_engine_metadata(version_dir, runtime="torch", precision=opts.precision,
                              fingerprint=opts.fingerprint(name), checkpoint=str(opts.checkpoint.resolve()))


DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration_prompts.txt"  # 64 varied requests
CALIBRATION_ANSWER_TOKENS = 128


def calibration_prompts(checkpoint: Path, prompts_file: Path | None = None, device: str = "cpu",
                        answer_tokens: int = CALIBRATION_ANSWER_TOKENS) -> list[list[int]]:
    """Calibration sequences from a text file of requests (one per line; default: the builder's own 64): each as a
    user turn of the checkpoint's chat template (plain text where it has none) followed by the model's own greedy
    answer. Static scales and GPTQ's Hessians should see what the served model reads and writes; on SmolLM2 the
    prompts alone (1.2K tokens) left weights-only GPTQ at KL 0.0129, with the answers 0.01 or less
    (perf.fp8_quality)."""
    from transformers import AutoTokenizer

    from backends.llm.sampling import SamplingParams

    prompts_file = prompts_file or DEFAULT_CALIBRATION
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    lines = [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{prompts_file}: no prompts to calibrate with")
    if tokenizer.chat_template:
        lines = [tokenizer.apply_chat_template([{"role": "user", "content": line}], add_generation_prompt=True,
                                               tokenize=False) for line in lines]
    cuda = device != "cpu" and torch.cuda.is_available()
    engine = LLMEngine(checkpoint, EngineConfig(dtype="bf16" if cuda else "fp32", device="cuda" if cuda else "cpu",
                                                kv_cache_memory_mb=1024, prefix_caching=False))
    return [s.prompt_ids + s.output_ids for s in engine.generate(lines, SamplingParams(max_tokens=answer_tokens))]


def generation_config(opts: BuildOptions, name: str, backend: str, extra_inputs: list[Tensor],
                      params: EngineConfig) -> PythonModelConfig:
    """A decoupled model taking tensorrtllm_backend's generation inputs and streaming `text_output`; its final
    response also carries `finish_reason` (OpenAI's: "stop" or "length"), so a client can tell a finished stream from
    one that a failed server or a proxy cut short."""
    return PythonModelConfig(
        name, backend, [*extra_inputs, *(Tensor(n, d, dims, optional=o) for n, d, dims, o in GENERATION_INPUTS)],
        [Tensor("text_output", "BYTES", [1]), Tensor("finish_reason", "BYTES", [1])], params, max_batch_size=0, max_queue_delay_us=None, instances=1,
        kind=instance_kind(opts), decoupled=True)


def verify_llm(checkpoint: Path, prompts=("a photo of the cat", "red car"), tokens: int = 8) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from backends.llm.sampling import SamplingParams

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

    engine_dir = opts.repository / opts.model_name("llm") / "1" / "tensorrt_llm"
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[opts.precision]
    llm = LLM(model=str(opts.checkpoint), dtype=dtype, build_config=BuildConfig(max_batch_size=opts.max_batch_size))
    llm.save(str(engine_dir))
    print(f"llm: TensorRT-LLM engine saved to {engine_dir}; serve it with tensorrtllm_backend (the `llm` model here "
          "runs the PyTorch engine)")
