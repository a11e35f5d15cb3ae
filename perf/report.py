"""Result files: perf/results/<host>/<date>-<scenario>.{csv,md,png}, each headed by a hardware line."""
from __future__ import annotations

import csv
import datetime
import platform
import socket
from dataclasses import asdict, fields
from pathlib import Path

from perf.analyzer import LoadPoint


def hardware_line(server_version: str = "?") -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "?")
    import os

    import torch

    gpu = "no GPU"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}"
    return (f"CPU {cpu} x{os.cpu_count()}; {gpu}; torch {torch.__version__}; tritonserver {server_version}; "
            f"Python {platform.python_version()}")


def results_dir(root: Path) -> Path:
    folder = root / socket.gethostname()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def stem(root: Path, scenario: str) -> Path:
    return results_dir(root) / f"{datetime.date.today().isoformat()}-{scenario}"


def write_sweep(root: Path, scenario: str, load_name: str, points: list[LoadPoint], hardware: str,
                notes: list[str] = ()) -> Path:
    """CSV + markdown table + throughput-vs-p99 plot for one sweep. Returns the markdown path."""
    base = stem(root, scenario)
    with base.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, [x.name for x in fields(LoadPoint)])
        writer.writeheader()
        writer.writerows(asdict(p) for p in points)
    lines = [f"# {scenario}", "", f"Hardware: {hardware}", "",
             f"| {load_name} | infer/s | p50 ms | p90 ms | p99 ms | queue ms | compute input ms | compute infer ms "
             "| compute output ms |", "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.load:g} | {p.throughput:.1f} | {p.p50_us / 1e3:.1f} | {p.p90_us / 1e3:.1f} | "
                     f"{p.p99_us / 1e3:.1f} | {p.server_queue_us / 1e3:.2f} | {p.server_compute_input_us / 1e3:.2f} | "
                     f"{p.server_compute_infer_us / 1e3:.2f} | {p.server_compute_output_us / 1e3:.2f} |")
    lines += ["", *notes, "", f"![throughput vs p99 latency]({base.name}.png)", ""]
    base.with_suffix(".md").write_text("\n".join(lines))
    plot(base.with_suffix(".png"), scenario, load_name, points)
    return base.with_suffix(".md")


def plot(path: Path, title: str, load_name: str, points: list[LoadPoint]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.p99_us / 1e3 for p in points], [p.throughput for p in points], marker="o")
    for p in points:
        ax.annotate(f"{load_name[:4]} {p.load:g}", (p.p99_us / 1e3, p.throughput), fontsize=7,
                    textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("throughput (infer/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_table(root: Path, scenario: str, header: list[str], rows: list[list], hardware: str,
                notes: list[str] = ()) -> Path:
    """A plain markdown (and CSV) table, for studies that are not one sweep."""
    base = stem(root, scenario)
    with base.with_suffix(".csv").open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = [f"# {scenario}", "", f"Hardware: {hardware}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    base.with_suffix(".md").write_text("\n".join([*lines, "", *notes, ""]))
    return base.with_suffix(".md")
