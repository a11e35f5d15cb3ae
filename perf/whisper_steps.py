"""Where the continuous-batched Whisper engine spends its time, in one process: one decoder step at 1..64 rows (the
engine's fused step, and again unfused: backends.whisper.decoder) and clips joining (features + encoder +
cross-attention keys/values) 1, 4 or 16 at a time, each op by op and from CUDA graphs (with the rate of the
encoder's arithmetic, and under torch.profiler: kernel time by kind), again with transformers' WhisperEncoder.forward
in place of the engine's fused encoder, and the engine's loop with every slot busy split into joins, decoder steps
and the rest (host work between steps).
Milliseconds, the device synchronised after each part (so in the loop the encoders of joining clips do not overlap
the decoder steps as they do in the engine's own loop: see `whole step, unsynchronised`).

    python -m perf.whisper_steps --version-dir model_repository/whisper/1 [--dtype fp16] [--results perf/results]
"""
from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import numpy as np
import torch

from backends.whisper.decoder import SlotDecoder
from backends.whisper.engine import Clip, WhisperEngine
from perf.encoder_stages import timed
from perf.report import hardware_line, write_table
from perf.step_profile import StepProfile, describe, summarise
from perf.whisper_bench import CLIPS

ROWS = (1, 8, 16, 32, 64)


class Timer:
    """Wraps a callable: the time spent in it (the device synchronised on return)."""

    def __init__(self, fn):
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.fn(*args)
        torch.cuda.synchronize()
        self.seconds, self.calls = self.seconds + time.perf_counter() - start, self.calls + 1
        return out


def loop_shares(engine: WhisperEngine, steps: int) -> dict[str, float]:
    """A closed loop keeping every slot busy (the bench's clips, a finished clip replaced by the next): ms per
    decoder step of joins, steps and the rest."""
    rng = np.random.default_rng(0)
    cycle = itertools.cycle([(rng.normal(0, 0.1, int(16000 * seconds)).astype(np.float32), tokens)
                             for seconds, tokens in CLIPS])

    def add() -> None:
        audio, tokens = next(cycle)
        engine.add(Clip(audio, "en", "transcribe", tokens))
    for _ in range(len(engine.running)):
        add()

    def run() -> tuple[float, float]:
        """(seconds, tokens fed) of `steps` steps."""
        start, before = time.perf_counter(), engine.fed
        for _ in range(steps):
            for _ in engine.step():
                add()
        torch.cuda.synchronize()
        return time.perf_counter() - start, engine.fed - before

    for _ in range(steps // 4):  # warm-up: the slots fill and the first clips finish
        for _ in engine.step():
            add()
    overlapped, overlapped_fed = run()
    join, step = Timer(engine._join), Timer(engine.decoder.step)
    engine._join, engine.decoder.step = join, step
    total, fed = run()
    return {"joins": 1e3 * join.seconds / steps, "decoder steps": 1e3 * step.seconds / steps,
            "host, the rest": 1e3 * (total - join.seconds - step.seconds) / steps, "whole step": 1e3 * total / steps,
            "mean rows": fed / steps, "tokens/s": fed / total,
            "whole step, unsynchronised": 1e3 * overlapped / steps,
            "tokens/s, unsynchronised": overlapped_fed / overlapped}


def join_flops(config) -> float:
    """Floating-point operations of one clip's join: the two input convolutions, the encoder's layers (projections,
    MLP, attention over all frames) and the decoder's cross-attention keys and values."""
    frames, d, mlp = config.max_source_positions, config.d_model, config.encoder_ffn_dim
    convs = 2 * frames * 3 * d * config.num_mel_bins + frames * 3 * d * d  # conv1 over 2x the frames, conv2
    layer = frames * (4 * d * d + 2 * d * mlp + 2 * frames * d)  # multiply-adds of one encoder layer
    cross = frames * 2 * d * d * config.decoder_layers
    return 2.0 * (convs + config.encoder_layers * layer + cross)


def profile_join(engine: WhisperEngine, join, clips: int, repeats: int = 5) -> StepProfile:
    """torch.profiler over `repeats` calls of `join` (clips joining and cleared again), after one warm-up."""
    from torch.profiler import ProfilerActivity, profile

    join()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            join()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return summarise(prof, True, clips, repeats, wall)


def join_rows(engine: WhisperEngine, audio: list[np.ndarray], label: str, flops: float, repeats: int,
              profile_sizes: list[int]) -> tuple[list[list], list[str]]:
    """Rows timing joins of 1, 4 and 16 clips op by op and from CUDA graphs (ms, and TFLOP/s at the faster), and
    the profiles of the joins of `profile_sizes` clips."""
    graphs, rows, profiles = engine.join_graphs, [], []
    for clips in (1, 4, 16):
        def join() -> None:
            for a in audio[:clips]:
                engine.add(Clip(a, "en", "transcribe", 1))
            engine._join()
            engine.clear()
        engine.join_graphs = None
        op_by_op, _ = timed(join, max(3, repeats // 4))
        engine.join_graphs = graphs
        graphed = timed(join, max(3, repeats // 4))[0] if graphs is not None else "-"
        fastest = op_by_op if graphed == "-" else min(op_by_op, graphed)
        rows += [[f"{clips} clips join (features, encoder, cross K/V){label}", op_by_op, graphed],
                 [f"{clips} clips join{label}: TFLOP/s", "-", clips * flops / fastest / 1e9]]
        if clips in profile_sizes:
            profiles.append(describe(profile_join(engine, join, clips), f"joins of {clips} clips{label} "
                                     f"({'CUDA graphs' if graphs is not None else 'op by op'})", "a join"))
    return rows, profiles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version-dir", type=Path, required=True, help="the whisper engine's version folder")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--loop-steps", type=int, default=400)
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default="gpu")
    parser.add_argument("--profile-joins", type=int, nargs="*", default=[1, 16],
                        help="joins of these many clips (from CUDA graphs) under torch.profiler, in the notes")
    args = parser.parse_args(argv)
    engine = WhisperEngine(args.version_dir, args.dtype, "cuda", slots=max(ROWS))
    eager = SlotDecoder(engine.model, max(ROWS), graphs=False)
    frames, width = engine.model.config.max_source_positions, engine.model.config.d_model
    encoded = torch.randn(max(ROWS), frames, width, dtype=engine.dtype, device=engine.device)
    every_slot = torch.arange(max(ROWS), device=engine.device)
    engine.decoder.join(every_slot, encoded)
    eager.join(every_slot, encoded)
    # at position 40 self-attention spans the cache's first 64 entries; at 400, all 448 (SlotDecoder.spans)
    steps = [*((rows, 40) for rows in ROWS), (max(ROWS), 400)]

    def step_ms(decoder: SlotDecoder) -> list[float]:
        return [timed(lambda: decoder.step([engine.sot] * rows, [position] * rows), args.repeats)[0]
                for rows, position in steps]
    op_by_op = step_ms(eager)
    del eager  # its caches (20 GB at large-v3's shapes) make room for the unfused decoder's
    # the step as it was before `fused`: three q/k/v projections, each residual add and LayerNorm a kernel
    unfused = SlotDecoder(engine.model, max(ROWS), graphs=True, fused=False)
    unfused.join(every_slot, encoded)
    unfused_ms = step_ms(unfused)
    del unfused
    labels = [f"decoder step, {rows} rows at position {position}" for rows, position in steps]
    table = [[label, eager_ms, graphed_ms] for label, eager_ms, graphed_ms in zip(labels, op_by_op,
                                                                                 step_ms(engine.decoder))]
    table += [[f"{label}, unfused", "-", ms] for label, ms in zip(labels, unfused_ms)]
    audio = [np.random.default_rng(i).normal(0, 0.1, 16000 * 28).astype(np.float32) for i in range(16)]
    flops = join_flops(engine.model.config)
    rows, profiles = join_rows(engine, audio, "", flops, args.repeats, args.profile_joins)
    table += rows
    # the same joins with transformers' WhisperEncoder.forward, side by side (16 slots: room for the largest join)
    plain = WhisperEngine(args.version_dir, args.dtype, "cuda", slots=16, fused_encoder=False)
    table += join_rows(plain, audio, ", transformers' encoder", flops, args.repeats, [])[0]
    del plain
    shares = loop_shares(engine, args.loop_steps)
    table += [[f"loop with {max(ROWS)} clips in flight: {name}", "-", value] for name, value in shares.items()]
    notes = [f"Engine: {args.version_dir} in {args.dtype}; decoder steps over all {max(ROWS)} slots' caches with "
             "random encoder states (the engine's fused step unless the row says unfused); joins of 28 s clips; "
             "the loop keeps every slot busy with the bench's clips (perf.whisper_bench.CLIPS) and splits each "
             "step's time (ms per step; `mean rows`: clips per step; `tokens/s`: tokens fed per second).",
             f"A clip's join is {flops / 1e12:.2f} TFLOP (convolutions, encoder layers with attention over all "
             "frames, cross-attention keys and values); `TFLOP/s`: that over the faster join time. Joins use the "
             "engine's fused encoder (backends/whisper/encoder.py) unless the row says transformers' encoder.",
             *profiles]
    print(write_table(args.results / args.host, "whisper-steps", ["part", "op by op ms", "CUDA graphs ms"], table,
                      hardware_line("-"), notes), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
