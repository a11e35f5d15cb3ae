"""One request's timeline: Triton's trace of it joined with the LLM engine's spans, by the request's id.

    python -m backends.server --trace-file traces/trace.json ...      # the server, tracing
    python -m client.timeline traces/trace.json --request-id my-42    # after a request sent with id "my-42"

Triton's trace (level TIMESTAMPS) covers the frontend, the queue and `execute`; the engine's spans
(backends.core.spans) cover what a decoupled LLM does after `execute` returned. Both are CLOCK_MONOTONIC
nanoseconds, so they sort into one timeline. With several requests of the same id, the latest is shown.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from backends.core.spans import read_spans


@dataclass(frozen=True)
class Event:
    ns: int
    source: str  # "triton <model>" or "engine <model>"
    name: str


def triton_traces(trace_file: Path) -> dict[int, dict]:
    """Triton's traces by trace id, from trace_file (written at shutdown) and trace_file.N (every N traces):
    {"model_name", "request_id", "parent_id", "timestamps": [(name, ns)]}."""
    files = [trace_file] if trace_file.is_file() else []
    files += sorted((p for p in trace_file.parent.glob(trace_file.name + ".*") if re.fullmatch(r"\d+", p.suffix[1:])),
                    key=lambda p: int(p.suffix[1:]))
    traces: dict[int, dict] = {}
    for path in files:
        for entry in json.loads(path.read_text() or "[]"):
            trace = traces.setdefault(entry["id"], {"timestamps": []})
            trace.update({k: entry[k] for k in ("model_name", "request_id", "parent_id") if k in entry})
            trace["timestamps"] += [(t["name"], t["ns"]) for t in entry.get("timestamps", [])]
    return traces


def timeline(trace_file: Path, request_id: str) -> list[Event]:
    """The request's events in time order: its latest Triton trace (and the traces of the ensemble steps it made)
    and its latest engine spans."""
    traces = triton_traces(trace_file)
    roots = [i for i, t in traces.items() if t.get("request_id") == request_id and "parent_id" not in t]
    spans = [s for s in read_spans(trace_file) if s["request_id"] == request_id]
    if not roots and not spans:
        known = sorted({t["request_id"] for t in traces.values() if t.get("request_id")} |
                       {s["request_id"] for s in read_spans(trace_file)})
        raise LookupError(f"no trace of request id {request_id!r} in {trace_file}; traced ids: {known or 'none'} "
                          "(only requests sent with an id can be found)")
    events = []
    if roots:
        root = max(roots, key=lambda i: min((ns for _, ns in traces[i]["timestamps"]), default=0))
        family = {root} | {i for i, t in traces.items() if t.get("parent_id") == root}
        events += [Event(ns, f"triton {traces[i].get('model_name', '?')}", name)
                   for i in family for name, ns in traces[i]["timestamps"]]
    if spans:
        latest = max(spans, key=lambda s: s["spans"].get("queued", 0))
        events += [Event(ns, f"engine {latest['model']}", name) for name, ns in latest["spans"].items()]
        if latest.get("error"):
            events.append(Event(latest["spans"]["finished"], f"engine {latest['model']}", f"error: {latest['error']}"))
    return sorted(events, key=lambda e: e.ns)


def render(events: list[Event]) -> str:
    start = events[0].ns
    lines = [f"{'ms':>10} {'+ms':>9}  {'source':<22} event"]
    previous = start
    for e in events:
        lines.append(f"{(e.ns - start) / 1e6:10.3f} {(e.ns - previous) / 1e6:9.3f}  {e.source:<22} {e.name}")
        previous = e.ns
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_file", type=Path, help="the server's --trace-file")
    parser.add_argument("--request-id", required=True, help="the id the request was sent with")
    parser.add_argument("--json", action="store_true", help="the events as JSON lines")
    args = parser.parse_args(argv)
    try:
        events = timeline(args.trace_file, args.request_id)
    except LookupError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(json.dumps(e.__dict__) for e in events) if args.json else render(events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
