"""The LLM streaming scenarios of `make bench`: perf/llm.py (and genai-perf beside it, where installed) at several
concurrencies and lengths, first against the `token_stream` calibration model, then against the served `llm`."""
from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from backends.server import TritonServer, free_port
from build_engines.checkpoints import byte_level_tokenizer
from perf import genai_perf, ttft_split
from perf.gpu import served_device
from perf.inputs import encoded_images, with_comment
from perf.llm import LoadSpec, make_prompts, one_by_one, run_load, summarize
from perf.report import plot_curves, stem, write_table
from perf.server_metrics import engine_steps, model_metrics
from perf.token_stream import write_token_stream_model

# (concurrency, input tokens, output tokens) of the LLM streaming benchmark
LLM_LOADS = [(1, 32, 64), (4, 32, 64), (16, 32, 64), (64, 32, 64), (1, 256, 16), (16, 256, 16)]
GENAI_PERF_LOADS = [(1, 32, 64), (16, 32, 64), (64, 32, 64)]

LLM_HEADER = ["model", "tool", "concurrency", "input tokens", "output tokens", "requests", "TTFT p50 ms", "TTFT p90 ms",
              "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms", "latency p99 ms", "output tokens/s"]


def llm_row(model: str, tool: str, spec: LoadSpec, m: dict) -> list:
    return [model, tool, spec.concurrency, spec.input_tokens, spec.output_tokens, m.get("requests", "-"),
            *(m[f"{k}_p{q}"] for k in ("ttft_ms", "itl_ms") for q in (50, 90, 99)), m["latency_ms_p99"],
            m["output_tokens_per_s"]]


def llm_streaming(server: TritonServer, model: str, tokenizer_dir: Path, tmp: Path, loads=LLM_LOADS,
                  genai_loads=GENAI_PERF_LOADS) -> tuple[list[list], list[str]]:
    """perf/llm.py at each load (and genai-perf at `genai_loads` when installed), one row per measurement, and notes:
    the server's own view of each load, its TTFT by stage when the server traces (traced_server), and the genai-perf
    runs that found no stable measurement."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    rows, notes = [], []
    for concurrency, input_tokens, output_tokens in loads:
        spec = LoadSpec(concurrency, input_tokens, output_tokens, requests=max(16, 4 * concurrency))
        prompts = load_prompts(tokenizer, spec)
        before, start = model_metrics(server.metrics_url, model), time.perf_counter()
        timings = asyncio.run(run_load(server.grpc_url, model, prompts, spec, {"min_length": output_tokens}))
        wall_s = time.perf_counter() - start
        rows.append(llm_row(model, "perf/llm.py", spec, summarize(timings, count, spec.output_tokens)))
        time.sleep(0.5)  # the engine loop observes a request's timings after its final response
        load = f"perf/llm.py at concurrency {concurrency}, {input_tokens} in / {output_tokens} out"
        if note := server_side(before, model_metrics(server.metrics_url, model), wall_s):
            notes.append(f"{load}: {note}")
        if server.trace_file is not None and (note := ttft_split.describe(ttft_split.stage_ms(timings,
                                                                                            server.trace_file))):
            notes.append(f"{load}: {note}")
        if (concurrency, input_tokens, output_tokens) in genai_loads and genai_perf.available():
            work = tmp / f"genai-perf-{model}-{concurrency}-{input_tokens}-{output_tokens}"
            try:
                rows.append(llm_row(model, "genai-perf", spec,
                                    genai_perf.run_genai_perf(server.grpc_url, model, spec, tokenizer_dir, work)))
            except RuntimeError as e:  # perf_analyzer under it found no stable window: say so, keep going
                notes.append(f"genai-perf at concurrency {concurrency}, {input_tokens} in / {output_tokens} out: "
                             f"failed ({str(e).splitlines()[0][:120]}).")
        print(" ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
    return rows, notes


def load_prompts(tokenizer, spec: LoadSpec) -> list[str]:
    """One prompt for each request of a load and its warm-up round, none repeated, so that prefix caching finds
    nothing and every prompt token is computed; the same for the same load (the seed is its shape)."""
    return make_prompts(spec.concurrency + spec.requests, spec.input_tokens,
                        lambda t: tokenizer.encode(t, add_special_tokens=False), tokenizer.decode,
                        seed=spec.concurrency * 10**6 + spec.input_tokens)


def server_side(before: dict[str, float], after: dict[str, float], wall_s: float) -> str | None:
    """The server's own view of a load (mm_llm's llm_* metrics; None for a model without them): its mean time from
    `execute` to a request's first token beside what the client measured, and the engine's steps."""
    name = "llm_time_to_first_token_seconds"
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    if not count:
        return None
    ttft_ms = 1e3 * (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / count
    return (f"TTFT in the server (from `execute` to the first token) {ttft_ms:.1f} ms on average over {count:.0f} "
            f"requests (perf/llm.py's warm-up round too); {engine_steps(before, after, wall_s)}.")


def write_llm_results(results: Path, scenario: str, rows: list[list], hardware: str, notes: list[str]) -> None:
    base = stem(results, scenario)
    series: dict[str, list] = {}
    for row in rows:
        model, tool, concurrency, isl, osl = row[:5]
        series.setdefault(f"{model} {isl}in/{osl}out ({tool})", []).append((row[9], row[13], f"c{concurrency}"))
    plot_curves(base.with_suffix(".png"), scenario, "ITL p50 (ms)", "output tokens/s", series)
    write_table(results, scenario, LLM_HEADER, rows, hardware, notes, figure=base.with_suffix(".png").name)


def calibration_bench(results: Path, tmp: Path, hardware: str, first_token_ms: float = 20,
                      token_interval_ms: float = 5) -> None:
    """The LLM benchmark against `token_stream`, whose true TTFT and ITL are known: what the tool adds."""
    write_token_stream_model(tmp / "calibration", first_token_ms, token_interval_ms)
    tokenizer_dir = tmp / "byte-tokenizer"
    byte_level_tokenizer().save_pretrained(tokenizer_dir)
    with TritonServer(tmp / "calibration", free_port(), free_port(), free_port(),
                      Path("logs/bench-calibration.log")) as server:
        rows, genai_notes = llm_streaming(server, "token_stream", tokenizer_dir, tmp)
    notes = [f"`token_stream` produces exactly `max_tokens` tokens: the first {first_token_ms:g} ms after the request "
             f"arrives, then one every {token_interval_ms:g} ms, so the true TTFT is {first_token_ms:g} ms, the true "
             f"ITL {token_interval_ms:g} ms and the most output tokens/s at concurrency c and n output tokens is "
             f"c * n / ({first_token_ms:g} + {token_interval_ms:g} * (n - 1)) ms. Rows that miss these show what the "
             "client, gRPC and the python backend add at that load."
             + ("" if genai_perf.available() else " genai-perf rows: not run (`make genai-perf` installs it)."),
             *genai_notes]
    write_llm_results(results, "llm-streaming-calibration", rows, hardware, notes)
    print("LLM streaming calibration written", flush=True)


def served_llm_bench(repository: Path, results: Path, tmp: Path, hardware: str) -> None:
    """The same streaming loads against the served `llm` (tiny model here; output length forced by min_length)."""
    with traced_server(repository, "llm", Path("logs/bench-llm.log"), tmp) as server:
        rows, genai_notes = llm_streaming(server, "llm", repository / "llm" / "1", tmp)
    write_llm_results(results, "llm-streaming", rows, hardware,
                      ["`llm` served from model_repository (its engine parameters in the model config); every request "
                       "asks for exactly `output tokens` (min_length = max_tokens)."
                       + ("" if genai_perf.available() else " genai-perf rows: not run (`make genai-perf`)."),
                       *genai_notes])
    print("LLM streaming (served llm) written", flush=True)


LLM_8B_LOADS = [(1, 128, 128), (16, 128, 128), (64, 128, 128)]


def traced_server(repository: Path, model: str, log: Path, tmp: Path) -> TritonServer:
    """`model` alone, Triton tracing one request in TRACE_RATE (and the engine's spans) so that llm_streaming can
    split its TTFT by stage; the traces go under `tmp`."""
    return TritonServer(repository, free_port(), free_port(), free_port(), log, model_control="explicit",
                        load_models=[model], trace_file=tmp / "trace" / "trace.json", trace_rate=ttft_split.TRACE_RATE)


def served_llm_in_process_bench(repository: Path, results: Path, tmp: Path, hardware: str,
                                loads=LLM_8B_LOADS) -> None:
    """The served `llm` (built by `build_engines llm --random-init llama-3-8b` on a GPU) at 1, 16 and 64 streams,
    then the same engine, configuration and prompts in this process: what tritonserver, the python backend's IPC
    and gRPC streaming cost. Also the server's start-to-ready time beside the time to read the weights' files."""
    from transformers import AutoTokenizer

    from backends.llm.engine import EngineConfig, LLMEngine
    from backends.mm_llm.model import engine_stats
    from build_engines.repository import read_parameters

    folder = repository / "llm" / "1"
    read_s = read_files_s(sorted(folder.glob("*.safetensors")))
    start = time.perf_counter()
    with traced_server(repository, "llm", Path("logs/bench-llm-8b.log"), tmp) as server:
        ready_s = time.perf_counter() - start
        rows, notes = llm_streaming(server, "llm", folder, tmp, loads=loads, genai_loads=[])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    engine = LLMEngine(folder, EngineConfig.from_config(read_parameters(repository / "llm" / "config.pbtxt")))
    notes.append(f"In process: {engine.blocks.num_blocks} KV blocks of {engine.blocks.block_size} tokens.")
    in_process_tokens_per_s(engine, ["warm up"] * 4, 4, 8, 16)  # compiles the prefill kernels
    for row, (concurrency, input_tokens, output_tokens) in zip(list(rows), loads):
        spec = LoadSpec(concurrency, input_tokens, output_tokens, requests=max(16, 4 * concurrency))
        prompts = load_prompts(tokenizer, spec)[concurrency:]  # the served load's measured requests' prompts
        before, start = engine_stats(engine)[1], time.perf_counter()
        ours = in_process_tokens_per_s(engine, prompts, concurrency, output_tokens, spec.requests)
        notes.append(f"In process at concurrency {concurrency}: "
                     f"{engine_steps(before, engine_stats(engine)[1], time.perf_counter() - start)}.")
        rows.append(["llm", "in process", concurrency, input_tokens, output_tokens, spec.requests, *["-"] * 7, ours])
        print(f"c={concurrency}: served {row[13]:.1f}, in process {ours:.1f} tokens/s (served / in process "
              f"{row[13] / ours:.2f})", flush=True)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    write_llm_results(results, "llm-streaming-8b", rows, hardware, [
        f"`llm` built by `build_engines llm --random-init llama-3-8b --precision bf16 --device cuda` (Llama-3-8B "
        "shapes, random bf16 weights, the tiny byte-level tokenizer's vocabulary), served by tritonserver and "
        "driven by perf/llm.py over gRPC streaming; then the same checkpoint and engine parameters in process on the "
        "same prompts (a distinct one for each request: prefix caching finds nothing), with the same number of "
        "requests kept in flight (a new one added as one finishes). Every request asks for exactly `output tokens` "
        "(min_length = max_tokens) and counts as that many where it ended for length; in process, the tokens each "
        "generated.", *notes,
        f"Server start to ready (tritonserver, the python stub, the engine: weights, KV cache, CUDA graphs): "
        f"{ready_s:.1f} s; reading the {size / 2**30:.1f} GiB of weights' files alone: {read_s:.1f} s (just "
        "written, so likely from the page cache)."])
    print("LLM streaming (served 8B llm beside in process) written", flush=True)


def read_files_s(files: list[Path], chunk: int = 64 << 20) -> float:
    """Seconds to read `files` once, start to end."""
    start = time.perf_counter()
    buffer = bytearray(chunk)
    for file in files:
        with file.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def in_process_tokens_per_s(engine, prompts: list[str], concurrency: int, output_tokens: int, requests: int) -> float:
    """Output tokens per second of `requests` requests run by `engine` directly, `concurrency` kept in flight: the
    tokens each generated (its text re-tokenised counts more where it is not valid UTF-8, random weights')."""
    from backends.llm.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=output_tokens, min_tokens=output_tokens)
    queue = [prompts[i % len(prompts)] for i in range(requests)][::-1]
    running, tokens = [], 0
    start = time.perf_counter()
    while queue or running:
        while queue and len(running) < concurrency:
            running.append(engine.add(queue.pop(), sampling))
        engine.step()
        tokens += sum(len(s.output_ids) for s in running if s.finished)
        running = [s for s in running if not s.finished]
    return tokens / (time.perf_counter() - start)


VLM_LOADS = [(1, 32, 16), (16, 32, 16)]  # (concurrency, prompt text tokens, output tokens), one image per request


def preprocessing_ms(folder: Path, image: bytes, device: str, repeats: int = 5) -> dict[str, float]:
    """Median ms, in this process, of decoding and tiling `image` on the CPU (Pillow) and on `device`."""
    import statistics

    import torch

    from backends.media import device_images
    from backends.media.images import ImagePreprocessor, decode_image
    from backends.vision.anyres import image_processor_config, tiler_from_checkpoint

    tiler = tiler_from_checkpoint(folder)
    preprocess = ImagePreprocessor.from_dict(image_processor_config(folder))
    target = torch.device(device)
    nvjpeg = device_images.nvjpeg_available(target)

    def on_device():
        tiles, _ = device_images.anyres_tiles(tiler, device_images.decode_to_device(image, target, nvjpeg), preprocess)
        tiles.cpu() if target.type == "cpu" else torch.cuda.synchronize(target)

    out = {}
    for name, run in (("cpu", lambda: tiler.tiles(decode_image(image), preprocess)), ("device", on_device)):
        run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = statistics.median(times)
    out["nvjpeg"] = nvjpeg
    out["tokens"] = tiler.plan(*Image.open(io.BytesIO(image)).size[::-1]).num_image_tokens
    return out


def describe_llava(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    engine = json.loads((folder / "engine.json").read_text())
    vision, text = config["vision_config"], config["text_config"]
    out = (f"vision tower CLIP {vision['num_hidden_layers']} layers x {vision['hidden_size']}, {vision['image_size']} "
           f"px tiles; language model {text['model_type']} {text['num_hidden_layers']} layers x {text['hidden_size']} "
           f"({text['num_key_value_heads']} KV heads, MLP {text['intermediate_size']}); {engine['precision']}; weights "
           f"from {Path(engine['checkpoint']).name}")
    if text["vocab_size"] < 32000:
        out += (f" (random-init presets keep the byte-level test tokenizer: the embedding and LM head have "
                f"{text['vocab_size']} rows, not a real vocabulary's ~128k; prefill computes logits for the last "
                "token only, so TTFT moves by well under a millisecond)")
    return out


def image_input(jpeg: bytes) -> dict[str, np.ndarray]:
    return {"image": np.array([jpeg], dtype=object)}


def asked_twice(url: str, image: bytes, label: str, tokenizer, count, input_tokens: int, output_tokens: int,
                images: int = 4) -> tuple[list[list], str]:
    """`images` new files of `image`, each asked about twice in a row with two different prompts, one request at a
    time: rows of the first and of the second asks, and a note of their TTFT p50s."""
    prompts = make_prompts(2 * images, input_tokens, lambda t: tokenizer.encode(t, add_special_tokens=False),
                           tokenizer.decode, seed=7)
    asks = [(prompts[2 * k + again], image_input(with_comment(image, f"{label} twice {k}")))
            for k in range(images) for again in (0, 1)]
    timings = asyncio.run(one_by_one(url, "vlm", asks, output_tokens, {"min_length": output_tokens}))
    spec = LoadSpec(1, input_tokens, output_tokens, images)
    first, second = (summarize(t, count, output_tokens) for t in (timings[0::2], timings[1::2]))
    rows = [llm_row(f"{label}, a new image", "perf/llm.py, asked twice", spec, first),
            llm_row(f"{label}, the same image again", "perf/llm.py, asked twice", spec, second)]
    note = (f"{label}, the same image asked twice ({images} new files, each asked about twice in a row with "
            f"another prompt, one request at a time): TTFT p50 {first['ttft_ms_p50']:.1f} ms the first time, "
            f"{second['ttft_ms_p50']:.1f} ms the second ({second['ttft_ms_p50'] / first['ttft_ms_p50']:.0%}): "
            "the second finds the image's features and its prompt blocks up to the question cached.")
    return rows, note


def reload_with(client, model: str, config: dict, device: str, **parameters: str) -> None:
    """`model` again with these parameters over its config's. Unloaded first: Triton 2.51 aborts when a model with
    custom metrics is reloaded in place (the new instance registers the same metric families while the old one
    still holds them)."""
    client.unload_model(model)
    wait_unloaded(client, model, device)
    changed = {**config, "parameters": {**config["parameters"],
                                        **{key: {"string_value": value} for key, value in parameters.items()}}}
    client.load_model(model, config=json.dumps(changed))


def wait_unloaded(client, model: str, device: str, timeout_s: float = 120) -> None:
    """Until Triton reports the model unloaded and, on a GPU, its memory is back (the stub exits after that)."""
    import torch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {m["name"]: m.get("state") for m in client.get_model_repository_index(as_json=True)["models"]}
        free, total = torch.cuda.mem_get_info() if device == "cuda" else (1, 1)
        if states.get(model) == "UNAVAILABLE" and free > 0.8 * total:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{model} did not unload within {timeout_s:.0f} s")


def served_vlm_bench(repository: Path, results: Path, hardware: str, size: tuple[int, int] = (3840, 2160),
                     loads=VLM_LOADS) -> None:
    """Time to first token of the served `vlm` for one photo-sized JPEG per request, with the image prepared on the
    CPU (the model's default, pixel-exact with transformers) and on the model's device (`preprocess_on_device`);
    then the same image asked about twice (the second time from the image and prefix caches)."""
    import tritonclient.grpc as grpcclient
    from transformers import AutoTokenizer

    image = encoded_images([(*size, "JPEG")])[0]
    folder = repository / "vlm" / "1"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    rows, twice_notes, load_notes = [], [], []
    with TritonServer(repository, free_port(), free_port(), free_port(), Path("logs/bench-vlm.log"),
                      model_control="explicit", load_models=["vlm"]) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        config = client.get_model_config("vlm", as_json=True)["config"]
        device = served_device(config)
        times = preprocessing_ms(folder, image, device)
        for on_device in (False, True):
            if on_device:  # reload with the parameter flipped (unload first: one 8 B model in memory at a time)
                client.unload_model("vlm")
                wait_unloaded(client, "vlm", device)
                config["parameters"]["preprocess_on_device"] = {"string_value": "true"}
                client.load_model("vlm", config=json.dumps(config))
            label = f"vlm ({'on-device' if on_device else 'CPU'} preprocessing)"
            for concurrency, input_tokens, output_tokens in loads:
                spec = LoadSpec(concurrency, input_tokens, output_tokens, requests=max(16, 4 * concurrency))
                tag = f"{label} c{concurrency}"
                before, start = model_metrics(server.metrics_url, "vlm"), time.perf_counter()
                timings = asyncio.run(run_load(server.grpc_url, "vlm", load_prompts(tokenizer, spec), spec,
                                               {"min_length": output_tokens},
                                               lambda i: image_input(with_comment(image, f"{tag} request {i}"))))
                wall_s = time.perf_counter() - start
                rows.append(llm_row(label, "perf/llm.py", spec, summarize(timings, count, spec.output_tokens)))
                time.sleep(0.5)  # the engine loop observes a request's timings after its final response
                if note := server_side(before, model_metrics(server.metrics_url, "vlm"), wall_s):
                    load_notes.append(f"{label} at concurrency {concurrency}: {note}")
                print(" ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in rows[-1]), flush=True)
            twice_rows, note = asked_twice(server.grpc_url, image, label, tokenizer, count, *loads[0][1:])
            rows += twice_rows
            twice_notes.append(note)
    notes = [
        f"Every request: one {size[0]}x{size[1]} JPEG ({len(image) / 1e6:.1f} MB, quality 90, photo-like) and a "
        f"prompt of `input tokens` text tokens; the image adds {times['tokens']} visual tokens (AnyRes over the "
        "checkpoint's grid, unpadded, row newlines); every request generates exactly `output tokens` (min_length). "
        "Each request's file differs by a JPEG comment (perf.inputs.with_comment; the same pixels), so neither the "
        "image feature cache nor the prefix cache, both keyed by the file's digest, knows it; each prompt differs "
        "too.", *load_notes, *twice_notes,
        f"Preparing this image in this process on the same host (median of 5): CPU path (Pillow decode + two "
        f"antialiased bicubic resizes from the full image + normalise) {times['cpu']:.1f} ms; on the model's device "
        f"({'nvJPEG' if times['nvjpeg'] else 'Pillow'} decode + torch resize) {times['device']:.1f} ms.",
        "The vision tower and the language model's prefill run in the engine loop; TTFT = request sent -> first "
        "token streamed back (perf/llm.py, genai-perf's definition).",
        f"Model: {describe_llava(folder)}.",
    ]
    write_llm_results(results, "vlm-ttft", rows, hardware, notes)
    print("VLM time to first token written", flush=True)
