"""`llm` (decoupled): prompt -> streamed text. Logic: backends.llm (engine) behind backends.llm.triton_model."""
from backends.llm.triton_model import LLMTritonModel


class TritonPythonModel(LLMTritonModel):
    pass
