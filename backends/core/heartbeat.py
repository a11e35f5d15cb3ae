"""Engine loops say they are alive; the `health` model reads how long ago each last did.

A loop touches a file of its own (model name and stub process id) in its server's folder,
<tmp>/triton-multimodal-heartbeats-<uid>/<tritonserver pid>/: every stub is a child of its tritonserver, so one
server's models find one another there and two servers on a machine never mix. An idle loop still beats (it wakes
at least every IDLE_WAKE_S); a loop stuck in a step or dead stops, and its file ages.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

BEAT_S = 0.1  # at most one file update per this interval
IDLE_WAKE_S = 0.25  # an idle loop wakes this often to beat


def server_folder(server_pid: int | None = None) -> Path:
    """The heartbeat folder of the tritonserver whose child this process is (or of `server_pid`)."""
    return Path(tempfile.gettempdir()) / f"triton-multimodal-heartbeats-{os.getuid()}" / str(server_pid or os.getppid())


class Heartbeat:
    def __init__(self, model: str, folder: Path | None = None):
        self.path = (folder or server_folder()) / f"{model}.{os.getpid()}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.last = time.monotonic()

    def beat(self) -> None:
        if (now := time.monotonic()) - self.last >= BEAT_S:
            os.utime(self.path)
            self.last = now

    def stop(self) -> None:
        """The loop ended on purpose (model unloaded): no longer watched."""
        self.path.unlink(missing_ok=True)


def ages(folder: Path | None = None) -> dict[str, float]:
    """Seconds since each loop's last beat, by `model.pid`; a loop whose process is gone is reported as such
    (age infinity) until its file is cleared."""
    folder = folder or server_folder()
    out = {}
    for path in sorted(folder.glob("*.*")) if folder.is_dir() else []:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:  # stopped meanwhile
            continue
        pid = int(path.suffix[1:]) if path.suffix[1:].isdigit() else 0
        out[path.name] = age if pid and Path(f"/proc/{pid}").exists() else float("inf")
    return out
