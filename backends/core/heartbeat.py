"""Engine loops say they are alive; the `health` model reads how long ago each last did.

A loop touches a file of its own (model name and stub process id) in its server's folder,
<tmp>/triton-multimodal-heartbeats-<uid>/<tritonserver pid>/: every stub is a child of its tritonserver, so one
server's models find one another there and two servers on a machine never mix. An idle loop still beats (it wakes
at least every IDLE_WAKE_S); a loop stuck in a step or dead stops, and its file ages.

A step may legitimately take long (a batch of long clips, a big prefill). Before one, the loop dates its file
forward by twice its longest recent step (`Heartbeat.step`), so the health check's short timeout counts from when
the step should have ended: a hung loop is found within that timeout of its usual pace, a slow batch is not.

A beat also notices when its tritonserver is gone (the stub was re-parented: the server was killed): nothing can
reach the stub any more, so it exits instead of running on, orphaned, with its engine and memory.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
BEAT_S = 0.1  # at most one file update per this interval
IDLE_WAKE_S = 0.25  # an idle loop wakes this often to beat
STEP_ALLOWANCE = 2.0  # a step is announced to take up to this many times the longest recent one
STEP_MEMORY = 0.99  # the longest recent step: each step's duration, or the last longest times this


def server_folder(server_pid: int | None = None) -> Path:
    """The heartbeat folder of the tritonserver whose child this process is (or of `server_pid`)."""
    return Path(tempfile.gettempdir()) / f"triton-multimodal-heartbeats-{os.getuid()}" / str(server_pid or os.getppid())


class Heartbeat:
    def __init__(self, model: str, folder: Path | None = None):
        self.server_pid = os.getppid()
        self.path = (folder or server_folder(self.server_pid)) / f"{model}.{os.getpid()}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.last = time.monotonic()
        self.longest_step_s = 0.0
        self.ahead = False  # the file is dated after now

    def beat(self, busy_s: float = 0.0) -> None:
        """Alive now; `busy_s`: the next beat is due only that much later (a long step is starting)."""
        now, ahead = time.monotonic(), busy_s > BEAT_S
        if now - self.last >= BEAT_S or ahead or self.ahead:  # a file dated ahead is brought back at once
            if os.getppid() != self.server_pid:
                log.error("%s: its tritonserver (pid %d) is gone; exiting", self.path.name, self.server_pid)
                self.path.unlink(missing_ok=True)
                os._exit(1)
            due = time.time() + busy_s
            os.utime(self.path, (due, due))
            self.last, self.ahead = now, ahead

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one step of the loop: beats with the step's allowance before it and learns its duration."""
        self.beat(STEP_ALLOWANCE * self.longest_step_s)
        start = time.monotonic()
        yield
        elapsed = time.monotonic() - start
        self.longest_step_s = max(elapsed, self.longest_step_s * STEP_MEMORY)
        self.beat()

    def stop(self) -> None:
        """The loop ended on purpose (model unloaded): no longer watched."""
        self.path.unlink(missing_ok=True)


def ages(folder: Path | None = None) -> dict[str, float]:
    """Seconds since each loop's last beat (after the allowance of the step it announced: negative while within
    it), by `model.pid`; a loop whose process is gone is reported as such (age infinity) until its file is
    cleared."""
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
