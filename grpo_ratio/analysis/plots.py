"""Plots of logged training metrics (TRL's `log_history` rows), one panel per quantity, x = optimizer step.

What every plot does, so that a picture never says more or less than the log:
- a title with the model, the arm (scoring mode), the truncation correction and the number of steps;
- the raw old/sampler rate and, whenever it was logged, the corrected one and the kept mass (a correction that worked
  must be visible);
- the ratio band drawn on the quantile panel; rates on an axis from 0 (a change from 0.034 to 0.029 is not drawn
  full height);
- in comparisons, one colour and one hollow marker shape per arm, one line style per seed, and each arm's points
  shifted a little along the step axis, so arms whose values equal the baseline's (rollouts not yet diverged) stay
  visible beside it instead of under it; one legend for the figure (an entry per arm, one per seed), and on a panel
  with several series a small legend of those series only (a legend entry per arm, seed and series made six arms x
  two seeds unreadable);
- legends outside the panels, never over the data.
"""

from __future__ import annotations

from pathlib import Path

from ..diagnostics import metric_keys as keys
from ..modes import TRL_MODE


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
              styles: dict[str, dict] | None = None, band: tuple[float, float] = (0.9, 1.1),
              offsets: dict[str, float] | None = None) -> list[str]:
    """Draw one PNG with a panel per quantity in `PANELS` that any history logged, one line per (run, series).

    Args:
        histories: run label -> `trainer.state.log_history` (rows with "step" and metric keys).
        path: the PNG to write.
        title: the figure title (model, arm, correction, steps).
        styles: run label -> matplotlib line keywords (colour and marker per arm, line style per seed); default: one
            colour each.
        band: the ratio band drawn on the quantile panel (`ratio_band_low`, `ratio_band_high`).
        offsets: run label -> shift along the step axis (in steps), so that equal lines stay apart.

    Returns:
        The logged keys drawn (empty, and no file written, when none was logged).
    """
    fig, drawn = draw_runs(histories, title, styles, band, offsets)
    if fig is None:
        return []
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the legends outside the panels are kept
    _pyplot().close(fig)
    return drawn


def draw_runs(histories: dict[str, list[dict]], title: str, styles: dict[str, dict] | None = None,
              band: tuple[float, float] = (0.9, 1.1), offsets: dict[str, float] | None = None):
    """The figure of `plot_runs`, not saved: (matplotlib Figure or None when nothing was logged, keys drawn)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    panels = [(name, [(k, lbl) for k, lbl in series if any(_points(rows, k) for rows in histories.values())], kind)
              for name, series, kind in PANELS]
    panels = [p for p in panels if p[1]]
    if not panels:
        return None, []
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.5 * len(panels) + 0.6), sharex=True, squeeze=False)
    series_styles = ["-", "--", ":", "-."]
    comparison = styles is not None  # one figure legend for arms and seeds; panel legends name series only
    drawn = []
    for ax, (name, series, kind) in zip(axes[:, 0], panels, strict=True):
        values = []
        for j, (key, label) in enumerate(series):
            for run, rows in histories.items():
                points = _points(rows, key)
                if not points:
                    continue
                style = {"marker": ".", "ms": 3, "lw": 1.2} | dict((styles or {}).get(run, {}))
                if len(series) > 1 and comparison:
                    style |= _series_look(j)
                elif len(series) > 1:
                    style["ls"] = series_styles[j % len(series_styles)]
                shift = (offsets or {}).get(run, 0.0)
                multi_run = len(histories) > 1
                if comparison:
                    label_ = "_nolegend_"
                else:
                    label_ = f"{run}: {label}" if multi_run and len(series) > 1 else (run if multi_run else label)
                ax.plot([x + shift for x, _ in points], [v for _, v in points], label=label_, **style)
                values += [v for _, v in points]
            drawn.append(key)
        _finish_axis(ax, kind, values, band)
        ax.set_title(name, fontsize=9, loc="left")
        # outside, right of the panel: a legend never covers the lines it names
        handles = None  # a plain plot: the lines' own labels
        if comparison:  # the series in grey, and the band's patch (labelled by _finish_axis)
            handles = [Line2D([], [], color="grey", label=lbl, **_series_look(j)) for j, (_, lbl) in enumerate(series)]
            handles += ax.get_legend_handles_labels()[0]
        if not comparison or len(series) > 1:
            ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    axes[-1, 0].set_xlabel("optimizer step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if comparison:  # after tight_layout, which does not make room for a figure legend; savefig's "tight" box does
        top = axes[0, 0].get_position()
        fig.legend(handles=_comparison_handles(styles), fontsize=7, loc="upper left",
                   bbox_to_anchor=(top.x1 + 0.02, top.y1), borderaxespad=0.0)
    return fig, sorted(set(drawn), key=PLOT_KEYS.index)


def _series_look(j: int) -> dict:
    """Series j of a comparison panel: p1 opaque, p99 faded; the second pair (corrected) drawn thicker."""
    return {"alpha": 1.0 if j % 2 == 0 else 0.55, "lw": 1.2 if j < 2 else 2.4}


def _comparison_handles(styles: dict[str, dict]) -> list:
    """Legend entries of a comparison: one per arm (colour, marker), then one per seed (line style) when several."""
    from matplotlib.lines import Line2D

    arms, seeds = {}, {}
    for run, style in styles.items():  # keys "<arm> s<seed>" (comparison_styles)
        arm, seed = run.rsplit(" s", 1)
        arms.setdefault(arm, style)
        seeds.setdefault(seed, style["ls"])
    handles = [Line2D([], [], color=st["color"], marker=st["marker"], mfc="none", label=arm)
               for arm, st in arms.items()]
    if len(seeds) > 1:
        handles += [Line2D([], [], color="grey", ls=ls, label=f"seed {seed}") for seed, ls in seeds.items()]
    return handles


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype) -> str | None:
    """`"fp32"`, `"bf16"` or `"fp16"` for a torch dtype or its name (`torch.float32`, `"bfloat16"`); None otherwise."""
    return _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))


def arm_label(mode: str, bf16: bool | None = None, fp16: bool | None = None, weights: str | None = None) -> str:
    """How a plot or table names an `old_logprob_mode` arm: by what it does where it is shown. `"bf16"` is TRL's own
    old pass at the run's training precision, which is bf16 only under bf16 autocast or on bf16 weights:
    `"bf16 (TRL's own pass)"` there, `"TRL's own pass (fp32)"` on an fp32 run (`"(fp16)"` under fp16 autocast,
    `"(no autocast)"` where neither flag is set and the weights' dtype is unknown). Every other mode is its name.

    Args:
        mode: the run's `old_logprob_mode`. bf16, fp16: its `bf16` / `fp16` (None: unknown, read as bf16 training).
        weights: the policy's weight dtype as a short name (`"fp32"`, `"bf16"`, `"fp16"`), or None (unknown).
    """
    if mode != TRL_MODE:
        return mode
    if bf16 is None and fp16 is None:
        precision = weights or "bf16"
    else:
        precision = "bf16" if bf16 else "fp16" if fp16 else weights or "no autocast"
    return f"{TRL_MODE} (TRL's own pass)" if precision == "bf16" else f"TRL's own pass ({precision})"


def config_arm_label(config: dict | None, arm: str) -> str:
    """`arm_label` of a comparison arm from its run's config (`run_record.run_config`, plus the policy's
    `weights_dtype` where `grpo-ratio compare` recorded it): the recipe's label where it is not the run's
    `old_logprob_mode` (a name the user chose), else what the mode does in that run."""
    config = config or {}
    if config.get("old_logprob_mode") != arm:
        return arm
    return arm_label(arm, config.get("bf16"), config.get("fp16"), config.get("weights_dtype"))


def run_title(model: str, args, steps: int, weights=None) -> str:
    """`<model>: <arm>, truncation_correction=<c> (top_p=...), <n> steps` for a single run: the arm as `arm_label`
    names it (`old_logprob_mode=fp32_clone`; `bf16 (TRL's own pass)`, or `TRL's own pass (fp32)` on an fp32 run),
    `weights` the policy's weight dtype (a torch dtype or `dtype_name`'s; None: unknown)."""
    sampling = ", ".join(f"{k}={getattr(args, k)}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", None))
                         if getattr(args, k, off) not in (off, 0, None))
    mode = args.old_logprob_mode
    arm = f"old_logprob_mode={mode}" if mode != TRL_MODE else arm_label(mode, args.bf16, args.fp16,
                                                                          dtype_name(weights))
    return (f"{model}: {arm}, truncation_correction={args.truncation_correction}"
            f"{f' ({sampling})' if sampling else ''}, {steps} steps")


def plot_metrics(histories: dict[str, list[dict]], path: str | Path, title: str = "",
                 band: tuple[float, float] = (0.9, 1.1)) -> list[str]:
    """The metrics of one or more runs (one colour each); see `plot_runs`."""
    return plot_runs(histories, path, title, band=band)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def comparison_styles(runs) -> tuple[dict[str, dict], dict[str, float]]:
    """(styles, offsets) of a comparison's runs (`.arm`, `.seed`, optionally `.config`), keyed "<arm> s<seed>" with
    the arm as `config_arm_label` names it: per arm a colour, a hollow marker shape and a shift along the step axis
    (arms spread over 0.3 of a step), per seed a line style."""
    shown = [_shown_arm(r) for r in runs]
    arms = list(dict.fromkeys(shown))
    seeds = list(dict.fromkeys(r.seed for r in runs))
    width = 0.3 if len(arms) > 1 else 0.0
    styles, offsets = {}, {}
    for r, arm in zip(runs, shown, strict=True):
        label = f"{arm} s{r.seed}"
        i = arms.index(arm)
        styles[label] = {"color": f"C{i % 10}", "ls": ["-", "--", ":", "-."][seeds.index(r.seed) % 4],
                         "marker": MARKERS[i % len(MARKERS)], "ms": 4, "mfc": "none"}
        offsets[label] = (i / (len(arms) - 1) - 0.5) * width if len(arms) > 1 else 0.0
    return styles, offsets


def _shown_arm(run) -> str:
    return config_arm_label(getattr(run, "config", None), run.arm)


def plot_comparison(runs, path: str | Path, title: str, band: tuple[float, float] = (0.9, 1.1)) -> list[str]:
    """A comparison's runs (`RunResult`s with `.arm`, `.seed`, `.history`): see `comparison_styles`."""
    styles, offsets = comparison_styles(runs)
    histories = {f"{_shown_arm(r)} s{r.seed}": r.history for r in runs}
    return plot_runs(histories, path, title, styles=styles, band=band, offsets=offsets)
