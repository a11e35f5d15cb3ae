"""genai-perf on the same load as perf/llm.py, for a second opinion on its figures.

genai-perf 0.0.8 drives our perf_analyzer (2.50) through Triton's gRPC streaming with the tensorrtllm_backend input
names, which our generating models accept. It lives in its own venv (`make genai-perf`): it pulls pandas, plotly,
kaleido and statsmodels, which the serving environment does not need.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from perf.llm import PERCENTILES, LoadSpec

GENAI_PERF = Path(".venv-genai-perf/bin/genai-perf")


def available() -> bool:
    return GENAI_PERF.exists()


def read_export(path: Path) -> dict[str, float]:
    """profile_export_genai_perf.json -> the keys perf.llm.summarize uses."""
    data = json.loads(path.read_text())
    out = {"output_tokens_per_s": data["output_token_throughput"]["avg"],
           "requests_per_s": data["request_throughput"]["avg"],
           "output_tokens_mean": data["output_sequence_length"]["avg"]}
    for ours, theirs in (("ttft_ms", "time_to_first_token"), ("itl_ms", "inter_token_latency"),
                         ("latency_ms", "request_latency")):
        out[f"{ours}_mean"] = data[theirs]["avg"]
        for q in PERCENTILES:
            out[f"{ours}_p{q}"] = data[theirs][f"p{q}"]
    return out


def run_genai_perf(url: str, model: str, spec: LoadSpec, tokenizer: Path, workdir: Path,
                   interval_ms: int = 4000, openai_chat: bool = False) -> dict[str, float]:
    """One genai-perf profile at `spec`'s concurrency and lengths (deterministic output length): on Triton's gRPC
    streaming at `url`, or with `openai_chat` on the OpenAI frontend's streamed /v1/chat/completions there (the
    length forced with its min_tokens extension)."""
    perf_analyzer_dir = Path(sys.prefix) / "bin"
    env = dict(os.environ, PATH=f"{perf_analyzer_dir}:{os.environ['PATH']}")
    service = ["--service-kind", "openai", "--endpoint-type", "chat", "--extra-inputs",
               f"min_tokens:{spec.output_tokens}"] if openai_chat else \
        ["--service-kind", "triton", "--backend", "tensorrtllm", "--output-tokens-mean-deterministic"]
    cmd = [str(GENAI_PERF.resolve()), "profile", "-m", model, *service,
           "--streaming", "-u", url, "--concurrency", str(spec.concurrency),
           "--synthetic-input-tokens-mean", str(spec.input_tokens), "--synthetic-input-tokens-stddev", "0",
           "--output-tokens-mean", str(spec.output_tokens),
           "--tokenizer", str(tokenizer.resolve()), "--num-prompts", str(max(spec.requests, 16)),
           "--measurement-interval", str(interval_ms), "--artifact-dir", str(workdir.resolve())]
    if not openai_chat:  # perf_analyzer's HTTP client for OpenAI keeps genai-perf's own settings (stability 999%)
        cmd += ["--", "--stability-percentage", "100", "--max-trials", "3"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=workdir.parent)
    if run.returncode != 0:
        raise RuntimeError(f"genai-perf failed ({run.returncode}): {' '.join(cmd)}\n{run.stdout[-2000:]}"
                           f"{run.stderr[-2000:]}")
    return read_export(workdir / "profile_export_genai_perf.json")
