"""sam: the image encoder and the prompt encoder + mask decoder as two verified engines, served by `mm_sam`."""
from __future__ import annotations

import torch

from backends.sam.engine import SamParams
from build_engines.common import BATCH, BuildOptions, Progress, build_engine, instance_kind, up_to_date
from build_engines.export import EngineSpec
from build_engines.repository import PythonModelConfig, Tensor, write_engine_metadata
from build_engines.sam_graphs import SamImageEncoder, SamPromptMaskDecoder, decoder_inputs, encoder_inputs


def build_sam(opts: BuildOptions) -> None:
    """The `sam` model: the image encoder and the prompt encoder + mask decoder as two engines (see
    build_engines/sam_graphs.py) from a Hugging Face SAM checkpoint, each verified against PyTorch, with
    SamProcessor's config beside them for preprocessing and post-processing."""
    from transformers import SamModel, SamProcessor

    name = opts.model_name("sam")
    if up_to_date(opts, [name]):
        return
    # our batcher by default: prompts of concurrent requests share decoder calls (backends/mm_sam)
    params = opts.parameters(SamParams, runtime=opts.runtime, device=opts.device, batch_window="adaptive")
    progress = Progress(name, 8 if opts.runtime == "tensorrt" else 6)
    version_dir = opts.repository / name / "1"
    with progress.step(f"loading {opts.checkpoint}"):
        sam = SamModel.from_pretrained(opts.checkpoint, dtype=torch.float32).eval()
        processor = SamProcessor.from_pretrained(opts.checkpoint)
        version_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(version_dir)
    prompt_cfg = sam.config.prompt_encoder_config
    low_res = 4 * prompt_cfg.image_embedding_size  # the decoder's mask side (256)
    build_engine(EngineSpec(SamImageEncoder(sam), encoder_inputs(prompt_cfg.image_size), {"pixel_values": {0: BATCH}},
                            ["image_embeddings"]), version_dir / "image_encoder", opts, progress)
    points = ("points", 1024)
    build_engine(EngineSpec(
        SamPromptMaskDecoder(sam), decoder_inputs(
            prompt_cfg.hidden_size, prompt_cfg.image_embedding_size, low_res, prompt_cfg.image_size),
        {"image_embeddings": {0: BATCH}, "point_coords": {0: BATCH, 1: points}, "point_labels": {0: BATCH, 1: points},
         "mask_input": {0: BATCH}, "has_mask_input": {0: BATCH}},
        ["low_res_masks", "iou_predictions"], keep_fp32=("point_coords",)),
        version_dir / "mask_decoder", opts, progress)
    with progress.step("writing config.pbtxt"):
        opts.write(PythonModelConfig(
            name, "mm_sam", [Tensor("image", "BYTES", [1]), Tensor("point_coords", "FP32", [-1, 2], optional=True),
                    Tensor("point_labels", "INT32", [-1], optional=True),
                    Tensor("boxes", "FP32", [-1, 4], optional=True),
                    Tensor("mask_input", "FP32", [1, low_res, low_res], optional=True),
                    Tensor("multimask_output", "BOOL", [1], optional=True),
                    Tensor("mask_format", "BYTES", [1], optional=True)],
            [Tensor("masks", "BOOL", [-1, -1, -1]), Tensor("masks_packed", "UINT8", [-1, -1, -1]),
             Tensor("masks_rle", "BYTES", [-1]),
             Tensor("iou_scores", "FP32", [-1]),
             Tensor("low_res_logits", "FP32", [-1, low_res, low_res])], params,
            max_batch_size=0, max_queue_delay_us=None, instances=1, kind=instance_kind(opts)))
    write_engine_metadata(version_dir, runtime=opts.runtime, precision=opts.precision,
                          fingerprint=opts.fingerprint(name), checkpoint=str(opts.checkpoint.resolve()))
