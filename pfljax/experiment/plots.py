"""PNG plots of a run (accuracy, loss, collaboration matrix, label distribution)
and of a comparison.

matplotlib with the non-interactive Agg backend; every function writes one file.
Legends sit below the axes, so they never cover a curve; long titles wrap.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Sequence

import numpy as np


def _pyplot():
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    return plt


def _title(ax, title: str, width: int = 60) -> None:
    ax.set_title("\n".join(textwrap.wrap(title, width)) if title else "", fontsize=10)


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _legend_below(ax, ncol: int = 2) -> None:
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, fontsize=9, frameon=False)


def _save(plt, fig, path: str) -> None:
    """Writes the figure to `path` atomically (a temporary file, then rename) and closes it."""
    tmp = f"{path}.tmp"
    fig.savefig(tmp, dpi=100, bbox_inches="tight", format=os.path.splitext(path)[1][1:] or "png")
    os.replace(tmp, path)
    plt.close(fig)


def _save_round_plot(plt, fig, ax, path: str, ncol: int = 2) -> None:
    """Integer round ticks, grid, legend below the axes; writes the figure to `path` and closes it."""
    _integer_rounds(ax)
    ax.grid(alpha=0.3)
    _legend_below(ax, ncol)
    _save(plt, fig, path)


def _column(rows: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
    if not pairs:
        return np.zeros(0), np.zeros(0)
    x, y = zip(*pairs)
    return np.asarray(x), np.asarray(y, np.float64)


def plot_accuracy(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Mean (+- std across clients) and worst-10% test accuracy per evaluated round."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x, mean = _column(rows, "mean_accuracy")
    _, std = _column(rows, "std_accuracy")
    ax.plot(x, mean, marker=".", label="mean (weighted by test size)")
    if len(std) == len(mean):
        ax.fill_between(x, mean - std, mean + std, alpha=0.2, label="+- std across clients")
    xw, worst = _column(rows, "worst10_accuracy")
    ax.plot(xw, worst, linestyle="--", marker=".", label="worst 10% of clients")
    ax.set(xlabel="round", ylabel="test accuracy")
    _title(ax, title)
    _save_round_plot(plt, fig, ax, path, ncol=3)


def plot_loss(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Train loss (mean over participants) and test loss per evaluated round."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("train_loss", "train loss (participants)"), ("mean_loss", "test loss")):
        x, y = _column(rows, key)
        ax.plot(x, y, marker=".", label=label)
    ax.set(xlabel="round", ylabel="loss")
    _title(ax, title)
    _save_round_plot(plt, fig, ax, path)


def plot_matrix(matrix, path: str, title: str = "collaboration matrix") -> None:
    """Heatmap of a [C, C] matrix (row c: how much client c learns from each client)."""
    plt = _pyplot()
    m = np.asarray(matrix, np.float64)
    fig, ax = plt.subplots(figsize=(5.5, 4.6))
    finite = m[np.isfinite(m)]
    im = ax.imshow(m, cmap="viridis", vmin=0.0, vmax=float(finite.max()) if finite.size else 1.0)
    fig.colorbar(im, ax=ax, label="weight of client j in client i's model")
    ax.set(xlabel="learns from client j", ylabel="client i")
    _title(ax, title, 50)
    _save(plt, fig, path)


def class_counts(summary: dict, split: str = "train") -> np.ndarray:
    """[C, K] per-client per-class sample counts of a data summary (data.json)."""
    key = f"{split}_class_counts"
    return np.asarray([c[key] for c in summary["clients"]], np.int64)


def plot_partition(summary: dict, path: str, title: str = "") -> bool:
    """Label distribution of a partition (data.json): a clients x classes heatmap
    of train sample counts (numbers in the cells when they fit) beside each
    client's train / test sizes (for a sequence task: tokens of each class, sequences
    per client). Writes nothing for regression data (no classes); returns whether it
    wrote the file."""
    if not summary["clients"] or "train_class_counts" not in summary["clients"][0]:
        return False
    counts = class_counts(summary, "train")
    if counts.ndim != 2 or counts.shape[1] == 0:
        return False
    num_clients, num_classes = counts.shape
    train = np.asarray([c["train"] for c in summary["clients"]])
    test = np.asarray([c["test"] for c in summary["clients"]])
    cells, rows = ("tokens", "sequences") if summary.get("task") == "sequence" else ("samples", "samples")
    plt = _pyplot()
    height = min(max(3.2, 0.28 * num_clients + 1.6), 14.0)
    width = min(max(6.5, 0.45 * num_classes + 4.5), 24.0)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(width, height), gridspec_kw={"width_ratios": [3, 1]})
    im = ax.imshow(counts, cmap="Blues", aspect="auto", interpolation="nearest", vmin=0)
    fig.colorbar(im, ax=ax, label=f"train {cells} of the class", shrink=min(1.0, 5.0 / height))
    if num_clients * num_classes <= 400 and num_classes <= 40:
        top = max(int(counts.max()), 1)
        for c in range(num_clients):
            for k in range(num_classes):
                if counts[c, k]:
                    color = "white" if counts[c, k] > 0.6 * top else "black"
                    ax.text(k, c, str(counts[c, k]), ha="center", va="center", fontsize=7, color=color)
    ax.set(xlabel="class (label the model sees)", ylabel="client")
    if num_classes <= 30:
        ax.set_xticks(range(num_classes))
    if num_clients <= 40:
        ax.set_yticks(range(num_clients))
    _title(ax, f"label distribution: {title}" if title else "label distribution", 55)
    y = np.arange(num_clients)
    bx.barh(y, train, color="tab:blue", label="train")
    bx.barh(y, test, left=train, color="tab:orange", label="test")
    bx.set_ylim(num_clients - 0.5, -0.5)
    bx.set(xlabel=f"{rows} per client", yticks=[])
    bx.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=9, frameon=False)
    _save(plt, fig, path)
    return True


def plot_overlay(
    curves: dict[str, tuple], path: str, title: str = "", ylabel: str = "mean test accuracy"
) -> None:
    """Overlaid curves: {label: (rounds [R], mean [R], std [R] or None)}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, (x, mean, std) in curves.items():
        if len(x) == 0:  # e.g. diverged before its first evaluation: in the legend, no curve
            ax.plot([], [], marker="x", linestyle="none", label=label)
            continue
        (line,) = ax.plot(x, mean, marker=".", label=label)
        if std is not None:
            ax.fill_between(x, mean - std, mean + std, alpha=0.15, color=line.get_color())
    ax.set(xlabel="round", ylabel=ylabel)
    _title(ax, title)
    _save_round_plot(plt, fig, ax, path, ncol=min(4, max(1, len(curves))))


def plot_overlay_losses(train: dict[str, tuple], test: dict[str, tuple], path: str, title: str = "") -> None:
    """Train and test loss of several algorithms, side by side (same curve format as plot_overlay)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, curves, name in ((axes[0], train, "train loss (participants)"), (axes[1], test, "test loss")):
        for label, (x, mean, std) in curves.items():
            if len(x) == 0:
                ax.plot([], [], marker="x", linestyle="none", label=label)
                continue
            (line,) = ax.plot(x, mean, marker=".", label=label)
            if std is not None:
                ax.fill_between(x, mean - std, mean + std, alpha=0.15, color=line.get_color())
        ax.set(xlabel="round", ylabel=name)
        _integer_rounds(ax)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    _save(plt, fig, path)
