"""anyres and vlm from a LLaVA-NeXT checkpoint: the tiling settings for `mm_anyres`, and the whole checkpoint for
`mm_vlm` (vision tower, projector, language model, tokenizer, processor configs; parity is covered by the tests)."""
from __future__ import annotations

import json
import shutil

from backends.mm_vlm.model import SIZE, TILES
from backends.vision.anyres import AnyResParams, image_processor_config, tiler_from_checkpoint
from backends.vision.llava_vision import VLMParams
from build_engines.common import BuildOptions, clear_other_layout, place_checkpoint, up_to_date
from build_engines.llm import LLM_FILES, generation_config
from build_engines.repository import EnsembleConfig, PythonModelConfig, Tensor, write_engine_metadata


def build_anyres(opts: BuildOptions, name: str | None = None, instances: int = 2, batch_window: str = "triton") -> None:
    """Its tiling settings (pinpoints, tile, patch, feature selection) and image processor config; no weights. Also
    the first step (`name`) of the vlm ensemble, where our batcher (`batch_window` adaptive) takes requests in QoS
    order, as the vlm's own image threads do."""
    name = name or opts.model_name("anyres")
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
        [Tensor("pixel_values", "FP32", [-1, 3, tiler.tile, tiler.tile]), Tensor("num_image_tokens", "INT32", [1]),
         Tensor("image_size", "INT32", [2])],
        opts.parameters(AnyResParams, prepare_threads=opts.prepare_threads, batch_window=batch_window),
        max_batch_size=0, max_queue_delay_us=None, instances=instances, kind="KIND_CPU"))
    write_engine_metadata(version_dir, runtime="none", fingerprint=opts.fingerprint(name),
                          checkpoint=str(opts.checkpoint.resolve()))
    print(f"{name}: {len(tiler.pinpoints)} grid pinpoints, {tiler.tile} px tiles, {tiler.patch} px patches")


def build_vlm(opts: BuildOptions) -> None:
    """The whole checkpoint for `mm_vlm`; with --ensemble `vlm` is an ensemble of vlm_anyres (CPU instances: decode
    and tile) and vlm_engine (the decoupled engine, taking the tiles), the same tensors and stream for clients."""
    name = opts.model_name("vlm")
    engine = f"{name}_engine" if opts.ensemble else name
    if up_to_date(opts, [engine], name):
        return
    tiler = tiler_from_checkpoint(opts.checkpoint)  # a checkpoint that is not LLaVA-NeXT-like fails here
    params = opts.parameters(VLMParams, dtype=opts.precision, device=opts.device, prepare_threads=opts.prepare_threads)
    version_dir = opts.repository / engine / "1"
    place_checkpoint(opts.checkpoint, version_dir, (*LLM_FILES, "processor_config.json", "preprocessor_config.json"))
    image = Tensor("image", "BYTES", [1])
    tiles, size = Tensor(TILES, "FP32", [-1, 3, tiler.tile, tiler.tile]), Tensor(SIZE, "INT32", [2])
    config = generation_config(opts, engine, "mm_vlm", [tiles, size] if opts.ensemble else [image], params)
    opts.write(config)
    write_engine_metadata(version_dir, runtime="torch", precision=opts.precision,
                          fingerprint=opts.fingerprint(engine), checkpoint=str(opts.checkpoint.resolve()))
    anyres = f"{name}_anyres"
    clear_other_layout(opts, name, (anyres, f"{name}_engine"))
    if opts.ensemble:
        build_anyres(opts, anyres, opts.preprocess_instances, batch_window="adaptive")
        generation = config.inputs[2:]
        opts.write(EnsembleConfig(name, [image, *generation], config.outputs, [
            (anyres, {"image": "image"}, {"pixel_values": TILES, "image_size": SIZE}),
            (engine, {TILES: TILES, SIZE: SIZE, **{t.name: t.name for t in generation}},
             {t.name: t.name for t in config.outputs})], max_batch_size=0))
    print(f"{name}: {opts.checkpoint} ({opts.precision}{', ensemble' if opts.ensemble else ''})")
