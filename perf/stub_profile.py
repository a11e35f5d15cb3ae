"""py-spy on a served model's Python backend stub while a benchmark loads it: where its threads (the engine's loop,
preparation, answers, Triton's calls) spend their time, idle ones too, without pausing it. For hosts where a
served/in-process gap needs explaining; the py-spy binary is carried there (`pip download py-spy`).

    python -m perf.stub_profile RECORDING.txt   # a recording summarized per thread, as markdown
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import subprocess
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--py-spy", type=Path, help="a py-spy binary: record the model's stub during the run named "
                        "in this benchmark's description, into RESULTS/HOST/<date>-<model>-stub.txt")
    parser.add_argument("--py-spy-seconds", type=int, default=10)
    parser.add_argument("--py-spy-gil", action="store_true", help="only samples of threads holding the GIL (py-spy "
                        "--gil; into ...-stub-gil.txt): who holds it and where, at py-spy's 100 samples a second")


@contextlib.contextmanager
def stub_profile(args: argparse.Namespace, server, model: str):
    """Records the stub of `model` (the only model `server` runs) for args.py_spy_seconds from the start of the
    block, as collapsed stacks per thread, when args.py_spy names a binary."""
    if args.py_spy is None:
        yield
        return
    found = subprocess.run(["pgrep", "-P", str(server.process.pid), "-f", "triton_python_backend_stub"],
                           capture_output=True, text=True)
    folder = args.results / args.host
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{datetime.date.today()}-{model}-stub{'-gil' if args.py_spy_gil else ''}.txt"
    record = subprocess.Popen([str(args.py_spy), "record", "--pid", found.stdout.split()[0], "--duration",
                               str(args.py_spy_seconds), "--gil" if args.py_spy_gil else "--idle", "--threads",
                               "--nonblocking", "--format", "raw", "--output", str(out)])
    try:
        yield
    finally:
        print(f"py-spy exited {record.wait()}: {out}", flush=True)


def summarize(path: Path, top: int = 6) -> str:
    """Per thread of a `--format raw` recording: its samples and where the most of them were (innermost frame,
    with the frame of our code nearest to it), as markdown."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        thread, *frames = stack.split(";")
        ours = next((f for f in reversed(frames) if "backends/" in f or "perf/" in f or "model.py" in f), "-")
        threads[thread.split(": ", 1)[-1]][(frames[-1] if frames else "-", ours)] += int(count)
    lines = ["| thread | samples | innermost frame | nearest frame of ours | share of the thread |",
             "|---|---|---|---|---|"]
    for name, places in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(places.values())
        for i, ((leaf, ours), n) in enumerate(places.most_common(top)):
            head = f"{name} | {total}" if i == 0 else " | "
            lines.append(f"| {head} | {leaf} | {ours} | {n / total:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.stub_profile", description=summarize.__doc__)
    parser.add_argument("recording", type=Path)
    print(summarize(parser.parse_args(argv).recording))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
