"""PNG plots of a run (accuracy, loss, collaboration matrix) and of a comparison.

matplotlib with the non-interactive Agg backend; every function writes one file.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _pyplot():
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    return plt


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _save_round_plot(plt, fig, ax, path: str) -> None:
    """Integer round ticks, grid, legend; writes the figure to `path` and closes it."""
    _integer_rounds(ax)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    ax.plot(xw, worst, linestyle="--", label="worst 10% of clients")
    ax.set(xlabel="round", ylabel="test accuracy", title=title)
    _save_round_plot(plt, fig, ax, path)


def plot_loss(rows: Sequence[dict], path: str, title: str = "") -> None:
    """Train loss (mean over participants) and test loss per evaluated round."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("train_loss", "train loss"), ("mean_loss", "test loss")):
        x, y = _column(rows, key)
        ax.plot(x, y, marker=".", label=label)
    ax.set(xlabel="round", ylabel="loss", title=title)
    _save_round_plot(plt, fig, ax, path)


def plot_matrix(matrix, path: str, title: str = "collaboration matrix") -> None:
    """Heatmap of a [C, C] matrix (row c: how much client c learns from each client)."""
    plt = _pyplot()
    m = np.asarray(matrix, np.float64)
    fig, ax = plt.subplots(figsize=(5, 4.2))
    im = ax.imshow(m, cmap="viridis", vmin=0.0)
    fig.colorbar(im, ax=ax)
    ax.set(xlabel="learns from client", ylabel="client", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_overlay(curves: dict[str, tuple], path: str, title: str = "") -> None:
    """Overlaid accuracy curves: {label: (rounds [R], mean [R], std [R] or None)}."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, (x, mean, std) in curves.items():
        (line,) = ax.plot(x, mean, label=label)
        if std is not None:
            ax.fill_between(x, mean - std, mean + std, alpha=0.15, color=line.get_color())
    ax.set(xlabel="round", ylabel="mean test accuracy", title=title)
    _save_round_plot(plt, fig, ax, path)
