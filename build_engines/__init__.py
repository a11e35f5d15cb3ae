"""Checkpoint (local Hugging Face dir, or --tiny random init) -> verified engines + config.pbtxt in model_repository/."""
