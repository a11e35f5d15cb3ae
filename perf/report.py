"""Result files: perf/results/<host>/<date>-<scenario>.{csv,md,png}, each headed by a hardware line."""
from __future__ import annotations

import csv
import datetime
import platform
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


def stem(folder: Path, scenario: str) -> Path:
    """perf/results/<host>/<date>-<scenario> (without suffix); `folder` is the host's results folder."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{datetime.date.today().isoformat()}-{scenario}"


def write_sweep(root: Path, scenario: str, load_name: str, points: list[LoadPoint], hardware: str,
                notes: list[str] = ()) -> Path:
    """CSV + markdown table + throughput-vs-p99 plot for one sweep. Returns the markdown path."""
    base = stem(root, scenario)
    with base.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, [x.name for x in fields(LoadPoint)])
        writer.writeheader()
        writer.writerows(asdict(p) for p in points)
    gpu = any(p.gpu_util is not None for p in points)
    lines = [f"# {scenario}", "", f"Hardware: {hardware}", "",
             f"| {load_name} | infer/s | p50 ms | p90 ms | p99 ms | queue ms | compute input ms | compute infer ms "
             "| compute output ms |" + (" GPU util % |" if gpu else ""), "|---|---|---|---|---|---|---|---|---|"
             + ("---|" if gpu else "")]
    for p in points:
        lines.append(f"| {p.load:g} | {p.throughput:.1f} | {p.p50_us / 1e3:.1f} | {p.p90_us / 1e3:.1f} | "
                     f"{p.p99_us / 1e3:.1f} | {p.server_queue_us / 1e3:.2f} | {p.server_compute_input_us / 1e3:.2f} | "
                     f"{p.server_compute_infer_us / 1e3:.2f} | {p.server_compute_output_us / 1e3:.2f} |"
                     + (f" {'-' if p.gpu_util is None else f'{100 * p.gpu_util:.0f}'} |" if gpu else ""))
    lines += ["", *notes, "", f"![throughput vs p99 latency]({base.name}.png)", ""]
    base.with_suffix(".md").write_text("\n".join(lines))
    plot(base.with_suffix(".png"), scenario, load_name, points)
    return base.with_suffix(".md")


def plot(path: Path, title: str, load_name: str, points: list[LoadPoint]) -> None:
    series = {title: [(p.p99_us / 1e3, p.throughput, f"{load_name[:4]} {p.load:g}") for p in points]}
    plot_curves(path, title, "p99 latency (ms)", "throughput (infer/s)", series)


def plot_curves(path: Path, title: str, xlabel: str, ylabel: str,
                series: dict[str, list[tuple[float, float, str]]]) -> None:
    """Throughput-vs-latency curves: one line per series of (x, y, point label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", label=name)
        for x, y, label in points:
            ax.annotate(label, (x, y), fontsize=7, textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_table(root: Path, scenario: str, header: list[str], rows: list[list], hardware: str,
                notes: list[str] = (), figure: str | None = None) -> Path:
    """A plain markdown (and CSV) table, for studies that are not one sweep; `figure` names a png beside it."""
    base = stem(root, scenario)
    if figure:
        notes = [*notes, "", f"![{scenario}]({figure})"]
    with base.with_suffix(".csv").open("w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = [f"# {scenario}", "", f"Hardware: {hardware}", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |" for row in rows]
    base.with_suffix(".md").write_text("\n".join([*lines, "", *notes, ""]))
    return base.with_suffix(".md")


def bench_arguments(parser, interval_ms: int, concurrency=(1, 4, 16)):
    """The options every served-model benchmark takes: repository, results folder, host name, load levels."""
    import socket

    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--results", type=Path, default=Path("perf/results"))
    parser.add_argument("--host", default=socket.gethostname())
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(concurrency))
    parser.add_argument("--interval-ms", type=int, default=interval_ms, help="perf_analyzer measurement window")
    return parser
