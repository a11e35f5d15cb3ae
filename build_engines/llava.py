"""anyres and vlm from a LLaVA-NeXT checkpoint: the tiling settings for `mm_anyres`, and the whole checkpoint for
`mm_vlm` (vision tower, projector, language model, tokenizer, processor configs; parity is covered by the tests)."""
from __future__ import annotations

import json
import shutil

from backends.vision.anyres import AnyResParams, image_processor_config, tiler_from_checkpoint
from backends.vision.llava_vision import VLMParams
from build_engines.common import BuildOptions, place_checkpoint, up_to_date
from build_engines.llm import LLM_FILES, generation_config
from build_engines.repository import PythonModelConfig, Tensor, write_engine_metadata


def build_anyres(opts: BuildOptions) -> None:
    """Its tiling settings (pinpoints, tile, patch, feature selection) and image processor config; no weights."""
    name = opts.model_name("anyres")
    if up_to_date(opts, [name]):
        return
    tiler = tiler_from_checkpoint(opts.checkpoint)  # a checkpoint that is not LLaVA-NeXT-like fails here
    version_dir = opts.repository / name / "1"
    version_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(opts.checkpoint / "config.json", version_dir / "config.json")
    for file in ("processor_config.json", "preprocessor_config.json"):
        (version_dir / file).unlink(missing_ok=True)
    (version_dir / "preprocessor_config.json").write_text(json.dumps(image_processor_config(opts.checkpoint)))
    if (opts.checkpoint / "processor_config.json").exists():
        shutil.copy2(opts.checkpoint / "processor_config.json", version_dir / "processor_config.json")
    opts.write(PythonModelConfig(
        name, "mm_anyres", [Tensor("image", "BYTES", [1])],
        [Tensor("pixel_values", "FP32", [-1, 3, tiler.tile, tiler.tile]), Tensor("num_image_tokens", "INT32", [1])],
        opts.parameters(AnyResParams, prepare_threads=opts.prepare_threads),
        max_batch_size=0, max_queue_delay_us=None, instances=2, kind="KIND_CPU"))
    write_engine_metadata(version_dir, runtime="none", fingerprint=opts.fingerprint(name),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"{name}: {len(tiler.pinpoints)} grid pinpoints, {tiler.tile} px tiles, {tiler.patch} px patches")


def build_vlm(opts: BuildOptions) -> None:
    name = opts.model_name("vlm")
    if up_to_date(opts, [name]):
        return
    tiler_from_checkpoint(opts.checkpoint)  # a checkpoint that is not LLaVA-NeXT-like fails here
    params = opts.parameters(VLMParams, dtype=opts.precision, device=opts.device, prepare_threads=opts.prepare_threads)
    version_dir = opts.repository / name / "1"
    place_checkpoint(opts.checkpoint, version_dir, (*LLM_FILES, "processor_config.json", "preprocessor_config.json"))
    opts.write(generation_config(opts, name, "mm_vlm", [Tensor("image", "BYTES", [1])], params))
    write_engine_metadata(version_dir, runtime="torch", precision=opts.precision, fingerprint=opts.fingerprint(name),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"{name}: {opts.checkpoint} ({opts.precision})")
