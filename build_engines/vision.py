"""vit and clip: the encoders exported as ONNX / torch.export / TensorRT engines with a dynamic batch axis, served by
the `mm_encoder` backend, and the `clip` scoring pipeline (`mm_clip`)."""
from __future__ import annotations

import math

import torch

from backends.vision.clip import ClipParams
from backends.vision.encoders import EncoderParams
from build_engines.common import (BATCH, BuildOptions, Progress, build_engine, clear_other_layout, instance_kind,
                                  up_to_date)
from build_engines.export import EngineSpec
from build_engines.repository import EnsembleConfig, PythonModelConfig, Tensor, sample_png


UNPADDED = "sdpa_unpadded"  # transformers' SDPA attention, and no attention mask


def attend_without_mask(model) -> None:
    """Images are never padded, yet a transformers ViT traced for export builds an all-true [B, 1, T, T] attention
    mask (while exporting it cannot tell the mask is not needed), and a mask keeps SDPA off its flash kernel.
    Registers SDPA attention whose mask is None and switches `model` to it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(UNPADDED, sdpa_attention_forward)
    AttentionMaskInterface.register(UNPADDED, lambda *args, **kwargs: None)
    model.set_attn_implementation(UNPADDED)


class ViTLogits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        attend_without_mask(model)
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


def encoder_parameters(opts: BuildOptions) -> EncoderParams:
    return opts.parameters(EncoderParams, runtime=opts.runtime, device=opts.device,
                           prepare_threads=opts.prepare_threads)


def encoder_config(opts: BuildOptions, name: str, inputs: list[Tensor], outputs: list[Tensor],
                   warmup_input: str | None, gpu_inputs: bool = False) -> PythonModelConfig:
    return PythonModelConfig(name, "mm_encoder", inputs, outputs, encoder_parameters(opts),
                             max_batch_size=opts.max_batch_size, max_queue_delay_us=opts.max_queue_delay_us,
                             instances=opts.instances, kind=instance_kind(opts), warmup_file=warmup_input,
                             priority_levels=opts.priority_levels, gpu_inputs=gpu_inputs)


def engine_model(opts: BuildOptions, name: str) -> str:
    """The model whose folder holds an image encoder's engine: itself, or with --ensemble its encoder step."""
    return f"{name}_encoder" if opts.ensemble else name


def write_image_encoder(opts: BuildOptions, name: str, processor, size: int, output: Tensor,
                        labels: list[str] | None = None) -> None:
    """config.pbtxt of an image encoder (`image` BYTES -> `output`), its engine already in `engine_model`'s folder:
    one model, or with --ensemble the ensemble `name` of `name`_preprocess (decode, resize, normalise ->
    `pixel_values`: CPU instances, or with --preprocess-on-device true instances on --device whose pixel tensors
    stay on the GPU) and `name`_encoder (the engine, dynamically batched), the same tensors for clients."""
    image, pixels = Tensor("image", "BYTES", [1]), Tensor("pixel_values", "FP32", [3, size, size])
    preprocess, encoder = f"{name}_preprocess", engine_model(opts, name)
    if labels:
        (opts.repository / encoder / "labels.txt").write_text("\n".join(labels) + "\n")
    clear_other_layout(opts, name, (preprocess, f"{name}_encoder"))
    if not opts.ensemble:
        opts.write(encoder_config(opts, name, [image], [output], "image"), sample_png())
        return
    processor.save_pretrained(opts.repository / preprocess / "1")
    on_device = encoder_parameters(opts).preprocess_on_device
    opts.write(PythonModelConfig(preprocess, "mm_encoder", [image], [pixels], encoder_parameters(opts),
                                 max_batch_size=opts.max_batch_size, max_queue_delay_us=opts.max_queue_delay_us,
                                 instances=opts.preprocess_instances,
                                 kind=instance_kind(opts) if on_device else "KIND_CPU", warmup_file="image",
                                 priority_levels=opts.priority_levels), sample_png())
    opts.write(encoder_config(opts, encoder, [pixels], [output], None, gpu_inputs=on_device))
    opts.write(EnsembleConfig(name, [image], [output], [(preprocess, {"image": "image"}, {"pixel_values": "pixels"}),
                                                        (encoder, {"pixel_values": "pixels"},
                                                         {output.name: output.name})], opts.max_batch_size))
    if labels:
        (opts.repository / name / "labels.txt").write_text("\n".join(labels) + "\n")


def build_vit(opts: BuildOptions) -> None:
    from transformers import AutoImageProcessor, ViTForImageClassification

    name = opts.model_name("vit")
    if up_to_date(opts, [engine_model(opts, name)], name):
        return
    progress = Progress(name, 4)
    version_dir = opts.repository / engine_model(opts, name) / "1"
    with progress.step(f"loading {opts.checkpoint}"):
        model = ViTForImageClassification.from_pretrained(opts.checkpoint, dtype=torch.float32).eval()
        processor = AutoImageProcessor.from_pretrained(opts.checkpoint)
        version_dir.mkdir(parents=True, exist_ok=True)
        processor.save_pretrained(version_dir)
    size = model.config.image_size
    spec = EngineSpec(ViTLogits(model), image_inputs(size, size), {"pixel_values": {0: BATCH}}, ["logits"])
    build_engine(spec, version_dir, opts, progress)
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    with progress.step("writing config.pbtxt"):
        write_image_encoder(opts, name, processor, size, Tensor("logits", "FP32", [len(labels)], "labels.txt"),
                            labels)


def build_clip(opts: BuildOptions) -> None:
    """clip_vision, clip_text and the clip pipeline over them (their names are fixed: the pipeline calls them)."""
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    if opts.name:
        raise RuntimeError("clip builds three models with fixed names (clip_vision, clip_text, clip): no --name")
    names = [engine_model(opts, "clip_vision"), "clip_text"]
    if up_to_date(opts, names, "clip"):
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
    with progress.step("writing config.pbtxt for clip_vision, clip_text, clip"):
        write_image_encoder(opts, "clip_vision", processor, size, Tensor("image_embeds", "FP32", [dim]))
        opts.write(encoder_config(opts, "clip_text", [Tensor("text", "BYTES", [1])],
                                  [Tensor("text_embeds", "FP32", [dim])], "text"), b"a photo of a cat")
        pipeline = opts.parameters(ClipParams, logit_scale=math.exp(clip.logit_scale.item()),
                                   text_max_batch_size=opts.max_batch_size)
        opts.write(PythonModelConfig(
            "clip", "mm_clip", [Tensor("image", "BYTES", [1]), Tensor("text", "BYTES", [-1])],
            [Tensor("scores", "FP32", [-1]), Tensor("probs", "FP32", [-1])], pipeline,
            max_batch_size=0, max_queue_delay_us=None, instances=2, kind="KIND_CPU"))
