"""py-spy on a served model's Python backend stub while a benchmark loads it: where its threads (the engine's loop,
preparation, answers, Triton's calls) spend their time, idle ones too, without pausing it. For hosts where a
served/in-process gap needs explaining; the py-spy binary is carried there (`pip download py-spy`)."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import subprocess
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--py-spy", type=Path, help="a py-spy binary: record the model's stub during the run named "
                        "in this benchmark's description, into RESULTS/HOST/<date>-<model>-stub.txt")
    parser.add_argument("--py-spy-seconds", type=int, default=10)


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
    out = folder / f"{datetime.date.today()}-{model}-stub.txt"
    record = subprocess.Popen([str(args.py_spy), "record", "--pid", found.stdout.split()[0], "--duration",
                               str(args.py_spy_seconds), "--idle", "--threads", "--nonblocking", "--format", "raw",
                               "--output", str(out)])
    try:
        yield
    finally:
        print(f"py-spy exited {record.wait()}: {out}", flush=True)
