"""python -m build_engines <model> [--checkpoint DIR | --tiny | --random-init PRESET] [--runtime ...] [--precision ...]"""
from __future__ import annotations

import argparse
from pathlib import Path

from build_engines.checkpoints import RANDOM_INIT, TINY_ROOT, random_init_checkpoint, tiny_checkpoint
from build_engines.targets import DEFAULT_RUNTIME, FAMILIES, BuildOptions


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m build_engines", description=__doc__)
    parser.add_argument("model", choices=[*FAMILIES, "all"], help="model family (clip builds clip_vision, clip_text "
                        "and the clip pipeline)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="local Hugging Face checkpoint directory")
    source.add_argument("--tiny", action="store_true", help=f"random-init tiny model (saved under {TINY_ROOT}/)")
    source.add_argument("--random-init", choices=sorted(RANDOM_INIT),
                        help="real-size architecture with random weights (for benchmarks; saved under "
                             f"{TINY_ROOT}/)")
    parser.add_argument("--runtime", choices=["onnxruntime", "torch", "tensorrt", "tensorrt_llm"],
                        help=f"default per family: {DEFAULT_RUNTIME}")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32")
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-queue-delay-us", type=int, default=2000, help="dynamic batcher window")
    parser.add_argument("--instances", type=int, default=1, help="model instances per device")
    parser.add_argument("--prepare-threads", type=int, default=4, help="image decode/preprocess threads per instance")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--execution-env", default="auto",
                        help="venv the python stub runs in: auto (this venv), none (system Python, e.g. NGC), or PATH")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    if args.checkpoint and args.model == "all":
        parser.error("--checkpoint needs one model family, not 'all'")
    if args.random_init and RANDOM_INIT[args.random_init][0] != args.model:
        parser.error(f"--random-init {args.random_init} is a {RANDOM_INIT[args.random_init][0]} model, not {args.model}")
    if args.checkpoint and not (args.checkpoint / "config.json").exists():
        parser.error(f"{args.checkpoint} is not a Hugging Face checkpoint directory (no config.json)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    families = list(FAMILIES) if args.model == "all" else [args.model]
    for family in families:
        if args.random_init:
            checkpoint = random_init_checkpoint(args.random_init)[1]
        else:
            checkpoint = args.checkpoint or tiny_checkpoint(family)
        opts = BuildOptions(checkpoint, args.runtime or DEFAULT_RUNTIME[family], args.precision, args.repository,
                            args.max_batch_size, args.max_queue_delay_us, args.instances, args.device, args.execution_env,
                            args.prepare_threads, args.force)
        try:
            FAMILIES[family](opts)
        except RuntimeError as exc:  # unavailable runtime, failed verification: one clear line, non-zero exit
            print(f"\nbuild_engines {family}: {exc}")
            return 1
    return 0
