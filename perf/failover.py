"""`python -m perf.failover`: two tritonservers behind nginx (the Debian package), a steady load, one server killed
or hung mid-run. Records how many requests were lost, how long nginx kept sending to the failed server, and how
the LLM streams that were on it ended (with an error, not a hang). Results: <date>-failover.{md,csv}.

nginx's open-source build has passive health checks only: a server that refuses a connection is marked down for
`fail_timeout` and the request is retried on the other (`proxy_next_upstream`, inference requests included: they
are idempotent here, a failed request produced nothing). A stream that has started cannot be retried; nginx ends
it as if complete, and the client finds it cut because its last event has no `finish_reason`. Each fault runs
twice: with passive checks only, and with active ones (client.balancer probing the health models).
"""
from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from backends.server import TritonServer, free_port
from client.balancer import (LIVE_TIMEOUT_S, PROBE_INTERVAL_S, PROBE_TIMEOUT_S, Watcher, reload_nginx,
                             upstream_block)
from client.sdk import http_generate_stream
from perf.inputs import model_items
from perf.report import hardware_line, write_table

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


STREAM_READ_TIMEOUT_S = 10  # nginx: the longest wait between two events of a stream


def nginx_config(prefix: Path, listen: int, read_timeout_s: int = 5) -> str:
    """The upstream block is prefix/upstream.conf (client.balancer rewrites it)."""
    temp = " ".join(f"{kind}_temp_path {prefix}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    user = "user root;  # its workers write request bodies under the prefix, which only we can\n" if os.getuid() == 0 \
        else ""
    return f"""daemon off;
{user}worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 1024; }}
http {{
  {temp}
  log_format timed '$msec $request_time $status "$upstream_addr" "$upstream_status" $request_uri';
  access_log {prefix}/access.log timed;
  include {prefix}/upstream.conf;
  server {{
    listen 127.0.0.1:{listen};
    client_max_body_size 64m;
    proxy_http_version 1.1;
    proxy_set_header Connection "";
    proxy_buffering off;
    proxy_connect_timeout 1s;
    proxy_next_upstream error timeout http_502 http_503 http_504 non_idempotent;
    proxy_next_upstream_tries 2;
    location / {{
      proxy_pass http://triton;
      proxy_read_timeout {read_timeout_s}s;  # a hung server is only noticed when this runs out
    }}
    location ~ /generate_stream$ {{
      proxy_pass http://triton;
      proxy_read_timeout {STREAM_READ_TIMEOUT_S}s;  # between two events
    }}
  }}
}}
"""


class Nginx:
    def __init__(self, prefix: Path, listen: int, upstreams: list[int]):
        self.prefix, self.listen = prefix, listen
        prefix.mkdir(parents=True, exist_ok=True)
        self.upstreams = [f"127.0.0.1:{port}" for port in upstreams]
        (prefix / "upstream.conf").write_text(upstream_block("triton", dict.fromkeys(self.upstreams, True)))
        (prefix / "nginx.conf").write_text(nginx_config(prefix, listen))

    def __enter__(self) -> Nginx:
        self.process = subprocess.Popen([NGINX, "-p", str(self.prefix), "-c", str(self.prefix / "nginx.conf")],
                                        stdout=subprocess.DEVNULL, stderr=open(self.prefix / "stderr.log", "wb"))
        deadline = time.monotonic() + 10
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.listen, timeout=1)
                connection.request("GET", "/v2/health/ready")
                connection.getresponse().read()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not start: {(self.prefix / 'stderr.log').read_text()}"
                                       f"{(self.prefix / 'error.log').read_text()}") from None
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(10)

    def log(self) -> list[dict]:
        """The access log: when each request ended (epoch s), its duration, status and upstream(s) tried."""
        rows = []
        for line in (self.prefix / "access.log").read_text().splitlines():
            end, duration, status, rest = line.split(" ", 3)
            _, upstreams, _, _, uri = rest.split('"')
            rows.append({"end": float(end), "duration": float(duration), "status": int(status),
                         "upstreams": [u.strip() for u in upstreams.split(",")], "uri": uri.strip()})
        return rows


@dataclasses.dataclass
class Outcome:
    start: float  # epoch seconds
    end: float
    error: str | None


_local = threading.local()  # one HTTP client per load thread


def infer_once(url: str, image: bytes) -> None:
    import tritonclient.http as httpclient

    client = getattr(_local, "client", None)
    if client is None:
        client = _local.client = httpclient.InferenceServerClient(url, connection_timeout=30, network_timeout=30)
    tensor = httpclient.InferInput("image", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image]], dtype=np.object_))
    client.infer("vit", [tensor])



def timed(call) -> Outcome:
    start = time.time()
    try:
        call()
        return Outcome(start, time.time(), None)
    except Exception as e:  # what the client saw; counted, not raised
        return Outcome(start, time.time(), f"{type(e).__name__}: {e}"[:200])


def stream_once(url: str, tokens: int) -> Outcome:
    """client.sdk raises for a stream whose last event has no finish_reason: one cut short fails."""
    body = {"text_input": "a photo of", "max_tokens": tokens, "min_length": tokens, "temperature": 0.0}
    return timed(lambda: list(http_generate_stream(url, "llm", body, timeout_s=60)))


def fail(pid: int, fault: str) -> None:
    """"kill": the tritonserver process crashes (its stubs exit at their next beat); "stop": the whole server hangs,
    stubs included, as `docker pause` freezes a container (the server runs in its own session)."""
    if fault == "kill":
        os.kill(pid, signal.SIGKILL)
    else:
        os.killpg(pid, signal.SIGSTOP)


@dataclasses.dataclass
class FailoverResult:
    requests: list[Outcome]
    streams: list[Outcome]
    killed_at: float  # epoch seconds
    dead_port: int
    log: list[dict]
    changes: list[tuple[float, str, bool]] | None = None  # the active checks' (epoch s, server, healthy)


def run(repository: Path, workdir: Path, rate: float = 40.0, duration_s: float = 10.0, kill_after_s: float = 4.0,
        streams: int = 4, stream_tokens: int = 500, fault: str = "kill", active: bool = False) -> FailoverResult:
    """Servers A and B (vit, llm, health) behind nginx; `rate` vit requests/s open loop for `duration_s`; `streams`
    LLM streams start a second before B is killed (`fault` "kill": SIGKILL; "stop": SIGSTOP to all its processes);
    `active`: client.balancer takes failing servers out of nginx's upstream."""
    servers = [TritonServer(repository, free_port(), free_port(), free_port(), workdir / f"server-{i}.log",
                            model_control="explicit", load_models=["vit", "llm", "health"]) for i in range(2)]
    image = model_items("vit", "thumbnails")[0]
    with servers[0], servers[1]:
        ports = [int(s.http_url.rsplit(":", 1)[1]) for s in servers]
        with Nginx(workdir / "nginx", free_port(), ports) as nginx:
            url = f"127.0.0.1:{nginx.listen}"
            watcher = Watcher(nginx.upstreams, nginx.prefix / "upstream.conf",
                              reload_nginx(nginx.prefix / "nginx.pid")).start() if active else None
            with ThreadPoolExecutor(64) as pool:
                start = time.monotonic()
                requests, stream_futures, killed_at = [], [], None
                for i in range(int(rate * duration_s)):
                    due = start + i / rate
                    now = time.monotonic()
                    if due > now:
                        time.sleep(due - now)
                    if not stream_futures and now - start >= kill_after_s - 1.0:
                        stream_futures = [pool.submit(stream_once, url, stream_tokens) for _ in range(streams)]
                    if killed_at is None and now - start >= kill_after_s:
                        killed_at = time.time()
                        fail(servers[1].process.pid, fault)
                    requests.append(pool.submit(timed, lambda: infer_once(url, image)))
                outcomes = [f.result() for f in requests]
                stream_outcomes = [f.result() for f in stream_futures]
            if watcher is not None:
                watcher.stop()
            if fault == "stop":
                os.killpg(servers[1].process.pid, signal.SIGKILL)  # stopped processes cannot shut down
            log = nginx.log()
    return FailoverResult(outcomes, stream_outcomes, killed_at, ports[1], log,
                          watcher.changes if watcher else None)


def summary(result: FailoverResult) -> dict[str, float | int]:
    before = [o.end - o.start for o in result.requests if o.end < result.killed_at and o.error is None]
    after = [o.end - o.start for o in result.requests if o.start >= result.killed_at and o.error is None]
    dead = f"127.0.0.1:{result.dead_port}"
    to_dead = [row for row in result.log if dead in row["upstreams"] and row["end"] >= result.killed_at
               and row["uri"].endswith("/infer")]
    # when nginx last sent a vit request to server B (each such try failed and was retried on the other; a hung
    # server's only after the read timeout)
    out_of_rotation = max((row["end"] - row["duration"] - result.killed_at for row in to_dead), default=0.0)
    broken = [s for s in result.streams if s.error is not None]
    # the streams B was serving when it failed (one that had finished before is not cut)
    on_dead = [row for row in result.log if row["upstreams"][-1] == dead and row["uri"].endswith("/generate_stream")
               and row["end"] >= result.killed_at]
    downs = [(t - result.killed_at, server == dead) for t, server, up in result.changes or [] if not up]

    def p(times: list[float], q: float) -> float:  # ms; NaN when none succeeded (the test then names the errors)
        return 1e3 * float(np.percentile(times, q)) if times else float("nan")

    return {"requests": len(result.requests), "failed": sum(o.error is not None for o in result.requests),
            "p50 ms before": p(before, 50), "p99 ms before": p(before, 99),
            "p50 ms after": p(after, 50), "p99 ms after": p(after, 99),
            "vit requests tried on server B after the fault": len(to_dead),
            "last of them sent, s after the fault": round(max(out_of_rotation, 0.0), 3),
            "active checks took B out, s after the fault": "-" if result.changes is None
            else round(min((t for t, b in downs if b and t >= 0), default=float("nan")), 3),
            "servers taken out before the fault": "-" if result.changes is None else sum(t < 0 for t, _ in downs),
            "streams": len(result.streams), "streams on B at the fault": len(on_dead),
            "streams ended with an error": len(broken),
            "latest end of those, s after the fault": round(max((s.end - result.killed_at for s in broken),
                                                                default=0.0), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.failover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="vm")
    parser.add_argument("--rate", type=float, default=40.0, help="vit requests per second, open loop")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--faults", nargs="+", choices=["kill", "stop"], default=["kill", "stop"])
    parser.add_argument("--checks", nargs="+", choices=["passive", "active"], default=["passive", "active"])
    args = parser.parse_args(argv)

    rows, errors = [], []
    for fault in args.faults:
        for checks in args.checks:
            with tempfile.TemporaryDirectory() as tmp:
                result = run(args.repository, Path(tmp), args.rate, args.duration, fault=fault,
                             active=checks == "active")
            figures = summary(result)
            rows.append([fault, checks, *[round(v, 1 if abs(v) >= 10 else 3) if isinstance(v, float) else v
                                          for v in figures.values()]])
            label = f"{fault}, {checks} checks"
            errors += [f"{label}: a stream ended with {s.error}" for s in result.streams if s.error][:2]
            errors += [f"{label}: a request failed with {o.error}" for o in result.requests if o.error][:2]
            print(json.dumps({"fault": fault, "checks": checks, **figures}), flush=True)
    write_table(args.results / args.host, "failover", ["fault", "checks", *figures], rows, hardware_line("2.51.0"),
                ["Two tritonservers (vit, llm, health; this repository) behind nginx on loopback. Passive checks: "
                 "max_fails 1, fail_timeout 10 s, proxy_next_upstream error timeout 502 503 504 non_idempotent, 2 "
                 f"tries, connect timeout 1 s, read timeout 5 s, {STREAM_READ_TIMEOUT_S} s between the events of "
                 f"generate_stream. Active checks: every {PROBE_INTERVAL_S} s client.balancer probes each server's "
                 f"/v2/health/live ({LIVE_TIMEOUT_S} s timeout) and health model ({PROBE_TIMEOUT_S} s timeout) and "
                 "reloads nginx without the failing one. "
                 "vit requests through tritonclient HTTP at a fixed rate (open loop); 4 LLM streams (HTTP "
                 "generate_stream, client.sdk: a stream whose last event has no finish_reason raises) started a "
                 "second before server B is hit: kill = SIGKILL to tritonserver, stop = SIGSTOP to it and its stubs "
                 "(a hung server, as `docker pause` freezes a container: connections accepted by the kernel, never "
                 "answered). Failed = what the client saw after nginx's retry. Requests sent to B: nginx's access "
                 "log.",
                 *errors, f"Command line: python -m perf.failover {' '.join(argv or sys.argv[1:])}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
