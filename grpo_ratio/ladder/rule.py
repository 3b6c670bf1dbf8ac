"""The report rule: from committed ladder results, what a run's step-1 distance meant for the reward (files only).

For each source the rule reads its ladder summary (`grpo_ratio.ladder.outcomes.summarize_ladder`, computed from the
committed cells, never typed by hand): per setting the distance a run logs at step 1 (`Ladder.distance`: old/sampler
k3, 1 - kept mass, or the staleness of the configuration), whether the uncorrected run lost held-out reward against the
reference setting (the `loss` verdict: paired by seed, a t-interval that excludes 0 below), and which correction got
it back (a `gain` verdict that excludes 0 above) at what cost (the share of tokens it took out of the loss, its IS
weights' ESS, its CPU time against the uncorrected cell's, the passes it adds).

`threshold_text(summary)` says it for a whole ladder: "uncorrected runs lost reward from distance D on" or "no loss
measured up to distance D". `rule_for_run(history, config, summaries)` says it for one run: "your step-1 k3 is X: the
nearest committed cell is S (k3 Y): uncorrected runs there lost Z [lo, hi]; C recovered it (+G [lo, hi]) at cost
...", or "no loss measured up to distance D".
"""

from __future__ import annotations

from pathlib import Path

from .definitions import LADDERS, STALENESS, Ladder, config_staleness
from .outcomes import STEP1_KEYS, find_ladders, step1_diagnostics, summarize_ladder


DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "results" / "ladders"  # the repository's committed results


def load_summaries(root: str | Path = DEFAULT_ROOT) -> list[dict]:
    """`summarize_ladder` of every ladder folder under `root` (none when `root` does not exist), sorted by folder,
    each with its `folder` name added."""
    out = []
    for folder in find_ladders(root):
        summary = summarize_ladder(folder)
        summary["folder"] = folder.name
        out.append(summary)
    return out


def fmt(x: float | None, signed: bool = False) -> str:
    """`x` to 3 significant digits (a sign with `signed`); "-" for None."""
    return "-" if x is None else (f"{x:+.3g}" if signed else f"{x:.3g}")


def verdict_text(v: dict | None) -> str:
    """A verdict dict (`outcomes._verdict`) as "+0.05 [+0.01, +0.09], beyond noise (t-interval over 3 seeds)", or
    its verdict and reason when it has no interval."""
    if not v:
        return "not run"
    if v.get("interval"):
        lo, hi = v["interval"]
        return f"{fmt(v['estimate'], True)} [{fmt(lo, True)}, {fmt(hi, True)}], {v['verdict']} ({v['method']})"
    if v["verdict"] == "unknown":
        why = (f"{len(v.get('seeds') or [])} seed(s): the interval needs 2 or more" if v.get("estimate") is not None
               else "no paired run")
        return f"unknown ({fmt(v.get('estimate'), True)}; {why})"
    return f"{v['verdict']} ({fmt(v.get('estimate'), True)})"


def lost(v: dict | None) -> bool:
    """The verdict says the run lost reward: its interval excludes 0 below."""
    return bool(v) and v.get("verdict") == "beyond noise" and (v.get("estimate") or 0) < 0


def gained(v: dict | None) -> bool:
    """The verdict says the run gained reward: its interval excludes 0 above."""
    return bool(v) and v.get("verdict") == "beyond noise" and (v.get("estimate") or 0) > 0


def cost_text(lad: Ladder, summary: dict, setting: str, correction: str) -> str:
    """What `correction` cost at `setting`: the share of tokens it took out (and the key that says so), its IS ESS,
    its CPU time against the uncorrected cell's, and the passes it adds (the definition's words)."""
    entry = summary["settings"][setting]["corrections"]
    mine, base = entry[correction]["cost"], (entry.get(summary["uncorrected"]) or {}).get("cost") or {}
    parts = []
    if mine.get("masked_share") is not None:
        parts.append(f"masked share {fmt(mine['masked_share'])} ({entry[correction]['masked_key']})")
    if mine.get("ess") is not None:
        parts.append(f"ESS {fmt(mine['ess'])}")
    if mine.get("cpu_s") and base.get("cpu_s"):
        parts.append(f"CPU x{mine['cpu_s'] / base['cpu_s']:.2f} of the uncorrected cell")
    parts.append(f"extra passes: {lad.correction(correction).extra_passes}")
    return ", ".join(parts)


def recoveries(lad: Ladder, summary: dict, setting: str) -> list[str]:
    """Sentences for the corrections whose `gain` at `setting` excludes 0 above, with their gap to the reference and
    their cost; [] when none did."""
    out = []
    for name, item in summary["settings"][setting]["corrections"].items():
        if name == summary["uncorrected"] or not gained(item.get("gain")):
            continue
        gap = item.get("gap")
        reach = ("back to the reference's reward" if gap and gap.get("verdict") == "within noise"
                 else f"against the reference {verdict_text(gap)}" if gap else "")
        out.append(f"`{name}` recovered {verdict_text(item['gain'])}" + (f", {reach}" if reach else "")
                   + f", at cost: {cost_text(lad, summary, setting, name)}")
    return out


def costs(summary: dict, setting: str) -> list[str]:
    """Sentences for the corrections whose `gain` at `setting` excludes 0 below: the correction lost reward against
    the uncorrected run; [] when none did."""
    return [f"`{name}` lost {verdict_text(item['gain'])} against the uncorrected run"
            for name, item in summary["settings"][setting]["corrections"].items()
            if name != summary["uncorrected"] and lost(item.get("gain"))]


def cost_text_per_correction(summary: dict) -> list[str]:
    """Per correction that lost reward against the uncorrected run at some setting: from which distance on, and at
    how many of the settings it ran at (e.g. PPO's clip on stale rollouts, docs/when_it_matters.md)."""
    lad = LADDERS[summary["source"]]
    ordered = _ordered(summary)
    out = []
    for correction in lad.corrections:
        if correction.uncorrected:
            continue
        ran = [(s, d) for s, d in ordered if correction.name in summary["settings"][s]["corrections"]]
        losing = [(s, d) for s, d in ran
                  if lost(summary["settings"][s]["corrections"][correction.name].get("gain"))]
        if losing:
            s1, d1 = losing[0]
            gain = summary["settings"][s1]["corrections"][correction.name]["gain"]
            out.append(f"`{correction.name}` lost held-out reward against the uncorrected run from "
                       f"{lad.distance.label} = {fmt(d1)} on (setting {s1}: {verdict_text(gain)}; at {len(losing)} of "
                       f"the {len(ran)} settings it ran at)")
    return out


def _ordered(summary: dict) -> list[tuple[str, float]]:
    """(setting, distance) of the settings with a distance, by distance."""
    pairs = [(s, e["distance"]) for s, e in summary["settings"].items() if e["distance"] is not None]
    return sorted(pairs, key=lambda p: p[1])


def _loss(summary: dict, setting: str) -> dict | None:
    return (summary["settings"][setting]["corrections"].get(summary["uncorrected"]) or {}).get("loss")


def testbed_label(summary: dict) -> str:
    """The testbed in words, with the `--set` values the whole ladder ran with: "tiny", "tiny, learning_rate=0.003"."""
    return summary["testbed"] + "".join(f", {k}={v}" for k, v in (summary.get("sets") or {}).items())


def threshold_text(summary: dict) -> str:
    """One sentence for a ladder: the smallest distance at which uncorrected runs lost reward (and the largest
    without a loss below it), or that none lost up to the largest distance tried."""
    lad = LADDERS[summary["source"]]
    ordered = _ordered(summary)
    if not ordered:
        return f"{lad.source}: no setting with a measured distance ({lad.distance.label})."
    losing = [(s, d) for s, d in ordered if lost(_loss(summary, s))]
    costly = cost_text_per_correction(summary)
    cost_tail = f" A correction cost reward: {'; '.join(costly)}." if costly else ""
    if not has_reference(summary):
        return f"{lad.source} ({testbed_label(summary)}): {_no_reference(summary)}.{cost_tail}"
    if not losing:
        s, d = ordered[-1]
        return (f"{lad.source} ({testbed_label(summary)}): no loss measured up to {lad.distance.label} = {fmt(d)} "
                f"(setting {s}, the largest tried).{cost_tail}")
    s1, d1 = losing[0]
    below = [(s, d) for s, d in ordered if d < d1 and not lost(_loss(summary, s))]
    text = (f"{lad.source} ({testbed_label(summary)}): uncorrected runs lost held-out reward from {lad.distance.label} = "
            f"{fmt(d1)} on (setting {s1}: {verdict_text(_loss(summary, s1))})")
    if below:
        text += f"; no loss measured at {fmt(below[-1][1])} (setting {below[-1][0]})"
    fixes = recoveries(lad, summary, s1)
    return text + (f". There: {'; '.join(fixes)}." if fixes else ". No correction recovered it there.") + cost_tail


def has_reference(summary: dict) -> bool:
    """The folder holds its ladder's reference setting (the "did the uncorrected run lose reward" baseline); a summary
    that names none is taken to."""
    return summary.get("reference") is None or summary["reference"] in summary["settings"]


def _no_reference(summary: dict) -> str:
    """Words for a ladder folder without its reference cell (a confirmation run at one setting): no loss verdict,
    and each correction's verdict against the uncorrected run where it ran."""
    gains = [f"`{name}` at `{s}`: {verdict_text(item['gain'])}" for s, e in summary["settings"].items()
             for name, item in e["corrections"].items() if item.get("gain")]
    text = f"no reference cell (`{summary['reference']}`) committed here, so no loss verdict"
    return text + (f"; against the uncorrected run, {'; '.join(gains)}" if gains else "")


def run_distance(lad: Ladder, history: list[dict], config: dict | None) -> float | None:
    """A run's distance in the ladder's unit: the staleness of its configuration, or the step-1 value of the
    ladder's key (1 - it for `one_minus`); None when the run does not say."""
    if lad.distance.key == STALENESS:
        return config_staleness(config)
    name = next((n for n, k in STEP1_KEYS.items() if k == lad.distance.key), None)
    value = step1_diagnostics(history).get(name) if name else None
    return None if value is None else (1.0 - value if lad.distance.one_minus else value)


def _applies(lad: Ladder, history: list[dict], config: dict | None) -> bool:
    """The ladder's trainer is the run's (an asynchronous run's configuration has `max_staleness`) and, for a ladder
    with an `applies_key`, the run logged it."""
    run_trainer = "async" if (config or {}).get("max_staleness") is not None else "sync"
    return lad.trainer == run_trainer and (lad.applies_key is None
                                           or any(row.get(lad.applies_key) is not None for row in history))


def rule_sentence(summary: dict, distance: float) -> str:
    """The rule for one distance against one ladder (module docstring)."""
    lad = LADDERS[summary["source"]]
    ordered = _ordered(summary)
    if not ordered:
        return f"{lad.source}: the committed ladder has no measured distance."
    setting, at = min(ordered, key=lambda p: (abs(p[1] - distance), -p[1]))
    head = (f"your {lad.distance.label} is {fmt(distance)}: the nearest committed cell is `{setting}` "
            f"({fmt(at)}, {testbed_label(summary)} testbed)")
    if distance > ordered[-1][1]:
        head += ", the ladder's largest; yours is beyond it"
    if not has_reference(summary):
        return f"{head}: {_no_reference(summary)}."
    loss = _loss(summary, setting)
    if lost(loss):
        fixes = recoveries(lad, summary, setting)
        tail = "; ".join(fixes) if fixes else "no correction of the ladder recovered it"
        return f"{head}: uncorrected runs there lost {verdict_text(loss)}; {tail}."
    losing = [(s, d) for s, d in ordered if lost(_loss(summary, s))]
    there = f" (at `{setting}`: {verdict_text(loss)})" if loss else ""
    paid = costs(summary, setting)
    paid_tail = f" There, {'; '.join(paid)}." if paid else ""
    if not losing:
        return (f"{head}. No loss measured up to distance {fmt(ordered[-1][1])}, the largest tried{there}."
                f"{paid_tail}")
    first, d1 = losing[0]
    first_text = f"the first loss is at `{first}` ({fmt(d1)}): {verdict_text(_loss(summary, first))}"
    if distance < d1:
        safe = max(d for _, d in ordered if d < d1)
        return f"{head}. No loss measured up to distance {fmt(safe)}{there}; {first_text}."
    return f"{head}: uncorrected runs there showed {verdict_text(loss)}; {first_text}."


def rule_for_run(history: list[dict], config: dict | None, summaries: list[dict]) -> list[str]:
    """Markdown lines: per committed ladder that applies to the run (the asynchronous ladder to an asynchronous run,
    the others to a synchronous one; an MoE ladder only to a run that logged routes), `rule_sentence` at the run's
    distance, or why the run's distance is unknown."""
    lines = []
    for summary in summaries:
        lad = LADDERS[summary["source"]]
        if not _applies(lad, history, config):
            continue
        distance = run_distance(lad, history, config)
        if distance is None:
            lines.append(f"- **{lad.source}**: this run did not log its {lad.distance.label}.")
        else:
            lines.append(f"- **{lad.source}**: {rule_sentence(summary, distance)}{_other_settings(summary, config)}")
    return lines


def _other_settings(summary: dict, config: dict | None) -> str:
    """" (that ladder ran with epsilon=1e9; this run has epsilon=0.2)" where the run's config differs from a `--set`
    value the whole ladder ran with (compared as numbers where both are), else ""."""
    def same(a, b) -> bool:
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return str(a) == str(b)

    differ = [k for k, v in (summary.get("sets") or {}).items() if config and k in config and not same(v, config[k])]
    if not differ:
        return ""
    theirs = ", ".join(f"{k}={summary['sets'][k]}" for k in differ)
    return f" (that ladder ran with {theirs}; this run has {', '.join(f'{k}={config[k]}' for k in differ)})"


def render_rule_section(history: list[dict], config: dict | None, root: str | Path = DEFAULT_ROOT) -> str:
    """The report's section "When it matters": the rule for the run from the ladders committed under `root`, or one
    line saying there are none."""
    summaries = load_summaries(root)
    head = "#### When it matters (the committed mismatch ladders, docs/when_it_matters.md)\n"
    if not summaries:
        return f"{head}\nNo committed ladder results under {root}: no rule to state yet.\n"
    return head + "\n" + "\n".join(rule_for_run(history, config, summaries)) + "\n"
