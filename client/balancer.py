"""`python -m client.balancer`: active health checks for an open-source nginx in front of tritonservers.

nginx's open-source build only notices a failed server from the requests it sends there (passive checks): a hung
server (connections accepted, never answered) is found only when a request's read timeout runs out. This watcher
asks every server's deep health model (client.health) every `interval` seconds, writes the upstream block with
the failing ones marked `down` into a file the nginx config includes, and has nginx reload it (SIGHUP: new workers
take the file, requests in flight finish). A server is down after one failed or unanswered probe and up again
after `rise` healthy ones in a row. If every server fails, all stay listed: passive checks still apply.

    python -m client.balancer --upstream-file /etc/nginx/triton-upstream.conf --nginx-pid-file /run/nginx.pid \\
        --server triton-0:8000 --server triton-1:8000
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from client.health import check


def upstream_block(name: str, servers: dict[str, bool], options: str = "max_fails=1 fail_timeout=10s",
                   keepalive: int = 32) -> str:
    """nginx's upstream block: `servers` host:port -> healthy."""
    everyone_down = not any(servers.values())
    lines = [f"    server {s} {options}{'' if up or everyone_down else ' down'};" for s, up in servers.items()]
    return f"upstream {name} {{\n" + "\n".join(lines) + f"\n    keepalive {keepalive};\n}}\n"


def probe(server: str, timeout_s: float) -> bool:
    try:
        return bool(check(server, timeout_s=timeout_s)["healthy"])
    except Exception:  # refused, timed out, no health model: not a server to send requests to
        return False


class Watcher:
    """Probes `servers` and rewrites `upstream_file` (then calls `reload`) whenever the set of healthy ones
    changes. `changes` records (epoch seconds, server, healthy) for each change."""

    def __init__(self, servers: list[str], upstream_file: Path, reload: Callable[[], None], name: str = "triton",
                 interval_s: float = 0.1, timeout_s: float = 0.8, rise: int = 3):
        self.servers, self.upstream_file, self.reload, self.name = servers, upstream_file, reload, name
        self.interval_s, self.timeout_s, self.rise = interval_s, timeout_s, rise
        self.healthy = dict.fromkeys(servers, True)
        self.streak = dict.fromkeys(servers, 0)  # healthy probes in a row
        self.changes: list[tuple[float, str, bool]] = []
        self.pool = ThreadPoolExecutor(len(servers))  # a hung server must not delay the others' probes
        self.stopped = threading.Event()
        self.write()

    def write(self) -> None:
        temporary = self.upstream_file.with_suffix(".tmp")
        temporary.write_text(upstream_block(self.name, self.healthy))
        temporary.replace(self.upstream_file)  # nginx never reads half a file

    def poll(self) -> bool:
        """One round of probes; whether the upstream changed."""
        results = dict(zip(self.servers, self.pool.map(lambda s: probe(s, self.timeout_s), self.servers)))
        changed = False
        for server, ok in results.items():
            self.streak[server] = self.streak[server] + 1 if ok else 0
            up = self.streak[server] >= self.rise if not self.healthy[server] else ok
            if up != self.healthy[server]:
                self.healthy[server], changed = up, True
                self.changes.append((time.time(), server, up))
        if changed:
            self.write()
            self.reload()
        return changed

    def run(self) -> None:
        while not self.stopped.is_set():
            start = time.monotonic()
            self.poll()
            self.stopped.wait(max(0.0, self.interval_s - (time.monotonic() - start)))

    def start(self) -> Watcher:
        threading.Thread(target=self.run, name="balancer-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.pool.shutdown(wait=False)


def reload_nginx(pid_file: Path) -> Callable[[], None]:
    return lambda: os.kill(int(pid_file.read_text().split()[0]), signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.balancer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="a tritonserver's HTTP host:port (repeat)")
    parser.add_argument("--upstream-file", type=Path, required=True, help="the file nginx.conf includes")
    parser.add_argument("--nginx-pid-file", type=Path, required=True)
    parser.add_argument("--name", default="triton", help="the upstream's name in nginx.conf")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between probe rounds")
    parser.add_argument("--timeout", type=float, default=0.8,
                        help="seconds a probe may take (above the health model's latency under load)")
    parser.add_argument("--rise", type=int, default=3, help="healthy probes in a row to come back")
    args = parser.parse_args(argv)
    reload = reload_nginx(args.nginx_pid_file)

    def report_and_reload() -> None:
        print(" ".join(f"{s}={'up' if up else 'down'}" for s, up in watcher.healthy.items()), flush=True)
        reload()

    watcher = Watcher(args.server, args.upstream_file, report_and_reload, args.name, args.interval, args.timeout,
                      args.rise)
    try:
        watcher.run()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
