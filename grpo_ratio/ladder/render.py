"""The ladders in the docs: the grid of verdicts, the rule, the reward-curve figures, the README's headline and the
threshold sweep, all from the committed results (`python -m grpo_ratio.ladder ...`, docs/when_it_matters.md's
generated blocks; files only)."""

from __future__ import annotations

import os
from pathlib import Path

from .definitions import LADDERS
from .outcomes import find_ladders, read_cells
from .rule import (
    cost_text_per_correction,
    fmt,
    load_summaries,
    lost,
    recoveries,
    testbed_label,
    threshold_text,
    verdict_text,
)


FIGURE = "reward_curves.png"


def _mark(v: dict | None) -> str:
    """A verdict in one word for the grid: "lost", "gained", "within noise", "not diverged yet", "unknown"."""
    if not v:
        return ""
    if v["verdict"] == "beyond noise":
        return "**lost**" if v["estimate"] < 0 else "**gained**"
    return v["verdict"]


def short_verdict(v: dict | None) -> str:
    """A verdict for a table cell: "-0.05 [-0.09, -0.01] lost", "+0.01 [-0.02, +0.04] within noise", "+0.02,
    unknown"; "" for none."""
    if not v or v.get("estimate") is None:
        return _mark(v)
    if v.get("interval"):
        lo, hi = v["interval"]
        return f"{fmt(v['estimate'], True)} [{fmt(lo, True)}, {fmt(hi, True)}] {_mark(v)}"
    return f"{fmt(v['estimate'], True)}, {_mark(v)}"


def render_grid(summaries: list[dict]) -> str:
    """Markdown: per ladder a table, one row per setting (its distance, the uncorrected run's loss against the
    reference), one column per correction: the mean held-out end reward and the `gain` verdict against the
    uncorrected run at that setting."""
    if not summaries:
        return "No ladder results committed yet (results/ladders/).\n"
    out = []
    for summary in summaries:
        lad = LADDERS[summary["source"]]
        names = [c.name for c in lad.corrections if any(c.name in e["corrections"]
                                                        for e in summary["settings"].values())]
        seeds = sorted({s for e in summary["settings"].values() for i in e["corrections"].values() for s in i["seeds"]})
        metric = next(i["metric"] for e in summary["settings"].values() for i in e["corrections"].values())
        out += [f"**{lad.source}** ({summary['folder']}: {testbed_label(summary)} testbed, seeds {seeds}; {metric} over "
                f"the last {summary['end_points']} evaluations; distance: {lad.distance.label}; under each "
                f"correction its end reward and its verdict against `{summary['uncorrected']}` at the same setting)",
                "", "| setting | distance | " + " | ".join(f"`{n}`" for n in names) + " | uncorrected vs reference |",
                "|---" * (3 + len(names)) + "|"]
        for setting, entry in summary["settings"].items():
            cells = []
            for n in names:
                item = entry["corrections"].get(n)
                if not item:
                    cells.append("")
                    continue
                gain = item.get("gain")
                cells.append(fmt(item["end"]) + (f" ({short_verdict(gain)})" if gain else ""))
            loss = (entry["corrections"].get(summary["uncorrected"]) or {}).get("loss")
            ref = "reference" if setting == summary["reference"] else short_verdict(loss)
            realized = entry.get("realized_staleness")
            distance = fmt(entry["distance"]) + (f" (realized {fmt(realized)})" if realized is not None else "")
            out.append(f"| `{setting}` | {distance} | " + " | ".join(cells) + f" | {ref} |")
        out.append("")
    return "\n".join(out)


def render_rule(summaries: list[dict]) -> str:
    """Markdown: per ladder the threshold sentence, then per setting that lost reward the corrections that recovered
    it, with their cost."""
    if not summaries:
        return "No ladder results committed yet: the rule is generated from them once they are.\n"
    out = []
    for summary in summaries:
        lad = LADDERS[summary["source"]]
        out.append(f"- {threshold_text(summary)}")
        for setting, entry in summary["settings"].items():
            loss = (entry["corrections"].get(summary["uncorrected"]) or {}).get("loss")
            if lost(loss):
                fixes = recoveries(lad, summary, setting) or ["no correction of the ladder recovered it"]
                out.append(f"  - `{setting}` ({lad.distance.label} {fmt(entry['distance'])}): lost "
                           f"{verdict_text(loss)}; " + "; ".join(fixes))
    return "\n".join(out) + "\n"


def render_headline(summaries: list[dict], link: str = "docs/when_it_matters.md") -> str:
    """The README's one sentence: how many ladders lost reward uncorrected, and where to read it."""
    if not summaries:
        return (f"Whether a correction changes what is learned is measured on mismatch ladders (staleness, truncation, "
                f"sampler precision): [{link}]({link}), filled in as their results are committed.\n")
    def names(found: list[str]) -> str:  # each source once, in order (a SmolLM2 confirmation is the same source)
        return ", ".join(dict.fromkeys(found))

    lost_in = [s for s in summaries if any(lost((e["corrections"].get(s["uncorrected"]) or {}).get("loss"))
                                           for e in s["settings"].values())]
    losing = [s["source"] for s in lost_in]
    quiet = [s["source"] for s in summaries if s["source"] not in losing]
    costly = [s["source"] for s in summaries if cost_text_per_correction(s)]
    parts = []
    if losing:
        where = "; ".join(dict.fromkeys(testbed_label(s) for s in lost_in))  # a label may hold commas itself
        parts.append(f"uncorrected runs lost held-out reward on the {names(losing)} ladder(s) (testbed: {where})")
    if quiet:
        parts.append(f"no loss was measured on the {names(quiet)} ladder(s)")
    if costly:
        parts.append(f"a correction itself cost reward on the {names(costly)} ladder(s)")
    return (f"On the committed mismatch ladders {', '.join(parts[:-1]) + ' and ' if len(parts) > 1 else ''}"
            f"{parts[-1]}; at which step-1 distance, which correction recovered what, and at what cost: "
            f"[{link}]({link}).\n")


def write_figures(folder: str | Path, out_dir: str | Path) -> Path | None:
    """Draw one ladder's reward curves (`FIGURE` in `out_dir`): one panel per setting, one line per correction (the
    mean over seeds of the held-out reward per evaluated step, thin lines per seed); None without cells."""
    cells = read_cells(folder)
    if not cells:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lad = LADDERS[cells[0]["cell"]["source"]]
    settings = [s.name for s in lad.settings if any(o["cell"]["setting"] == s.name for o in cells)]
    colors = {c.name: f"C{i}" for i, c in enumerate(lad.corrections)}
    fig, axes = plt.subplots(1, len(settings), figsize=(3.2 * len(settings), 3.0), sharey=True, squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for c in lad.corrections:
            runs = [o for o in cells if o["cell"]["setting"] == setting and o["cell"]["correction"] == c.name]
            for o in runs:
                ax.plot(o["steps"], o["values"], color=colors[c.name], alpha=0.25, linewidth=0.8)
            if runs:
                steps = runs[0]["steps"]
                mean = [sum(o["values"][i] for o in runs if i < len(o["values"])) /
                        sum(1 for o in runs if i < len(o["values"])) for i in range(len(steps))]
                ax.plot(steps, mean, color=colors[c.name], linewidth=1.8, label=c.name)
        ax.set_title(setting, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].set_ylabel(cells[0]["metric"], fontsize=8)
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines() if not h.get_label().startswith("_")}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(f"{lad.source}: held-out reward per setting and correction", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    path = Path(out_dir) / FIGURE
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    return path


def render_figures(root: str | Path, docs_dir: str | Path = "docs") -> str:
    """Markdown image links to each ladder's figure (drawn by `benchmarks/ladder.py`, or `figures --write`), relative
    to `docs_dir`; a line naming the command for a ladder whose figure is missing."""
    folders = find_ladders(root)
    if not folders:
        return "No ladder results committed yet: the reward curves are drawn from them.\n"
    out = []
    for folder in folders:
        figure = folder / FIGURE
        if figure.is_file():
            out.append(f"![{folder.name}: reward curves]({os.path.relpath(figure, docs_dir)})")
        else:
            out.append(f"({folder.name}: no figure yet; `python -m grpo_ratio.ladder figures {root} --write` draws it)")
    return "\n\n".join(out) + "\n"


def render_thresholds(root: str | Path) -> str:
    """The threshold sweep (issue 41, item 5): the grid of each ladder folder under `root` (one folder per knob,
    each setting a value of it), or a line saying none is committed yet."""
    summaries = load_summaries(root)
    if not summaries:
        return (f"No threshold sweep committed yet ({root}): this section is generated from it once it is (a ladder "
                f"folder per knob, a setting per value).\n")
    return render_grid(summaries)
