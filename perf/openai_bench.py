"""`python -m perf.openai_bench`: what the OpenAI-compatible frontend costs. The same streamed load (closed-loop
concurrency, fixed output length) straight to tritonserver over gRPC (perf/llm.py) and through the frontend (its own
process, `python -m frontend`, the official `openai` client's async streaming), side by side in one run, alternating
rounds; output tokens/s through the frontend / direct. Results: <date>-openai-frontend.{md,csv}."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from backends.server import TritonServer, free_port
from perf import genai_perf
from perf.llm import LoadSpec, StreamTiming, closed_loop, make_prompts, run_load, summarize
from perf.report import bench_arguments, hardware_line, write_table


async def openai_load(base_url: str, model: str, prompts: list[str], spec: LoadSpec,
                      sdk: bool = True) -> list[StreamTiming]:
    """perf.llm.closed_loop, each request a streamed /v1/completions: through the official `openai`
    client (`sdk`), or read as plain Server-Sent Events (httpx2, which that client is built on; json per line)."""
    import httpx2
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    http = httpx2.AsyncClient(timeout=600, limits=httpx2.Limits(max_connections=None))
    body = {"model": model, "max_tokens": spec.output_tokens, "temperature": 0, "stream": True,
            "min_tokens": spec.output_tokens}

    async def texts(prompt: str):
        if sdk:
            stream = await client.completions.create(model=model, prompt=prompt, max_tokens=spec.output_tokens,
                                                     temperature=0, stream=True,
                                                     extra_body={"min_tokens": spec.output_tokens})
            async for chunk in stream:
                yield chunk.choices[0].text if chunk.choices else ""
            return
        async with http.stream("POST", f"{base_url}/completions", json=body | {"prompt": prompt}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    yield json.loads(line[6:])["choices"][0]["text"]

    async def one(prompt: str) -> StreamTiming:
        timing, pieces = StreamTiming(time.perf_counter(), [], ""), []
        try:
            async for text in texts(prompt):
                if text:
                    pieces.append(text)
                    timing.arrivals.append(time.perf_counter())
        except (openai.OpenAIError, httpx2.HTTPError) as e:
            timing.error = str(e)
        timing.ended, timing.text = time.perf_counter(), "".join(pieces)
        return timing

    try:
        return await closed_loop(lambda i: one(prompts[i % len(prompts)]), spec)
    finally:
        await client.close()
        await http.aclose()


class CpuMeter:
    """CPU cores used by the server (tritonserver and its python stubs), the frontend and this load generator while
    a load runs, from /proc (Linux): on a small machine they share the cores the engine computes on."""

    def __init__(self, frontend_pid: int):
        self.frontend_pid = frontend_pid

    @staticmethod
    def family(pid: int) -> list[int]:
        """`pid` and its children (the frontend's worker processes)."""
        children = Path(f"/proc/{pid}/task/{pid}/children")
        return [pid, *map(int, children.read_text().split())] if children.exists() else [pid]

    @staticmethod
    def seconds(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    @staticmethod
    def server_pids() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                command = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            except OSError:
                continue
            if command.split(b"\0")[0].endswith(b"tritonserver") or b"triton_python_backend_stub" in command:
                pids.append(int(entry.name))
        return pids

    def measure(self, run) -> tuple[object, dict[str, float]]:
        """`run()`'s result and the cores each part used meanwhile."""
        groups = {"server": self.server_pids(), "frontend": self.family(self.frontend_pid), "client": [os.getpid()]}
        before = {k: sum(self.seconds(p) for p in pids) for k, pids in groups.items()}
        start = time.perf_counter()
        result = run()
        wall = time.perf_counter() - start
        return result, {k: (sum(self.seconds(p) for p in pids) - before[k]) / wall for k, pids in groups.items()}


def start_frontend(grpc_url: str, repository: Path, port: int, workers: int = 1) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "frontend", "--host", "127.0.0.1", "--port", str(port),
                                "--triton", grpc_url, "--repository", str(repository), "--workers", str(workers)],
                               stdout=subprocess.DEVNULL, stderr=open("logs/bench-openai-frontend.log", "wb"),
                               env=os.environ | {"PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("the frontend did not start; see logs/bench-openai-frontend.log") from None
            time.sleep(0.2)


def genai_perf_chat(repository: Path, model: str, spec: LoadSpec, workdir: Path) -> dict[str, float]:
    """genai-perf's OpenAI chat endpoint type (streamed /v1/chat/completions) against the frontend serving `model`
    (a model with a chat template), in a server of its own."""
    server = TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-openai-genai-perf.log"),
                          model_control="explicit", load_models=[model])
    with server:
        frontend = start_frontend(server.grpc_url, repository, port := free_port())
        try:
            warm_up = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello"}],
                                  "max_tokens": 4}).encode()
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", warm_up,
                                                          {"content-type": "application/json"}), timeout=120).read()
            return genai_perf.run_genai_perf(f"127.0.0.1:{port}", model, spec, repository / model / "1", workdir,
                                             interval_ms=8000, openai_chat=True)
        finally:
            frontend.terminate()
            frontend.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.openai_bench", description=__doc__)
    bench_arguments(parser, interval_ms=0, concurrency=(16, 64))
    parser.add_argument("--model", default="llm")
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="direct / frontend rounds, alternating")
    parser.add_argument("--requests-per-stream", type=int, default=4,
                        help="measured requests in a round, per concurrent stream (longer rounds settle the ratios)")
    parser.add_argument("--label", help="results are named <date>-openai-frontend-LABEL")
    parser.add_argument("--frontend-workers", type=int, default=1, help="python -m frontend --workers")
    parser.add_argument("--chat-model", default="smollm2",
                        help="served for genai-perf's OpenAI chat endpoint type (where genai-perf is installed: "
                        "make genai-perf); it needs a chat template")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    Path("logs").mkdir(exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.repository / args.model / "1")
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    prompts = make_prompts(32, args.input_tokens, lambda t: tokenizer.encode(t, add_special_tokens=False),
                           tokenizer.decode)
    rows = []
    server = TritonServer(args.repository, free_port(), free_port(), free_port(), Path("logs/bench-openai.log"),
                          model_control="explicit", load_models=[args.model])
    with server:
        frontend = start_frontend(server.grpc_url, args.repository, port := free_port(), args.frontend_workers)
        try:
            for concurrency in args.concurrency:
                spec = LoadSpec(concurrency, args.input_tokens, args.output_tokens,
                                requests=args.requests_per_stream * concurrency)
                rates: dict[str, list[float]] = {"direct": [], "sse": [], "sdk": []}
                cores: dict[str, dict[str, float]] = {}
                url = f"http://127.0.0.1:{port}/v1"
                meter = CpuMeter(frontend.pid)
                for _ in range(args.rounds):
                    direct, cores["direct"] = meter.measure(lambda: asyncio.run(run_load(
                        server.grpc_url, args.model, prompts, spec,
                        {"min_length": args.output_tokens, "temperature": 0.0})))
                    rates["direct"].append(summarize(direct, count)["output_tokens_per_s"])
                    for client, sdk in (("sse", False), ("sdk", True)):
                        through, cores[client] = meter.measure(
                            lambda: asyncio.run(openai_load(url, args.model, prompts, spec, sdk)))
                        rates[client].append(summarize(through, count)["output_tokens_per_s"])
                mean = {k: sum(v) / len(v) for k, v in rates.items()}
                rows.append([args.model, concurrency, args.input_tokens, args.output_tokens, round(mean["direct"], 1),
                             round(mean["sse"], 1), round(mean["sse"] / mean["direct"], 3), round(mean["sdk"], 1),
                             round(mean["sdk"] / mean["direct"], 3),
                             " / ".join(f"{d:.0f}:{e:.0f}:{o:.0f}" for d, e, o in zip(*rates.values())),
                             *(" / ".join(f"{cores[mode][part]:.2f}" for part in ("server", "frontend", "client"))
                               for mode in ("direct", "sse"))])
                print(rows[-1], flush=True)
        finally:
            frontend.terminate()
            frontend.wait(10)
    notes = []
    if genai_perf.available() and (args.repository / args.chat_model).is_dir():
        spec = LoadSpec(4, 64, 16, requests=16)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "genai-perf"
            work.mkdir()
            figures = genai_perf_chat(args.repository, args.chat_model, spec, work)
        notes.append(f"genai-perf 0.0.8, `--service-kind openai --endpoint-type chat --streaming` against the frontend "
                     f"serving {args.chat_model}, concurrency {spec.concurrency}, {spec.input_tokens} synthetic input / "
                     f"{spec.output_tokens} output tokens (min_tokens): output {figures['output_tokens_per_s']:.1f} "
                     f"tokens/s, {figures['requests_per_s']:.2f} requests/s, time to first token p50 "
                     f"{figures['ttft_ms_p50']:.0f} ms, inter-token latency p50 {figures['itl_ms_p50']:.1f} ms.")
        print(notes[-1], flush=True)
    else:
        notes.append(f"genai-perf's chat endpoint was not run (genai-perf installed: {genai_perf.available()}; "
                     f"{args.chat_model} in the repository: {(args.repository / args.chat_model).is_dir()}).")
    write_table(args.results / args.host, "openai-frontend" + (f"-{args.label}" if args.label else ""),
                ["model", "concurrency", "input tokens", "output tokens", "direct gRPC output tokens/s",
                 "frontend, SSE client", "/ direct", "frontend, openai SDK", "/ direct",
                 "rounds (direct:SSE:SDK)", "CPU cores direct (server / frontend / client)",
                 "CPU cores SSE (server / frontend / client)"], rows,
                hardware_line("2.51.0"),
                [f"Each round: {args.requests_per_stream} x concurrency measured requests after a warm-up round of "
                 "concurrency requests, "
                 "closed loop, output length forced (min_length / min_tokens), greedy; each round runs direct, then the "
                 "frontend read as plain SSE (httpx2, json per line), then through the official openai client's "
                 "async streaming (its per-chunk parsing is part of that column). Tokens counted with the model's tokenizer on each request's text. The frontend runs as "
                 "its own process (python -m frontend, --workers as the command line says, 1 by default) on the same machine as tritonserver and the load generator.",
                 "CPU cores: CPU time over wall time during the last round, from /proc: server = tritonserver and its "
                 "python stubs (the engine), client = this load generator.",
                 *notes, f"Command line: python -m perf.openai_bench {' '.join(argv or sys.argv[1:])}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
