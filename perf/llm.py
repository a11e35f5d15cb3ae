"""LLM streaming benchmark: async gRPC streams through tritonclient, one per request, closed-loop concurrency.

Figures are genai-perf's definitions, so the two can be compared on the same load: time to first token (request sent
-> first non-empty response), inter-token latency ((last - first response) / (output tokens - 1) per request),
request latency, and output tokens/s over the measured phase (all output tokens / (last response - first send)).
Output tokens are counted with the model's tokenizer on the joined text, or as non-empty responses without one;
where every request was held to its length (min_length = max_tokens), a request that ended for length counts exactly
that many (re-tokenising the text of random weights over a byte-level vocabulary counted 1.7x: its invalid UTF-8
comes back as U+FFFD, three bytes).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np
import tritonclient.grpc.aio as grpcclient

from client.sdk import generation_inputs, infer_inputs

PERCENTILES = (50, 90, 99)


@dataclass
class StreamTiming:
    sent: float  # time.perf_counter() seconds
    arrivals: list[float]  # one per non-empty response
    text: str
    error: str | None = None
    ended: float = 0.0  # when the final response (or the error) arrived
    request_id: str = ""  # the id it was sent with (Triton's trace and the engine's spans record it)
    finish_reason: str = ""  # the final response's ("length", "stop", ...), where it sent one


@dataclass(frozen=True)
class LoadSpec:
    concurrency: int
    input_tokens: int
    output_tokens: int
    requests: int  # measured requests (a warm-up round of `concurrency` requests runs first)


async def stream_one(client: grpcclient.InferenceServerClient, model: str, inputs: list,
                     parameters: dict | None = None) -> StreamTiming:
    """Send one request (with request `parameters`, e.g. {"qos_class": "high"}) on its own stream and timestamp
    every response until the final one."""
    done = asyncio.Event()
    request_id = uuid.uuid4().hex

    async def request_iterator():
        yield {"model_name": model, "inputs": inputs, "request_id": request_id,
               "enable_empty_final_response": True, "parameters": parameters}
        await done.wait()  # keep the stream open until the final response arrived

    timing = StreamTiming(time.perf_counter(), [], "", request_id=request_id)
    pieces = []
    try:
        # read to the stream's end: once the final response arrived the request iterator ends, and the server closes
        # the stream (cancelling a completed stream instead can leave Triton 2.51 holding the model at unload)
        async for result, error in client.stream_infer(request_iterator()):
            now = time.perf_counter()
            if error is not None:
                timing.error, timing.ended = str(error), now
                done.set()
                continue
            output = result.as_numpy("text_output")
            if output is not None and output.size and len(output.reshape(-1)[0]):
                pieces.append(output.reshape(-1)[0].decode("utf-8", errors="replace"))
                timing.arrivals.append(now)
            if result.get_response().parameters["triton_final_response"].bool_param:
                reason = result.as_numpy("finish_reason")
                timing.finish_reason = reason.reshape(-1)[0].decode() if reason is not None and reason.size else ""
                timing.ended = now
                done.set()
    finally:
        done.set()
    timing.ended = timing.ended or time.perf_counter()
    timing.text = "".join(pieces)
    return timing


async def run_load(url: str, model: str, prompts: list[str], spec: LoadSpec, extra: dict | None = None,
                   tensors: Callable[[int], dict[str, np.ndarray]] | None = None) -> list[StreamTiming]:
    """Warm-up round, then `spec.requests` requests from `spec.concurrency` closed-loop workers. `extra`: optional
    generation inputs; `tensors`: more inputs of the i-th request (closed_loop's numbering), sent as they are (the
    `vlm`'s image)."""
    client = grpcclient.InferenceServerClient(url)

    async def send(i: int) -> StreamTiming:
        inputs = request_inputs(prompts[i % len(prompts)], spec.output_tokens, extra, tensors(i) if tensors else {})
        return await stream_one(client, model, inputs)
    try:
        return await closed_loop(send, spec)
    finally:
        await client.close()


async def one_by_one(url: str, model: str, asks: list[tuple[str, dict[str, np.ndarray]]], output_tokens: int,
                     extra: dict | None = None) -> list[StreamTiming]:
    """Requests (prompt, more inputs) sent one after another, each when the last one's final response arrived."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return [await stream_one(client, model, request_inputs(prompt, output_tokens, extra, tensors))
                for prompt, tensors in asks]
    finally:
        await client.close()


def request_inputs(prompt: str, output_tokens: int, extra: dict | None, tensors: dict[str, np.ndarray]) -> list:
    """A generation request's inputs: the prompt, its budget and `extra` generation inputs, then `tensors` as is."""
    return generation_inputs(grpcclient, prompt, output_tokens, **(extra or {})) + infer_inputs(grpcclient, tensors)


async def closed_loop(send: Callable[[int], Awaitable[StreamTiming]], spec: LoadSpec) -> list[StreamTiming]:
    """A warm-up round of `spec.concurrency` requests (`send(0)`...), then the `spec.requests` measured ones (`send(i)`
    for the i-th after them, so that prompts never repeat where there are enough), each worker of `spec.concurrency`
    sending its next one as soon as its last one ended."""
    async def drive(indices: range) -> list[StreamTiming]:
        queue, results = iter(indices), []

        async def worker():
            for i in queue:
                results.append(await send(i))
        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
        return results

    await drive(range(spec.concurrency))
    return await drive(range(spec.concurrency, spec.concurrency + spec.requests))


def summarize(timings: list[StreamTiming], count_tokens: Callable[[str], int] | None = None,
              forced_tokens: int | None = None) -> dict[str, float]:
    """genai-perf's figures (ms, tokens/s) with p50/p90/p99; raises if any request failed. `forced_tokens`: the
    length every request was held to (min_length = max_tokens), exact for those that ended for length."""
    errors = [t.error for t in timings if t.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(timings)} requests failed, first: {errors[0]}")
    done = [t for t in timings if t.arrivals]
    tokens = np.array([forced_tokens if forced_tokens and t.finish_reason == "length"
                       else count_tokens(t.text) if count_tokens else len(t.arrivals) for t in done])
    ttft = np.array([t.arrivals[0] - t.sent for t in done]) * 1e3
    latency = np.array([t.arrivals[-1] - t.sent for t in done]) * 1e3
    multi = tokens > 1
    itl = np.array([(t.arrivals[-1] - t.arrivals[0]) / (n - 1) for t, n in zip(done, tokens) if n > 1]) * 1e3
    span = max(t.arrivals[-1] for t in done) - min(t.sent for t in done)
    out = {"requests": len(done), "output_tokens_mean": float(tokens.mean()),
           "output_tokens_per_s": float(tokens.sum() / span), "requests_per_s": len(done) / span}
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl if multi.any() else np.zeros(1)), ("latency_ms", latency)):
        out[f"{name}_mean"] = float(values.mean())
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = float(np.percentile(values, q))
    return out


def make_prompts(count: int, input_tokens: int, encode: Callable[[str], list[int]] | None = None,
                 decode: Callable[[list[int]], str] | None = None, seed: int = 0) -> list[str]:
    """Random-word prompts of `input_tokens` tokens (by the tokenizer when given, else one byte per token)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    prompts = []
    for _ in range(count):
        words = [" " + "".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(input_tokens)]
        text = "".join(words).strip()
        prompts.append(decode(encode(text)[:input_tokens]) if encode and decode else text[:input_tokens])
    return prompts
