"""Start, watch and stop a real tritonserver for a model repository.

Used by `make serve`, `make demo`, the test fixture and perf/. It finds the binary (PATH first, e.g. the NGC
image; else the one inside the nvidia-pytriton wheel), puts the python backend stub for the running interpreter
next to the backend, assembles the backend directory (the installation's backends, `python` among them, plus our
Python-based backends `backends/mm_*`, all as links), sets the library path the stub needs, waits for readiness and
shuts the server down cleanly.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from backends.core.spans import SPANS_ENV, spans_file

BACKENDS = Path(__file__).resolve().parent  # our Python-based backends: BACKENDS/<name>/model.py
DEFAULT_BACKEND_DIR = Path("/opt/tritonserver/backends")  # where an installed tritonserver (NGC image) has them


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir: Path  # the installation's backends (python/ among them)


def our_backends() -> dict[str, Path]:
    return {p.name: p for p in sorted(BACKENDS.iterdir()) if (p / "model.py").is_file()}


def assemble_backend_dir(install: TritonInstall) -> Path:
    """A backend directory holding links to the installation's backends and to ours, so that a model whose config
    says `backend: "mm_llm"` runs backends/mm_llm/model.py through the python backend. One per checkout and
    installation; links are replaced atomically, so servers started at the same time can share it."""
    key = hashlib.sha256(f"{BACKENDS}|{install.backend_dir}".encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"triton-backends-{os.getuid()}-{key}"
    target.mkdir(exist_ok=True)
    sources = {p.name: p for p in install.backend_dir.iterdir()} if install.backend_dir.is_dir() else {}
    sources.update(our_backends())
    for name, source in sources.items():
        link = target / name
        if link.is_symlink() and os.readlink(link) == str(source):
            continue
        staging = target / f".{name}.{os.getpid()}"
        staging.unlink(missing_ok=True)
        staging.symlink_to(source, target_is_directory=True)
        os.replace(staging, link)
    return target


def find_tritonserver() -> TritonInstall:
    """$TRITONSERVER_ROOT (a folder laid out like nvidia-pytriton's, as `make bundle` ships it), else a tritonserver
    on PATH, else the one in the nvidia-pytriton wheel."""
    if os.environ.get("TRITONSERVER_ROOT"):
        root = Path(os.environ["TRITONSERVER_ROOT"])
    elif on_path := shutil.which("tritonserver"):
        return TritonInstall(Path(on_path), DEFAULT_BACKEND_DIR)
    elif (spec := find_spec("pytriton")) and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    else:
        raise FileNotFoundError("no tritonserver on PATH and nvidia-pytriton is not installed; run `make setup`")
    install = TritonInstall(root / "bin" / "tritonserver", root / "backends")
    prepare_python_stub(root)
    return install


def prepare_python_stub(root: Path) -> None:
    """The python backend runs the stub found beside libtriton_python.so: give it the one for this Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    target = root / "backends" / "python" / "triton_python_backend_stub"
    if not source.exists():
        raise FileNotFoundError(f"nvidia-pytriton has no python backend stub for Python {version}")
    if not target.exists() or target.read_bytes() != source.read_bytes():
        shutil.copy2(source, target)
        target.chmod(0o755)


def server_env() -> dict[str, str]:
    """The stub links libpython3.x: put this interpreter's libdir first so it loads the matching one."""
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def port_is_free(port: int) -> bool:
    """Nothing listens there (a fresh server would otherwise look ready through an old one)."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class TritonServer:
    """One tritonserver process. Use as a context manager, or call start() / stop()."""

    repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_file: Path = Path("logs/tritonserver.log")
    model_control: str = "none"  # none | explicit | poll
    load_models: list[str] = field(default_factory=list)  # explicit mode: models loaded at start ("*" for all)
    extra_args: list[str] = field(default_factory=list)
    # GPU memory Triton lends models for tensors passed on the GPU (an ensemble's GPU steps); None: Triton's 64 MB,
    # which batches of pixel tensors outgrow ("failed to copy data: invalid argument" in the stub)
    cuda_memory_pool_mb: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the server's (and its models') environment
    # Triton's trace of every `trace_rate`-th request, written to trace_file.0, .1, ... (one file per
    # `trace_log_frequency` traces), and the LLM engines' spans of each request to trace_file.spans.jsonl
    trace_file: Path | None = None
    trace_rate: int = 1
    trace_log_frequency: int = 1
    startup_timeout_s: float = 180.0
    address: str = "127.0.0.1"  # where HTTP, gRPC and metrics listen: loopback unless asked (0.0.0.0: everywhere)
    process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        install = find_tritonserver()
        cmd = [str(install.binary), f"--model-repository={Path(self.repository).resolve()}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", f"--model-control-mode={self.model_control}",
               f"--http-address={self.address}", f"--grpc-address={self.address}",
               f"--metrics-address={self.address}",
               "--log-verbose=0", "--exit-timeout-secs=20", f"--backend-directory={assemble_backend_dir(install)}"]
        cmd += [f"--load-model={name}" for name in self.load_models]
        if self.cuda_memory_pool_mb is not None:
            cmd.append(f"--cuda-memory-pool-byte-size=0:{self.cuda_memory_pool_mb << 20}")
        if self.trace_file is not None:
            cmd += [f"--trace-config=triton,file={Path(self.trace_file).resolve()}",
                    f"--trace-config=triton,log-frequency={self.trace_log_frequency}",
                    f"--trace-config=rate={self.trace_rate}", "--trace-config=level=TIMESTAMPS"]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = server_env() | self.env
        if self.trace_file is not None:
            env[SPANS_ENV] = str(spans_file(self.trace_file))
        return env

    def start(self) -> TritonServer:
        if self.model_control != "explicit" and self.load_models:
            raise ValueError("load_models needs model_control='explicit'")
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            if not port_is_free(port):
                raise RuntimeError(f"port {port} is already in use (another tritonserver?); pick other ports")
        self.log_file = Path(self.log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_file.open("wb")
        if self.trace_file is not None:
            Path(self.trace_file).parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                        start_new_session=True)
        log.close()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        """Until the server says it is ready and its metrics answer: Triton starts its metrics service last, tens of
        milliseconds after the ready endpoint answers (a test that read the metrics at once was refused)."""
        deadline = time.monotonic() + self.startup_timeout_s
        pending = [f"http://localhost:{self.http_port}/v2/health/ready"]
        if "--allow-metrics=false" not in self.extra_args:
            pending.append(self.metrics_url)
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} during startup; "
                                   f"its errors:\n{self.log_errors()}\nlog {self.log_file}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(pending[0], timeout=2) as response:
                    if response.status == 200:
                        pending.pop(0)
                        if not pending:
                            return
                        continue
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready after {self.startup_timeout_s:.0f} s; log {self.log_file}:\n"
                           f"{self.log_tail()}")

    def log_errors(self, lines: int = 10) -> str:
        """The log's last error lines (glog's `E`MMDD prefix): why a model failed to load, which the tail's status
        table cuts to its column width."""
        try:
            errors = [line for line in self.log_file.read_text(errors="replace").splitlines()
                      if re.match(r"E\d{4} ", line)]
        except OSError:
            return "(no log)"
        return "\n".join(errors[-lines:]) or "(none)"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (Triton's graceful shutdown: finish in-flight requests, unload models), then SIGKILL. A server that
        died (killed) may leave its model stubs behind: they are killed with it (its process group)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # the server, if it would not stop, and stubs that outlived it (killed, or exited on its timeout)
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left of it
            pass
        self.process.wait()
        remove_unmapped_shm_regions()
        return self.process.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stub_pids(server_pid: int) -> set[int]:
    """The python backend stubs of a server started by TritonServer (they are in its process group)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) == server_pid and b"triton_python_backend_stub" in (stat.parent / "cmdline").read_bytes():
                pids.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return pids


def supervise(server: TritonServer, poll_s: float = 1.0) -> int:
    """Wait for the server in the foreground. A model's stub that dies (killed, crashed) is not restarted by Triton
    2.51: the model stays READY and answers every request with "Stub process ... is not healthy". With the model
    control off (no model is unloaded on purpose), a stub gone means that: the whole server is restarted. Returns the
    server's exit code when it ends on its own."""
    stubs = stub_pids(server.process.pid)
    while server.process.poll() is None:
        time.sleep(poll_s)
        if server.model_control == "none" and stubs - stub_pids(server.process.pid):
            print(f"a model stub of tritonserver {server.process.pid} died; restarting the server", flush=True)
            server.stop()
            server.start()
            stubs = stub_pids(server.process.pid)
            print(f"tritonserver ready again (pid {server.process.pid})", flush=True)
    return server.process.returncode


def remove_unmapped_shm_regions(folder: Path = Path("/dev/shm")) -> list[str]:
    """The python backend's shared-memory regions that no process maps any more: left by a server that was killed,
    or that exited while a model was still live (Triton 2.51 keeps one live after a request it refused on a gRPC
    stream, until its exit timeout). A live server maps each of its regions (within moments of making one), so this
    never touches one in use."""
    now = time.time()
    regions = set()
    for path in folder.glob("triton_*_shm_region_*") if folder.is_dir() else []:
        try:
            if now - path.stat().st_ctime > 10:  # not one a starting server has made but not yet mapped
                regions.add(path.name)
        except FileNotFoundError:
            continue
    if not regions:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.rsplit("/", 1)[-1] for line in maps.read_text().splitlines() if "_shm_region_" in line)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    removed = sorted(regions - mapped)
    for name in removed:
        (folder / name).unlink(missing_ok=True)
    return removed


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Run tritonserver on a model repository (foreground).")
    parser.add_argument("--repository", default="model_repository")
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--listen", default="127.0.0.1", metavar="ADDRESS",
                        help="address the three endpoints listen on; 0.0.0.0 for every interface (a container)")
    parser.add_argument("--model-control", choices=["none", "explicit", "poll"], default="none")
    parser.add_argument("--load-model", action="append", default=[], help="explicit mode: model to load (repeat)")
    parser.add_argument("--log-file", default="logs/tritonserver.log")
    parser.add_argument("--cuda-memory-pool-mb", type=int, default=None,
                        help="GPU 0's pool for tensors passed on the GPU (ensembles built with --preprocess-on-device "
                        "true need more than Triton's 64 MB: 2048 serves batches of 64 pixel tensors)")
    parser.add_argument("--trace-file", type=Path, default=None,
                        help="trace requests: Triton's trace (timestamps) to TRACE_FILE.0, .1, ... and the LLM "
                        "engines' spans to TRACE_FILE.spans.jsonl; `python -m client.timeline TRACE_FILE --request-id "
                        "ID` prints one request's timeline")
    parser.add_argument("--trace-rate", type=int, default=1, help="with --trace-file: trace every N-th request")
    parser.add_argument("--trace-log-frequency", type=int, default=1,
                        help="with --trace-file: write a file every N traces (0: only at shutdown)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    server = TritonServer(Path(args.repository), args.http_port, args.grpc_port, args.metrics_port,
                          Path(args.log_file), args.model_control, args.load_model, address=args.listen,
                          startup_timeout_s=args.timeout,
                          cuda_memory_pool_mb=args.cuda_memory_pool_mb, trace_file=args.trace_file,
                          trace_rate=args.trace_rate, trace_log_frequency=args.trace_log_frequency)

    def on_sigterm(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)  # `kill`/timeout must stop the server too, not orphan it
    with server:
        print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics {server.metrics_url}  "
              f"(log: {server.log_file}); Ctrl-C stops it", flush=True)
        try:
            return supervise(server)
        except KeyboardInterrupt:
            print("stopping tritonserver", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
