"""Everything the Triton model folders run: decoding, preprocessing, runtimes, model classes, the server launcher.

Model folders under model_repository/ only hold a config.pbtxt and a ~10-line model.py that delegates here, so all
logic is importable and unit-testable without a server.
"""
