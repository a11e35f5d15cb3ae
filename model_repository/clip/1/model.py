"""`clip`: one image scored against N texts (BLS over clip_vision and clip_text). Logic: backends.clip_pipeline."""
from backends.clip_pipeline import ClipPipeline


class TritonPythonModel(ClipPipeline):
    pass
