"""`vlm` (decoupled): image + prompt -> streamed text. Logic: backends.vlm_model (AnyRes, LLaVA vision, LLM engine)."""
from backends.vlm_model import VLMTritonModel


class TritonPythonModel(VLMTritonModel):
    pass
