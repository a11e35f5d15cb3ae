"""SAM promptable segmentation: cached image embeddings, prompts -> masks at the original image size."""
