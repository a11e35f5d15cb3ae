"""Where the `vlm` time to first token goes, in process, with the served model's own parts: image preparation (CPU
path and on-device path), vision tower + projector, and the engine's prefill up to the first sampled token, each
timed with the device synchronised (median of --repeats), plus torch.profiler's top operators for one whole pass.

python -m perf.vlm_breakdown [--repository model_repository] [--size 3840x2160]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from pathlib import Path

import torch

from backends.llm.engine import EngineConfig, LLMEngine
from backends.llm.sampling import SamplingParams
from backends.media import device_images
from backends.media.images import ImagePreprocessor
from backends.vision.anyres import image_processor_config, tiler_from_checkpoint
from backends.vision.llava_vision import LlavaVision, expand_placeholder
from perf.inputs import encoded_images
from perf.report import hardware_line, stem


def timed(run, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median ms of `run()` with the device synchronised around it, and its last result."""
    times, out = [], None
    for _ in range(repeats + 1):  # the first run warms up
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        start = time.perf_counter()
        out = run()
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:]), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.vlm_breakdown", description=__doc__)
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--size", default="3840x2160")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    args = parser.parse_args(argv)
    folder = args.repository / "vlm" / "1"
    dtype = json.loads((folder / "engine.json").read_text())["precision"]
    engine = LLMEngine(folder, EngineConfig(dtype=dtype, kv_cache_memory_mb=8192))
    device = engine.device
    tiler, preprocess = tiler_from_checkpoint(folder), ImagePreprocessor.from_dict(image_processor_config(folder))
    vision = LlavaVision(folder, tiler, engine.dtype, device)
    placeholder = engine.tokenizer.convert_tokens_to_ids("<image>")
    width, height = map(int, args.size.split("x"))
    image = encoded_images([(width, height, "JPEG")])[0]
    nvjpeg = device_images.nvjpeg_available(device)

    def on_device():
        return device_images.anyres_tiles(tiler, device_images.decode_to_device(image, device, nvjpeg), preprocess)

    def prefill(embeds, plan):
        ids = expand_placeholder(engine.tokenizer("<image>\n" + "a" * args.prompt_tokens)["input_ids"], placeholder,
                                 plan.num_image_tokens)
        seq = engine.add(ids, SamplingParams(max_tokens=1), embeds=embeds, placeholder_id=placeholder)
        while not seq.output_ids:
            engine.step()
        return seq

    rows = []
    cpu_ms, _ = timed(lambda: tiler.tiles_of_file(image, preprocess), device, args.repeats)
    rows.append(["image: Pillow decode + resize on the CPU (default path)", cpu_ms])
    reduced_ms, _ = timed(lambda: tiler.tiles_of_file(image, preprocess, reduced=True), device, args.repeats)
    rows.append(["image: the same with `decode_reduced` (JPEG decoded at a reduced DCT scale)", reduced_ms])
    device_ms, (tiles, plan) = timed(on_device, device, args.repeats)
    rows.append([f"image: {'nvJPEG' if nvjpeg else 'Pillow'} decode + torch resize on {device}", device_ms])
    vision_ms, embeds = timed(lambda: vision(tiles.to(device, engine.dtype), [plan])[0], device, args.repeats)
    rows.append([f"vision tower + projector ({plan.num_tiles} tiles -> {plan.num_image_tokens} tokens)", vision_ms])
    prefill_ms, seq = timed(lambda: prefill(embeds, plan), device, args.repeats)
    rows.append([f"engine prefill of {seq.num_tokens - 1} tokens to the first token", prefill_ms])
    rows.append(["sum with the on-device image path", device_ms + vision_ms + prefill_ms])

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as profile:
        tiles, plan = on_device()
        prefill(vision(tiles.to(device, engine.dtype), [plan])[0], plan)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = profile.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)

    base = stem(args.results / args.host, "vlm-ttft-breakdown")
    lines = ["# vlm-ttft-breakdown\n", f"Hardware: {hardware_line('n/a (in-process)')}\n",
             f"One {width}x{height} JPEG ({len(image) / 1e6:.1f} MB), a {args.prompt_tokens}-token prompt; "
             f"{dtype}; median of {args.repeats} after a warm-up, device synchronised around each part.\n",
             "| part | ms |", "|---|---|", *(f"| {name} | {ms:.1f} |" for name, ms in rows),
             f"\ntorch.profiler, one pass (on-device image path + vision + prefill), sorted by {sort}:\n",
             "```", table, "```"]
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
