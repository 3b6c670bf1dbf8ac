"""Plots of logged training metrics (TRL's `log_history` rows), one panel per quantity, x = optimizer step.

What every plot does, so that a picture never says more or less than the log:
- a title with the model, the arm (scoring mode), the truncation correction and the number of steps;
- the raw old/sampler rate and, whenever it was logged, the corrected one and the kept mass (a correction that worked
  must be visible);
- the ratio band drawn on the quantile panel; rates on an axis from 0 (a change from 0.034 to 0.029 is not drawn
  full height);
- in comparisons, one colour per arm and one line style per seed, so equal runs do not hide each other.
"""

from __future__ import annotations

from pathlib import Path

from . import metric_keys as keys


# (panel title, [(logged key, label)], kind): "rate" panels start at 0; "ratio" panels get the band
PANELS = (
    ("reward", [("reward", "reward")], "value"),
    ("tokens out of band: new/old", [(keys.NEW_OLD.oob_rate, "new/old")], "rate"),
    ("tokens out of band: old/sampler", [(keys.OLD_SAMPLER.oob_rate, "raw"),
                                          (keys.OLD_SAMPLER_CORRECTED.oob_rate, "corrected")], "rate"),
    ("kept mass (truncated sampling)", [(keys.KEPT_MASS_MEAN, "mean kept mass")], "mass"),
    ("ratio quantiles (p1, p99)", [(keys.NEW_OLD.p1, "new/old p1"), (keys.NEW_OLD.p99, "new/old p99"),
                                   (keys.OLD_SAMPLER_CORRECTED.p1, "old/sampler corrected p1"),
                                   (keys.OLD_SAMPLER_CORRECTED.p99, "old/sampler corrected p99")], "ratio"),
    ("PPO clip", [(keys.CLIP_FLIP_RATE, "clip flips (mode vs policy)"), ("clip_ratio/region_mean", "TRL clipped")],
     "rate"),
)
PLOT_KEYS = tuple(key for _, series, _ in PANELS for key, _ in series)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _points(rows: list[dict], key: str) -> list[tuple[float, float]]:
    return [(row["step"], row[key]) for row in rows if row.get(key) is not None and "step" in row]


def _finish_axis(ax, kind: str, values: list[float], band: tuple[float, float]) -> None:
    if kind == "rate":  # from 0, to a little above the largest value (at least 0.05: a 1% wiggle stays small)
        ax.set_ylim(0, max([0.05, *values]) * 1.15)
    elif kind == "mass":
        ax.set_ylim(min([0.5, *values]) - 0.02, 1.02)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    elif kind == "ratio":
        low, high = band
        ax.axhspan(low, high, color="tab:green", alpha=0.08, label=f"band [{low}, {high}]")
        ax.set_ylim(min([low, *values]) - 0.02, max([high, *values]) + 0.02)
    ax.grid(alpha=0.3)


def plot_runs(histories: dict[str, list[dict]], path: str | Path, title: str,
              styles: dict[str, dict] | None = None, band: tuple[float, float] = (0.9, 1.1)) -> list[str]:
    """Draw one PNG with a panel per quantity in `PANELS` that any history logged, one line per (run, series).

    Args:
        histories: run label -> `trainer.state.log_history` (rows with "step" and metric keys).
        path: the PNG to write.
        title: the figure title (model, arm, correction, steps).
        styles: run label -> matplotlib line keywords (colour per arm, line style per seed); default: one colour each.
        band: the ratio band drawn on the quantile panel (`ratio_band_low`, `ratio_band_high`).

    Returns:
        The logged keys drawn (empty, and no file written, when none was logged).
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    panels = [(name, [(k, lbl) for k, lbl in series if any(_points(rows, k) for rows in histories.values())], kind)
              for name, series, kind in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        return []
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.5 * len(panels) + 0.6), sharex=True, squeeze=False)
    series_styles = ["-", "--", ":", "-."]
    drawn = []
    for ax, (name, series, kind) in zip(axes[:, 0], panels, strict=True):
        values = []
        for j, (key, label) in enumerate(series):
            for run, rows in histories.items():
                points = _points(rows, key)
                if not points:
                    continue
                style = dict((styles or {}).get(run, {}))
                if len(series) > 1 and styles is not None:
                    style["alpha"] = 1.0 if j % 2 == 0 else 0.55
                elif len(series) > 1:
                    style["ls"] = series_styles[j % len(series_styles)]
                multi_run = len(histories) > 1
                ax.plot(*zip(*points, strict=True), marker=".", ms=3, lw=1.2,
                        label=f"{run}: {label}" if multi_run and len(series) > 1 else (run if multi_run else label),
                        **style)
                values += [v for _, v in points]
            drawn.append(key)
        _finish_axis(ax, kind, values, band)
        ax.set_title(name, fontsize=9, loc="left")
        ax.legend(fontsize=6, ncol=3 if len(histories) > 2 else 2, loc="best")
    axes[-1, 0].set_xlabel("optimizer step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return sorted(set(drawn), key=PLOT_KEYS.index)


def run_title(model: str, args, steps: int) -> str:
    """`<model>: old_logprob_mode=<arm>, truncation_correction=<c> (top_p=...), <n> steps` for a single run."""
    sampling = ", ".join(f"{k}={getattr(args, k)}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", None))
                         if getattr(args, k, off) not in (off, 0, None))
    return (f"{model}: old_logprob_mode={args.old_logprob_mode}, truncation_correction={args.truncation_correction}"
            f"{f' ({sampling})' if sampling else ''}, {steps} steps")


def plot_metrics(histories: dict[str, list[dict]], path: str | Path, title: str = "",
                 band: tuple[float, float] = (0.9, 1.1)) -> list[str]:
    """The metrics of one or more runs (one colour each); see `plot_runs`."""
    return plot_runs(histories, path, title, band=band)


def plot_comparison(runs, path: str | Path, title: str, band: tuple[float, float] = (0.9, 1.1)) -> list[str]:
    """A comparison's runs (`RunResult`s with `.arm`, `.seed`, `.history`): colour by arm, line style by seed."""
    colours = [f"C{i}" for i in range(10)]
    arms = list(dict.fromkeys(r.arm for r in runs))
    seeds = list(dict.fromkeys(r.seed for r in runs))
    styles, histories = {}, {}
    for r in runs:
        label = f"{r.arm} s{r.seed}"
        histories[label] = r.history
        styles[label] = {"color": colours[arms.index(r.arm) % len(colours)],
                         "ls": ["-", "--", ":", "-."][seeds.index(r.seed) % 4]}
    return plot_runs(histories, path, title, styles=styles, band=band)
