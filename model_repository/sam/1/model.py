"""`sam`: image + points/box -> masks, IoU scores, low-res logits. Logic: backends.sam (engine, embedding cache)."""
from backends.sam.triton_model import SamTritonModel


class TritonPythonModel(SamTritonModel):
    pass
