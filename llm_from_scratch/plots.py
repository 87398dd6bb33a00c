"""Every figure of the course, drawn with matplotlib and saved as PNG next to the run's metrics.

Functions take plain numbers and a path, return the figure (so a notebook shows it inline), and
never call `plt.show()`. They work headless: matplotlib falls back to its Agg backend when there is no display.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt


def moving_average(xs: Sequence[float], window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start): a noisy per-step curve, smoothed."""
    return [sum(xs[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(xs))]


def save(fig, path: str | os.PathLike | None):
    """Save `fig` as a PNG at `path` (folders made as needed) and close it for scripts; return it for notebooks."""
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return fig


def line_plot(
    x: Sequence[float],
    ys: dict[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str,
    path: str | os.PathLike | None = None,
    logx: bool = False,
    hlines: dict[str, float] | None = None,
):
    """One line per entry of `ys` against `x`; `hlines` draws labelled horizontal reference lines (e.g. a floor)."""
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, y in ys.items():
        ax.plot(x, y, marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    for label, value in (hlines or {}).items():
        ax.axhline(value, linestyle="--", color="gray", linewidth=1)
        ax.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(0, 4), fontsize=8, color="gray")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)


def merges_plot(tokens: Sequence[str], counts: Sequence[int], path: str | os.PathLike | None = None, title: str = ""):
    """The first BPE merges: each new token (spaces shown as '·') and how often its pair occurred."""
    fig, ax = plt.subplots(figsize=(6.4, max(3, 0.22 * len(tokens))))
    labels = [f"{i:>3}  {t!s}" for i, t in enumerate(tokens, start=256)]
    ax.barh(range(len(tokens)), counts, color="tab:blue")
    ax.set_yticks(range(len(tokens)), labels, fontfamily="monospace", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="pair count when merged", title=title or "The first BPE merges (rank, new token)")
    ax.grid(axis="x", alpha=0.3)
    return save(fig, path)


def loss_plot(records: Sequence[dict], path: str | os.PathLike | None = None, floor: float | None = None,
              title: str = "Pretraining loss"):
    """Train and validation loss (nats/token) against tokens seen, from metrics.jsonl records;
    `floor` draws the data's entropy floor, the loss no model can beat."""
    train = [(r["tokens"], r["loss/train"]) for r in records if "loss/train" in r]
    val = [(r["tokens"], r["loss/val"]) for r in records if "loss/val" in r]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    if train:
        ax.plot(*zip(*train), label="train", alpha=0.6, linewidth=1)
    if val:
        ax.plot(*zip(*val), label="validation", marker="o", markersize=3)
    if floor is not None:
        ax.axhline(floor, linestyle="--", color="black", linewidth=1, label=f"entropy floor {floor:.3f}")
    ax.set(xlabel="tokens seen", ylabel="loss (nats/token)", title=title)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    return save(fig, path)
