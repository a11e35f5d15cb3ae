"""The LLM engine's own spans of a request, beside Triton's trace of it.

Triton's trace (`--trace-config`, see backends.server `--trace-file`) times a request up to the model's `execute`;
for a decoupled LLM that returns at once, so the engine's part (waiting for a batch slot, the prefill step, the
first token, the end) is invisible there. When the server runs with tracing, the launcher names a file in
SPANS_ENV; each engine loop then appends one JSON line per finished request, keyed by the request's id (the client's
`id`, which Triton's trace records as `request_id`), with times in CLOCK_MONOTONIC nanoseconds, the clock of
Triton's trace timestamps. `python -m client.timeline` joins the two.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SPANS_ENV = "TRITON_MULTIMODAL_SPANS_FILE"
EVENTS = ("queued", "admitted", "prefill_start", "first_token", "finished")


class SpanLog:
    """Appends requests' spans to the file named in SPANS_ENV; does nothing when it is unset."""

    def __init__(self, model: str):
        self.model = model
        path = os.environ.get(SPANS_ENV)
        # one write() per line on an O_APPEND file: lines of several stubs do not interleave
        self.file = open(path, "a", buffering=1) if path else None

    @property
    def enabled(self) -> bool:
        return self.file is not None

    def write(self, request_id: str, spans: dict[str, int], **fields) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"request_id": request_id, "model": self.model, "spans": spans, **fields})
                            + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def spans_file(trace_file: str | os.PathLike) -> Path:
    """Where the engines' spans go for a server tracing to `trace_file`."""
    return Path(f"{trace_file}.spans.jsonl")


def read_spans(trace_file: str | os.PathLike) -> list[dict]:
    path = spans_file(trace_file)
    if not path.is_file():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
