"""`clip_text`: text -> L2-normalised CLIP text embedding. Logic: backends.encoders.TextEncoder."""
from backends.encoders import TextEncoder
from backends.triton_model import BatchedTritonModel


class TritonPythonModel(BatchedTritonModel):
    def __init__(self) -> None:
        super().__init__(TextEncoder)
