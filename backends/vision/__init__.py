"""Vision: the batched image/text encoders, CLIP scoring, AnyRes tiling and the LLaVA-NeXT image side."""
