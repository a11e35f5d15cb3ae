"""`anyres`: encoded image -> LLaVA-NeXT tiles + visual-token count. Logic: backends.anyres."""
from backends.anyres_model import AnyResModel


class TritonPythonModel(AnyResModel):
    pass
