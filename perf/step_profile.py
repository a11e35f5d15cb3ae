"""Where an LLM engine's decode step spends its time: torch.profiler over steps of a fixed number of running sequences,
the device's kernel time summed by kind (our Triton kernels, the library's GEMMs, compiled elementwise kernels, ...)
against the step's wall time. The difference is time the GPU waited for the host.

Used by `python -m perf.llm_engine --profile-rows 1 64`; CUDA graphs stay on (CUPTI records the kernels a graph
replays), so what is profiled is the step the engine runs. On the CPU the categories hold aten ops' self time.
"""
from __future__ import annotations

import re
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.llm.engine import LLMEngine
from backends.llm.sampling import SamplingParams

CATEGORIES = (  # first match wins; names of our kernels, then the library's
    ("GEMV (gemv.py)", r"_gemv_kernel|_prepare_kernel"),
    ("paged attention (paged_decode.py)", r"_partition_kernel"),
    ("rotary + cache write (rope_cache.py)", r"_rope_write_kernel"),
    ("attention, library (SDPA, flash)", r"flash|fmha|attention"),
    ("convolution, FFT (cuDNN, cuFFT)", r"conv|fprop|cudnn|fft"),
    ("FP8 GEMM (fp8_gemm.py)", r"_fp8_weight_gemm_kernel"),
    ("LoRA (lora_kernels.py)", r"_shrink_kernel|_expand_kernel"),
    ("library GEMM (cuBLAS, CUTLASS)", r"gemm|cutlass|nvjet|xmma|cublas|splitk|aten::(mm|addmm|bmm|_scaled_mm)$"),
    ("compiled elementwise (torch.compile)", r"^triton_"),
    ("copies and fills", r"memcpy|memset|copy|fill"),
    ("normalisation, softmax (aten)", r"norm|softmax"),
    ("elementwise (aten)", r"elementwise|reduce"),
    ("other", r""),
)

GAP_US = 20.0  # a gap between kernels this long is the GPU waiting (for the host), not a launch's latency


@dataclass
class StepProfile:
    rows: int
    steps: int
    wall_ms: float  # a step, profiler on
    busy_ms: dict[str, float] = field(default_factory=dict)  # a step's device (CPU: op) time by category
    top: list[tuple[str, float]] = field(default_factory=list)  # the costliest kernels, ms a step
    host_top: list[tuple[str, float]] = field(default_factory=list)  # on a GPU: the host's costliest ops, ms a step
    device_busy_ms: float | None = None  # on a GPU: a step's time with any kernel running (overlapping ones once)
    idle_gaps: tuple[int, float] = (0, 0.0)  # on a GPU: gaps of >= GAP_US between kernels, per step: count, ms
    host_syncs: list[tuple[str, float | None]] = field(default_factory=list)  # on a GPU: where the host waits for
    # the device, ms a step (None: counted only; `sync_sites`)

    @property
    def total_ms(self) -> float:
        return sum(self.busy_ms.values())


def category(name: str) -> str:
    return next(label for label, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE))


def profile_decode(engine: LLMEngine, rows: int, steps: int = 20, prompt_tokens: int = 128) -> StepProfile:
    """Start `rows` sequences, run until all decode, then profile `steps` decode steps of all of them (each sequence
    has tokens left for all of them); the sequences run to their end afterwards."""
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(7)
    vocab = engine.model.args.vocab_size
    sync_steps = 4
    tokens = steps + sync_steps + 4
    seqs = [engine.add(prompt, SamplingParams(max_tokens=tokens, min_tokens=tokens))
            for prompt in torch.randint(100, vocab - 10, (rows, prompt_tokens), generator=generator).tolist()]
    while any(len(s.output_ids) < 2 for s in seqs):  # prefills, then one decode step of all
        engine.step()
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = (lambda: torch.cuda.synchronize(engine.device)) if cuda else (lambda: None)
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        wall = time.perf_counter() - start
    if cuda:
        found_syncs = sync_sites(engine, sync_steps)
    while engine.has_work:
        engine.step()
    found = summarise(prof, cuda, rows, steps, wall)
    if cuda:
        found.host_syncs = found_syncs
    return found


def summarise(prof, cuda: bool, rows: int, steps: int, wall: float) -> StepProfile:
    """A torch.profiler recording of `steps` repeats of one unit of work (`wall` seconds in all) as a StepProfile:
    per repeat, the device's kernel time by category (on the CPU: aten ops' self time), the costliest kernels and
    host ops, and how long some kernel ran."""
    per_kernel: Counter[str] = Counter()
    on_host: Counter[str] = Counter()
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.key] += event.device_time_total if hasattr(event, "device_time_total") \
                else event.cuda_time_total
        elif cuda:
            on_host[event.key] += event.self_cpu_time_total
        elif event.key.startswith("aten::"):
            per_kernel[event.key] += event.self_cpu_time_total
    found = StepProfile(rows, steps, 1e3 * wall / steps)
    for name, us in per_kernel.items():
        label = category(name)
        found.busy_ms[label] = found.busy_ms.get(label, 0.0) + us / 1e3 / steps
    found.top = [(name, us / 1e3 / steps) for name, us in per_kernel.most_common(8)]
    found.host_top = [(name, us / 1e3 / steps) for name, us in on_host.most_common(8)]
    if cuda:
        spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA]
        busy, gaps = device_timeline(spans)
        found.device_busy_ms = busy / 1e3 / steps
        found.idle_gaps = (round(len(gaps) / steps), sum(gaps) / 1e3 / steps)
    return found


def sync_sites(engine: LLMEngine, steps: int) -> list[tuple[str, float | None]]:
    """Where the host waits for the device in a decode step, with ms a step: each cuda*Synchronize call the
    profiler records, by the ops around it (a torch.cuda.synchronize has none; the profiler's start waits so for
    a step launched ahead), and where the engine's code makes an op wait for the whole stream (a copy from or to
    pageable memory, `.item()`, `.tolist()` of a device tensor: torch's sync debug mode warns at each; `x`: how often
    a step). A step launched ahead is waited for too at a stream or device sync; the design waits on events only."""
    from torch.profiler import ProfilerActivity, profile

    warned: Counter[str] = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        frames = [f"{f.filename.split('backends/')[-1]}({f.lineno}): {f.name}" for f in traceback.extract_stack()[:-1]
                  if "/backends/" in f.filename]
        warned["; ".join(frames[-3:]) or f"{Path(filename).name}:{lineno}"] += 1

    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waited: Counter[str] = Counter()
    for event in prof.events():
        if not re.fullmatch(r"cuda\w*Synchronize", event.name):
            continue
        chain, parent = [], event.cpu_parent  # the ops around it, innermost first
        while parent is not None and len(chain) < 3:
            chain.append(parent.name)
            parent = parent.cpu_parent
        waited[f"{event.name} in {' < '.join(chain) or 'no op'}"] += event.cpu_time_total
    return ([(site, us / 1e3 / steps) for site, us in waited.most_common(6)]
            + [(f"stream-wide wait, x{n / steps:g}: {site}", None) for site, n in warned.most_common(4)])


def device_timeline(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """(time covered by the kernels' [start, end] spans, the gaps of >= GAP_US between them), in us."""
    busy, gaps, end = 0.0, [], None
    for start, stop in sorted(spans):
        if end is not None and start - end >= GAP_US:
            gaps.append(start - end)
        if end is None or start > end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = stop if end is None else max(end, stop)
    return busy, gaps


def describe(found: StepProfile, work: str | None = None, per: str = "a step") -> str:
    """One line for a results table's notes: `work` says what was profiled (decode steps by default), `per` what
    the figures are per; where the host waited is told for decode steps only (`sync_sites`)."""
    parts = ", ".join(f"{label} {ms:.3f}" for label, ms in sorted(found.busy_ms.items(), key=lambda kv: -kv[1]))
    top = "; ".join(f"{name[:60]} {ms:.3f}" for name, ms in found.top)
    host = "; ".join(f"{name[:60]} {ms:.3f}" for name, ms in found.host_top)
    timeline = "" if found.device_busy_ms is None else (
        f"; some kernel running {found.device_busy_ms:.2f} ms {per}, {found.idle_gaps[0]} gaps of >= {GAP_US:.0f} us "
        f"between kernels {per}, {found.idle_gaps[1]:.3f} ms")
    syncs = "" if found.device_busy_ms is None or work else f"; where the host waits, ms {per}: " + (
        "; ".join(site + ("" if ms is None else f" {ms:.3f}") for site, ms in found.host_syncs) or "none")
    return (f"{work or f'decode steps of {found.rows} rows'} under the profiler: {found.wall_ms:.2f} ms {per}, kernels "
            f"{found.total_ms:.2f} ms ({parts}){timeline}; costliest kernels, ms {per}: {top}"
            + (f"; the host's costliest ops (self time), ms {per}: {host}" if host else "")
            + syncs)
