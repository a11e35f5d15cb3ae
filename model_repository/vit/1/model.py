"""`vit`: encoded image -> classification logits. Logic: backends.encoders.ImageEncoder."""
from backends.encoders import ImageEncoder
from backends.triton_model import BatchedTritonModel


class TritonPythonModel(BatchedTritonModel):
    def __init__(self) -> None:
        super().__init__(ImageEncoder)
