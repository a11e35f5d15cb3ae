"""SAM as two engines over transformers' SamModel weights.

The image encoder runs once per image; the prompt encoder + mask decoder runs once per click on the cached
embedding. The decoder takes what segment-anything's exported decoder takes, less the original image size: points
in the 1024-px frame with labels (1 foreground, 0 background, 2/3 box corners, -1 padding), a low-res mask input
with a has-mask flag. It returns the 256 x 256 low-res logits of all four mask tokens and their IoU predictions;
every input and output has a fixed shape for a given batch and number of prompt tokens, so the graph can be
replayed as a CUDA graph. Choosing the masks and SamProcessor's upscaling run after it, on the engine's device
(backends/sam/engine.py), where rows of different image sizes share one decoder call.
"""
from __future__ import annotations

import torch


class SamImageEncoder(torch.nn.Module):
    def __init__(self, sam):
        super().__init__()
        self.vision_encoder = sam.vision_encoder

    def forward(self, pixel_values):
        return self.vision_encoder(pixel_values).last_hidden_state


class SamPromptMaskDecoder(torch.nn.Module):
    def __init__(self, sam):
        super().__init__()
        self.prompt_encoder, self.mask_decoder = sam.prompt_encoder, sam.mask_decoder
        with torch.no_grad():
            self.register_buffer("image_pe", sam.get_image_wide_positional_embeddings(), persistent=False)

    def embed_points(self, point_coords, point_labels):
        """SamPromptEncoder's point and box-corner embeddings, with segment-anything's label codes."""
        encoder = self.prompt_encoder
        size = encoder.input_image_size
        embedding = encoder.shared_embedding((point_coords + 0.5)[:, None], (size, size))  # [B, 1, N, C]
        labels = point_labels[:, None, :, None]
        embedding = torch.where(labels == -1, encoder.not_a_point_embed.weight, embedding)
        for code, point_embed in enumerate(encoder.point_embed):  # 0 bg, 1 fg, 2 and 3 box corners
            embedding = embedding + (labels == code).to(embedding.dtype) * point_embed.weight
        return embedding

    def predict_masks(self, image_embeddings, sparse, dense):
        """SamMaskDecoder.forward without its final choice of masks: all mask tokens' masks and IoU predictions."""
        decoder = self.mask_decoder
        batch, channels, height, width = image_embeddings.shape
        tokens = torch.cat([decoder.iou_token.weight, decoder.mask_tokens.weight]).repeat(batch, 1, 1, 1)
        queries, keys = decoder.transformer(torch.cat([tokens, sparse], dim=2), image_embeddings + dense,
                                            self.image_pe.repeat(batch, 1, 1, 1), attention_similarity=None)
        keys = keys.transpose(2, 3).reshape(batch, channels, height, width)
        upscaled = decoder.activation(decoder.upscale_layer_norm(decoder.upscale_conv1(keys)))
        upscaled = decoder.activation(decoder.upscale_conv2(upscaled))
        hyper = torch.stack([mlp(queries[:, :, 1 + i]) for i, mlp in enumerate(decoder.output_hypernetworks_mlps)],
                            dim=2)  # [B, 1, masks, C/8]
        masks = hyper @ upscaled.flatten(2)[:, None]
        return masks.reshape(batch, -1, *upscaled.shape[-2:]), decoder.iou_prediction_head(queries[:, :, 0])[:, 0]

    def forward(self, image_embeddings, point_coords, point_labels, mask_input, has_mask_input):
        sparse = self.embed_points(point_coords, point_labels)
        has_mask = has_mask_input.to(image_embeddings.dtype)[:, None, None, None]
        encoder = self.prompt_encoder
        dense = has_mask * encoder.mask_embed(mask_input.to(image_embeddings.dtype)) + \
            (1 - has_mask) * encoder.no_mask_embed.weight.reshape(1, -1, 1, 1)
        return self.predict_masks(image_embeddings, sparse, dense)


def encoder_inputs(size: int):
    def make(batch: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(batch, 3, size, size)}
    return make


def decoder_inputs(channels: int, grid: int, low_res: int, input_size: int):
    """Random prompts of every label code, masks given to some rows."""
    def make(batch: int) -> dict[str, torch.Tensor]:
        points = 2 + batch
        return {"image_embeddings": torch.randn(batch, channels, grid, grid),
                "point_coords": torch.rand(batch, points, 2) * input_size,
                "point_labels": torch.randint(-1, 4, (batch, points)).float(),
                "mask_input": torch.randn(batch, 1, low_res, low_res),
                "has_mask_input": (torch.arange(batch) % 2).float()}
    return make
