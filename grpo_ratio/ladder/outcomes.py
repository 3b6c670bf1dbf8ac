"""What happened in each ladder cell, read from its run folder, and the verdicts between cells (files only).

A ladder folder (`results/ladders/<source>/`, written by `benchmarks/ladder.py`) holds one folder per setting, each
a `grpo-ratio compare` folder: `<correction>-s<seed>/{log_history,run,rollout_fingerprints,cell}.json` and the
comparison's `summary.json`. `cell.json` is the ladder's own record of a cell: source, setting, correction, seed,
testbed, the command that reproduces it, and its CPU and wall time.

Per run (`run_outcome`):
- the held-out reward: TRL's evaluation (`eval_dataset`, `eval_strategy="steps"`) logs `eval_reward` on prompts the
  run never trains on; `end` is its mean over the last `END_POINTS` evaluations, `auc` the area under its curve
  (trapezoid over the evaluated steps) divided by the steps spanned: a mean reward over training, in reward units. A
  run without evaluations falls back to the training `reward` (and says so: `metric`);
- collapse signals: entropy and completion length (first, last, min), TRL's `kl` (when beta > 0) and the largest k3
  of new/old and old/sampler, and grad-norm spikes (max / median grad norm);
- the step-1 diagnostics: the first logged row's out-of-band rates, k3, chi-square, ESS, kept mass and the
  attribution's largest term (where logged; names from `grpo_ratio.diagnostics.metric_keys`);
- the cost: the share of tokens a correction took out (IS weight 0, DPPO's mask, or PPO's clip, whichever the run
  logged), the mean ESS of its IS weights, and the cell's CPU and wall seconds;
- for an asynchronous run, the realized staleness: the mean over steps of TRL's `sample/staleness_mean` (weight syncs
  between a sample's policy and the update), which `max_staleness` caps and the two processes' speeds set.

Per (setting, correction), over seeds (`summarize_ladder`), three paired verdicts (`grpo_ratio.analysis.verdict`:
t-interval over seeds of the per-seed mean difference over the last `END_POINTS` evaluations):
- `loss`: the uncorrected run at this setting against the uncorrected run at the reference setting (no mismatch),
  same seed: did the mismatch cost reward;
- `gain`: this correction against the uncorrected run at the same setting and seed: did the correction change it;
- `gap`: this correction against the uncorrected run at the reference setting: is what it reached the reference's.
"""

from __future__ import annotations

import json
import shlex
import statistics
from dataclasses import asdict
from pathlib import Path

from ..analysis.verdict import RunSeries, Verdict, arm_verdict
from ..diagnostics import metric_keys as keys
from .definitions import LADDERS, STALENESS, Ladder


CELL_FILE = "cell.json"
LADDER_FILE = "ladder.json"
END_POINTS = 3  # evaluations averaged for the end reward (and the verdicts' window)
EVAL_REWARD = "eval_reward"

STEP1_KEYS = {  # step-1 diagnostic -> logged key
    "new/old OOB": keys.NEW_OLD.oob_rate,
    "old/sampler OOB": keys.OLD_SAMPLER.oob_rate,
    "old/sampler OOB corrected": keys.OLD_SAMPLER_CORRECTED.oob_rate,
    "old/sampler mean": keys.OLD_SAMPLER.mean,
    "old/sampler k3": keys.mismatch_key(keys.OLD_SAMPLER, "kl_k3"),
    "new/old k3": keys.mismatch_key(keys.NEW_OLD, "kl_k3"),
    "old/sampler chi2": keys.mismatch_key(keys.OLD_SAMPLER, "chi2_token"),
    "IS ESS": keys.IS_WEIGHT_ESS,
    "kept mass": keys.KEPT_MASS_MEAN,
}
REALIZED_STALENESS = "sample/staleness_mean"  # TRL's async trainer: mean weight syncs behind, per step
MASKED_KEYS = (  # what a correction took out of the loss, first logged wins
    keys.IS_ZERO_WEIGHT_TOKEN_FRAC, keys.TRUST_REGION_MASKED_FRAC, "clip_ratio/region_mean")


def _read(path: Path) -> dict | list:
    return json.loads(path.read_text())


def _train_rows(history: list[dict]) -> list[dict]:
    return [r for r in history if "loss" in r and "train_runtime" not in r]


def _values(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def reward_curve(history: list[dict]) -> tuple[str, list[int], list[float]]:
    """(metric, steps, values) of the held-out reward (`eval_reward`, step 0 included when evaluated at the start),
    or of the training `reward` when the run logged no evaluation."""
    rows = [r for r in history if r.get(EVAL_REWARD) is not None]
    key = EVAL_REWARD
    if not rows:
        key, rows = "reward", [r for r in _train_rows(history) if r.get("reward") is not None]
    return key, [int(r.get("step", i)) for i, r in enumerate(rows)], [float(r[key]) for r in rows]


def area_under_curve(steps: list[int], values: list[float]) -> float | None:
    """Trapezoid area under (steps, values) divided by the steps spanned (a mean in the values' unit); the single
    value for one point; None for none."""
    if not values:
        return None
    if len(values) == 1 or steps[-1] == steps[0]:
        return values[-1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for s0, s1, v0, v1 in zip(steps, steps[1:], values, values[1:]))
    return area / (steps[-1] - steps[0])


def _first_last_min(name: str, values: list[float]) -> dict:
    return {f"{name}_{k}": v for k, v in (("first", values[0]), ("last", values[-1]), ("min", min(values)))} \
        if values else {}


def step1_diagnostics(history: list[dict]) -> dict:
    """The first training row that logged `ratio/*` keys: each `STEP1_KEYS` value it has, and the attribution's
    largest term by share (`{"term", "share"}`) when `ratio_attribution` was on."""
    rows = [r for r in _train_rows(history) if any(k.startswith(keys.PREFIX + "/") for k in r)]
    if not rows:
        return {}
    row = rows[0]
    out = {name: row[key] for name, key in STEP1_KEYS.items() if row.get(key) is not None}
    shares = {t: row[keys.attribution_key(t, "share")] for t in keys.ATTRIBUTION_TERMS
              if row.get(keys.attribution_key(t, "share")) is not None}
    if shares:
        term = max(shares, key=shares.get)
        out["attribution largest"] = {"term": term, "share": shares[term]}
    return out


def run_outcome(run_dir: str | Path) -> dict:
    """Everything the ladder reads of one run folder (module docstring): `cell` (its cell.json, {} without one),
    `metric`, `steps`, `values`, `end`, `auc`, `collapse`, `step1`, `cost`.

    Raises:
        FileNotFoundError: no log_history.json in `run_dir`.
    """
    run_dir = Path(run_dir)
    history = _read(run_dir / "log_history.json")
    cell = _read(run_dir / CELL_FILE) if (run_dir / CELL_FILE).is_file() else {}
    metric, steps, values = reward_curve(history)
    train = _train_rows(history)
    grad = _values(train, "grad_norm")
    median = statistics.median(grad) if grad else None
    collapse = {
        **_first_last_min("entropy", _values(train, "entropy")),
        **_first_last_min("length", _values(train, "completions/mean_length")),
        "kl_max": max(_values(train, "kl"), default=None),
        "new_old_k3_max": max(_values(train, keys.mismatch_key(keys.NEW_OLD, "kl_k3")), default=None),
        "old_sampler_k3_max": max(_values(train, keys.mismatch_key(keys.OLD_SAMPLER, "kl_k3")), default=None),
        "grad_norm_spike": max(grad) / median if grad and median else None,
    }
    masked_key = next((k for k in MASKED_KEYS if _values(train, k)), None)
    ess = _values(train, keys.IS_WEIGHT_ESS)
    cost = {"masked_key": masked_key,
            "masked_share": statistics.fmean(_values(train, masked_key)) if masked_key else None,
            "ess": statistics.fmean(ess) if ess else None,
            "cpu_s": cell.get("cpu_s"), "wall_s": cell.get("wall_s")}
    realized = _values(train, REALIZED_STALENESS)
    return {"cell": cell, "metric": metric, "steps": steps, "values": values,
            "end": statistics.fmean(values[-END_POINTS:]) if values else None,
            "auc": area_under_curve(steps, values), "collapse": collapse, "step1": step1_diagnostics(history),
            "cost": cost, "realized_staleness": statistics.fmean(realized) if realized else None}


def read_cells(folder: str | Path) -> list[dict]:
    """`run_outcome` of every finished cell under a ladder folder (`<setting>/<correction>-s<seed>/cell.json` with
    its run.json saying its outputs are saved), in setting, correction, seed order."""
    out = []
    for cell_file in sorted(Path(folder).glob(f"*/*/{CELL_FILE}")):
        run = cell_file.parent
        record = _read(run / "run.json") if (run / "run.json").is_file() else {}
        if not record.get("outputs_saved", record.get("completed")) or not (run / "log_history.json").is_file():
            continue
        out.append(run_outcome(run))
    return out


def _series(outcome: dict, arm: str) -> RunSeries:
    return RunSeries(arm, int(outcome["cell"]["seed"]), outcome["steps"], outcome["values"])


def _verdict(runs: list[dict], bases: list[dict], arm: str) -> dict:
    """`arm_verdict` of `runs` against `bases` (per seed), over the last `END_POINTS` evaluations, as a dict."""
    verdict: Verdict = arm_verdict([_series(o, arm) for o in runs],
                                   {int(o["cell"]["seed"]): _series(o, "base") for o in bases}, END_POINTS)
    out = asdict(verdict)
    out.pop("divergence")  # rollout fingerprints are the compare's business; evaluation rows carry none
    out["interval"] = list(verdict.interval) if verdict.interval else None
    return out


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def cell_distance(lad: Ladder, setting: str, runs: list[dict]) -> float | None:
    """The distance of a setting as the rule reads it: the setting's value for a configuration distance (staleness),
    else the mean over runs of the step-1 logged key (1 - it for `one_minus`)."""
    if lad.distance.key == STALENESS:
        return float(lad.setting(setting).value)
    name = next((n for n, k in STEP1_KEYS.items() if k == lad.distance.key), None)
    value = _mean([o["step1"].get(name) for o in runs]) if name else None
    return None if value is None else (1.0 - value if lad.distance.one_minus else value)


def summarize_ladder(folder: str | Path) -> dict:
    """The ladder summary of a folder: source, testbed, and per setting (in the ladder's order) its distance and,
    per correction, the seeds, mean end reward and AUC, the three verdicts (module docstring), the mean step-1
    diagnostics, collapse signals and cost, and each cell's command.

    Raises:
        FileNotFoundError: no finished cell under `folder`.
        ValueError: cells of several sources or testbeds in one folder, or a source without a ladder definition.
    """
    cells = read_cells(folder)
    if not cells:
        raise FileNotFoundError(f"{folder}: no finished ladder cell (<setting>/<correction>-s<seed>/cell.json)")
    sources = {o["cell"]["source"] for o in cells}
    testbeds = {o["cell"].get("testbed") for o in cells}
    if len(sources) != 1 or len(testbeds) != 1:
        raise ValueError(f"{folder}: one ladder per folder, found sources {sorted(sources)}, testbeds "
                         f"{sorted(map(str, testbeds))}")
    lad = LADDERS.get(next(iter(sources)))
    if lad is None:
        raise ValueError(f"{folder}: source {next(iter(sources))!r} has no ladder; known: {', '.join(LADDERS)}")
    by = {}
    for o in cells:
        by.setdefault((o["cell"]["setting"], o["cell"]["correction"]), []).append(o)
    none, ref = lad.uncorrected.name, lad.reference
    settings = {}
    for s in (x.name for x in lad.settings):
        if not any(key[0] == s for key in by):
            continue
        base = by.get((s, none), [])
        at_s = base or [o for key, runs in by.items() if key[0] == s for o in runs]
        entry = {"value": lad.setting(s).value, "distance": cell_distance(lad, s, at_s),
                 "realized_staleness": _mean([o["realized_staleness"] for key, runs in by.items() if key[0] == s
                                              for o in runs]),
                 "corrections": {}}
        for c in (x.name for x in lad.corrections):
            runs = by.get((s, c))
            if not runs:
                continue
            item = {
                "seeds": sorted(int(o["cell"]["seed"]) for o in runs),
                "metric": runs[0]["metric"],
                "end": _mean([o["end"] for o in runs]),
                "auc": _mean([o["auc"] for o in runs]),
                "step1": {n: _mean([o["step1"].get(n) for o in runs]) for n in STEP1_KEYS
                          if any(o["step1"].get(n) is not None for o in runs)},
                "collapse": {n: _mean([o["collapse"].get(n) for o in runs])
                             for n in dict.fromkeys(k for o in runs for k in o["collapse"])},
                "cost": {n: _mean([o["cost"].get(n) for o in runs]) for n in ("masked_share", "ess", "cpu_s",
                                                                                "wall_s")},
                "masked_key": runs[0]["cost"]["masked_key"],
                "largest_term": runs[0]["step1"].get("attribution largest"),
                "commands": [o["cell"].get("command") for o in runs],
            }
            if c == none and s != ref and by.get((ref, none)):
                item["loss"] = _verdict(runs, by[(ref, none)], c)
            if c != none and base:
                item["gain"] = _verdict(runs, base, c)
            if c != none and by.get((ref, none)):
                item["gap"] = _verdict(runs, by[(ref, none)], c)
            entry["corrections"][c] = item
        settings[s] = entry
    return {"source": lad.source, "testbed": next(iter(testbeds)), "sets": common_sets(cells), "uncorrected": none,
            "reference": ref, "distance": asdict(lad.distance), "end_points": END_POINTS, "settings": settings}


def common_sets(cells: list[dict]) -> dict:
    """The `--set KEY=VALUE` values every cell's command carries (the testbed changed for the whole ladder, e.g. a
    learning rate), as {KEY: VALUE} strings; {} when none."""
    found = []
    for o in cells:
        argv = shlex.split(o["cell"].get("command") or "")
        found.append({a.split("=", 1)[0]: a.split("=", 1)[1] for flag, a in zip(argv, argv[1:]) if flag == "--set"})
    return {k: v for k, v in found[0].items() if all(f.get(k) == v for f in found)} if found else {}


def find_ladders(root: str | Path) -> list[Path]:
    """The ladder folders directly under `root` (each holding `<setting>/<run>/cell.json`), sorted; [] when `root`
    does not exist."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob(f"*/*/{CELL_FILE}")))


def write_summary(folder: str | Path) -> Path:
    """Write `summarize_ladder(folder)` to `<folder>/ladder.json` and return its path."""
    path = Path(folder) / LADDER_FILE
    path.write_text(json.dumps(summarize_ladder(folder), indent=1) + "\n")
    return path
