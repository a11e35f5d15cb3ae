"""`whisper`: audio bytes -> transcript text and tokens. Logic: backends.whisper (engine, chunking, adapter)."""
from backends.whisper.triton_model import WhisperTritonModel


class TritonPythonModel(WhisperTritonModel):
    pass
