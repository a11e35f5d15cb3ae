"""Triton Python-based custom backends (`mm_*/model.py`, one per kind of model) and the library they call.

Model folders under model_repository/ hold only a config.pbtxt naming one of these backends, plus built artefacts;
everything else lives here, in packages that need no server: core/ (shared serving pieces), media/ (decoding),
vision/, llm/, whisper/, sam/ (the engines).
"""
