"""PNG plots (matplotlib, Agg: no display needed): throughput vs concurrency, TTFT and ITL CDFs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend
import numpy as np


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms, dtype=np.float64))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post")


def cdf_plot(series: dict[str, Sequence[float]], metric: str, title: str, path: Path) -> Path:
    """One CDF line per run (label -> values in ms)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in series.items():
        _cdf(ax, values, label)
    ax.set_xlabel(f"{metric} (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.01)
    positive = [v for values in series.values() for v in values if v > 0]
    if positive and max(positive) / min(positive) > 100:
        ax.set_xscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep_plot(rows: list[dict[str, Any]], title: str, path: Path, offline_tps: float | None = None) -> Path:
    """Output tok/s against max concurrency, with TTFT p50 on a second axis."""
    levels = [row["max_concurrency"] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(levels, [row["output_throughput"] for row in rows], "o-", label="served output tok/s")
    if offline_tps is not None:
        ax.axhline(offline_tps, color="gray", linestyle="--", label="offline engine (all prompts at once)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels])
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s")
    ax.grid(True, alpha=0.3)
    latency = ax.twinx()
    latency.plot(levels, [row["ttft_ms"]["p50"] for row in rows], "s--", color="tab:red", label="TTFT p50 (ms)")
    latency.set_ylabel("TTFT p50 (ms)", color="tab:red")
    lines = ax.get_legend_handles_labels()
    more = latency.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="best")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
