"""`python -m client.balancer`: active health checks for an open-source nginx in front of tritonservers.

nginx's open-source build only notices a failed server from the requests it sends there (passive checks): a hung
server (connections accepted, never answered) is found only when a request's read timeout runs out. This watcher
asks every server, every `interval` seconds, two things: whether its HTTP frontend answers (/v2/health/live, a
short timeout: a frozen server is out fast) and what its deep health model says (client.health: engines' loops,
devices; a longer timeout). It writes the upstream block with the failing servers marked `down` into a file the
nginx config includes and has nginx reload it (SIGHUP: new workers take the file, requests in flight finish). A
server is down after one failed or unanswered probe and up again after `rise` passing ones in a row. If every
server fails, all stay listed: passive checks still apply.

    python -m client.balancer --upstream-file /etc/nginx/triton-upstream.conf --nginx-pid-file /run/nginx.pid \\
        --server triton-0:8000 --server triton-1:8000
"""
from __future__ import annotations

import argparse
import http.client
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from client.health import check


def upstream_block(name: str, servers: dict[str, bool], options: str = "max_fails=1 fail_timeout=10s",
                   keepalive: int = 32) -> str:
    """nginx's upstream block: `servers` host:port -> healthy."""
    everyone_down = not any(servers.values())
    lines = [f"    server {s} {options}{'' if up or everyone_down else ' down'};" for s, up in servers.items()]
    return f"upstream {name} {{\n" + "\n".join(lines) + f"\n    keepalive {keepalive};\n}}\n"


def probe(server: str, timeout_s: float) -> bool:
    """The deep check: the health model's verdict (engines' loops beating, devices answering)."""
    try:
        return bool(check(server, timeout_s=timeout_s)["healthy"])
    except Exception:  # refused, timed out, no health model: not a server to send requests to
        return False


def alive(server: str, timeout_s: float) -> bool:
    """The quick check: Triton's HTTP frontend answers /v2/health/live on its own threads, without any model, so a
    busy server still answers it in milliseconds and a frozen one (stopped, paused, host hung) does not."""
    host, _, port = server.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", "/v2/health/live")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


PROBE_INTERVAL_S = 0.1  # seconds between two probes of one server
PROBE_TIMEOUT_S = 0.8  # seconds the deep check may take: above the health model's latency under load
LIVE_TIMEOUT_S = 0.3  # seconds the quick check may take (p99 13-101 ms on the 2-core VM under the failover load)


class Watcher:
    """Probes `servers` and rewrites `upstream_file` (then calls `reload`) whenever the set of healthy ones
    changes. `changes` records (epoch seconds, server, healthy) for each change.

    Each server has two probe loops, the quick check's and the deep one's, each on its own thread: a deep probe that
    waits out its timeout delays neither the quick check (a frozen server is out within LIVE_TIMEOUT_S) nor the
    other servers' probes."""

    def __init__(self, servers: list[str], upstream_file: Path, reload: Callable[[], None], name: str = "triton",
                 interval_s: float = PROBE_INTERVAL_S, timeout_s: float = PROBE_TIMEOUT_S,
                 live_timeout_s: float = LIVE_TIMEOUT_S, rise: int = 3):
        self.servers, self.upstream_file, self.reload, self.name = servers, upstream_file, reload, name
        self.interval_s, self.rise = interval_s, rise
        self.timeouts = {"live": live_timeout_s, "deep": timeout_s}
        self.passing = {server: dict.fromkeys(self.timeouts, True) for server in servers}  # each check's last probe
        self.healthy = dict.fromkeys(servers, True)
        self.streak = dict.fromkeys(servers, 0)  # healthy probes in a row
        self.changes: list[tuple[float, str, bool]] = []
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.write()

    def write(self) -> None:
        temporary = self.upstream_file.with_suffix(".tmp")
        temporary.write_text(upstream_block(self.name, self.healthy))
        temporary.replace(self.upstream_file)  # nginx never reads half a file

    def probe(self, server: str, kind: str) -> bool:
        return (alive if kind == "live" else probe)(server, self.timeouts[kind])

    def report(self, server: str, kind: str, ok: bool) -> bool:
        """One probe's result: down at once when it failed, up after `rise` passing probes in a row. Whether the
        upstream changed."""
        with self.lock:
            self.passing[server][kind] = ok
            ok = all(self.passing[server].values())
            self.streak[server] = self.streak[server] + 1 if ok else 0
            up = self.streak[server] >= self.rise if not self.healthy[server] else ok
            if up == self.healthy[server]:
                return False
            self.healthy[server] = up
            self.changes.append((time.time(), server, up))
            self.write()
            self.reload()
            return True

    def poll(self) -> bool:
        """Both probes of every server once, in turn (tests step the watcher with it); whether the upstream
        changed."""
        changed = False
        for server in self.servers:
            for kind in self.timeouts:
                changed |= self.report(server, kind, self.probe(server, kind))
        return changed

    def watch(self, server: str, kind: str) -> None:
        while not self.stopped.is_set():
            start = time.monotonic()
            self.report(server, kind, self.probe(server, kind))
            self.stopped.wait(max(0.0, self.interval_s - (time.monotonic() - start)))

    def start(self) -> Watcher:
        for server in self.servers:
            for kind in self.timeouts:
                threading.Thread(target=self.watch, args=(server, kind), name=f"balancer-{kind}-{server}",
                                 daemon=True).start()
        return self

    def run(self) -> None:
        self.start().stopped.wait()

    def stop(self) -> None:
        self.stopped.set()


def reload_nginx(pid_file: Path) -> Callable[[], None]:
    return lambda: os.kill(int(pid_file.read_text().split()[0]), signal.SIGHUP)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.balancer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="a tritonserver's HTTP host:port (repeat)")
    parser.add_argument("--upstream-file", type=Path, required=True, help="the file nginx.conf includes")
    parser.add_argument("--nginx-pid-file", type=Path, required=True)
    parser.add_argument("--name", default="triton", help="the upstream's name in nginx.conf")
    parser.add_argument("--interval", type=float, default=PROBE_INTERVAL_S, help="seconds between two probes of a server")
    parser.add_argument("--timeout", type=float, default=PROBE_TIMEOUT_S,
                        help="seconds the health model's probe may take (above its latency under load)")
    parser.add_argument("--live-timeout", type=float, default=LIVE_TIMEOUT_S,
                        help="seconds /v2/health/live may take (a frozen server answers nothing)")
    parser.add_argument("--rise", type=int, default=3, help="healthy probes in a row to come back")
    args = parser.parse_args(argv)
    reload = reload_nginx(args.nginx_pid_file)

    def report_and_reload() -> None:
        print(" ".join(f"{s}={'up' if up else 'down'}" for s, up in watcher.healthy.items()), flush=True)
        reload()

    watcher = Watcher(args.server, args.upstream_file, report_and_reload, args.name, args.interval, args.timeout,
                      args.live_timeout, args.rise)
    try:
        watcher.run()
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
