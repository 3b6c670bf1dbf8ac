"""Plots of logged training metrics (TRL's `log_history` rows), one panel per metric, x = optimizer step."""

from __future__ import annotations

from pathlib import Path


# Metrics drawn by `plot_metrics`, in panel order; a key no run logged is left out.
PLOT_KEYS = ("reward", "ratio/new_old/oob_rate", "ratio/old_sampler/oob_rate", "ratio/clip_flip_rate")


def plot_metrics(histories: dict[str, list[dict]], path: str | Path, keys=PLOT_KEYS) -> list[str]:
    """Draw one PNG with a panel per metric key that any history logged, one line per run, x = optimizer step.

    Args:
        histories: run label -> `trainer.state.log_history` (rows with "step" and metric keys).
        path: the PNG to write.
        keys: metric keys to draw, in panel order.

    Returns:
        The keys drawn (empty, and no file written, when none was logged).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drawn = [k for k in keys if any(k in row for rows in histories.values() for row in rows)]
    if not drawn:
        return []
    fig, axes = plt.subplots(len(drawn), 1, figsize=(8, 2.6 * len(drawn)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], drawn, strict=True):
        for label, rows in histories.items():
            points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", label=label)
        ax.set_ylabel(key, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel("optimizer step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
