"""Compare old-logprob scoring arms over seeds, with matched data order and sampling seeds (`grpo-ratio compare`).

    python trainers/compare.py --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_clone,fp16_clone}.yaml \\
        --seeds 0 1 --name arith-arms
    python trainers/compare.py --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_head}.yaml --seeds 0 \\
        --name quick --max_steps 5           # any flag after ours overrides every recipe (TrlParser flags)
    python trainers/compare.py --render runs/compare/arith-arms/summary.json    # the markdown table of a comparison

Each arm is a recipe (its file name is the arm's label); each (arm, seed) run gets the same seed for data order and
sampling, and the global RNG is re-seeded right before `train()`, so same-seed runs draw identical step-1 rollouts in
every arm; they part only once the arms' different old log-probs have changed an update. An override may not change
what tells the arms apart (e.g. `--old_logprob_mode` when the recipes differ in it): the labels would lie.

Written under `OUTPUT_ROOT/NAME/`:
- `<arm>-s<seed>/log_history.json`: TRL's log rows of the run; `first_rollouts.json`: step-1 prompts and completions;
  `rollout_fingerprints.json`: a sha256 of every step's prompts and completions (the verdict's first divergence);
  `run.json`: the run's configuration, the machine it trained on and whether it finished;
- `comparison.png`: reward and the ratio metrics per step: per arm a colour, a marker and a small step offset (equal
  lines stay visible), per seed a line style;
- `summary.json`, also printed as a table: per arm and seed the last-k and whole-run mean reward, the difference to the
  baseline arm (`bf16`) at the same seed, the per-step reward noise and the run mean of each ratio metric; per arm the
  mean over seeds and the seed-to-seed spread (max - min), and the verdict against the baseline (`grpo_ratio.analysis.verdict`:
  paired by seed, with its interval, "not diverged yet", or "unknown" with the reason). Printed as a rich table on a
  terminal, as markdown (never cut to a width) in a log file.
A comparison that was interrupted resumes where it stopped: a finished run (its `run.json` says so, with the same
configuration) is read back, not trained again; a run of another configuration in the same folder is an error.
With `report_to` naming wandb, every run is a W&B run (offline unless `WANDB_MODE` says otherwise) in group NAME,
named `<arm>-s<seed>`. Final models are not saved. In-process use (tests, notebooks): `run_comparison`.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from transformers import TrainerCallback, set_seed

from grpo_ratio.analysis.plots import dtype_name, plot_comparison
from grpo_ratio.analysis.report import render_verdicts
from grpo_ratio.analysis.verdict import compare_arms, run_series
from grpo_ratio.cli.train import build_trainer, gate_stop, make_parser, trainer_of
from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.diagnostics.run_record import run_config, update_run_record, write_log_history
from grpo_ratio.machine import describe_machine, machine_record


RATIO_COLUMNS = {  # summary column -> logged key (mean over the run's logged steps)
    "new/old OOB": keys.NEW_OLD.oob_rate,
    "old/sampler OOB": keys.OLD_SAMPLER.oob_rate,
    "old/sampler OOB corrected": keys.OLD_SAMPLER_CORRECTED.oob_rate,
    "kept mass": keys.KEPT_MASS_MEAN,
    "clip flips": keys.CLIP_FLIP_RATE,
    "TRL clip": "clip_ratio/region_mean",
}


def rollout_fingerprint(prompts: Sequence, completions: Sequence) -> str:
    """sha256 (hex) of one step's prompts and completions (texts or chat messages) as canonical JSON: equal iff the
    step drew the same rollouts."""
    text = json.dumps([list(prompts), list(completions)], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class RolloutRecorder(TrainerCallback):
    """Keeps the prompts and completions of the first generation batch of `trainer` and a fingerprint of every
    optimizer step's (`rollout_fingerprint`), read at the end of each step from TRL's completion log (gathered across
    processes and sized to one generation batch, so it holds the latest generation's rollouts)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.prompts = None
        self.completions = None
        self.fingerprints: list[str] = []

    def on_step_end(self, args, state, control, **kwargs):
        prompts, completions = list(self.trainer._logs["prompt"]), list(self.trainer._logs["completion"])
        if self.completions is None:
            self.prompts, self.completions = prompts, completions
        self.fingerprints.append(rollout_fingerprint(prompts, completions))


class Progress(TrainerCallback):
    """One line per optimizer step across the whole comparison: run i/n, step, elapsed time and an ETA from the mean
    step time so far (every run is assumed to have `steps_per_run` steps)."""

    def __init__(self, name: str, num_runs: int, steps_per_run: int, stream=sys.stderr):
        self.name, self.num_runs, self.steps_per_run, self.stream = name, num_runs, steps_per_run, stream
        self.start, self.steps_done, self.run_index, self.label = time.monotonic(), 0, 0, ""

    def begin_run(self, index: int, label: str) -> None:
        self.run_index, self.label = index, label

    def skip_run(self) -> None:
        """A finished run read back from disk: its steps leave the remaining work, not the step-time mean."""
        self.num_runs -= 1

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_done += 1
        elapsed = time.monotonic() - self.start
        remaining = self.num_runs * self.steps_per_run - self.steps_done
        eta = elapsed / self.steps_done * max(remaining, 0)
        print(f"[{self.name}] run {self.run_index}/{self.num_runs} {self.label}: step {state.global_step}/"
              f"{state.max_steps} | {_hms(elapsed)} elapsed | ETA {_hms(eta)}", file=self.stream, flush=True)


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class RunResult:
    """One (arm, seed) run: its log history, its step-1 rollouts, and its configuration (`grpo_ratio.diagnostics.run_record.RUN_FIELDS`)."""

    arm: str
    seed: int
    history: list[dict]
    first_prompts: list
    first_completions: list
    run_dir: str
    config: dict = field(default_factory=dict)
    fingerprints: list[str] | None = None  # per optimizer step, `rollout_fingerprint` (None: not stored)
    machine: dict | None = None  # `grpo_ratio.machine.machine_record()` at the run's start (None: not recorded)


@dataclass
class Comparison:
    """Everything `run_comparison` produced: the runs, the summary (see `summarize`) and the written files."""

    runs: list[RunResult]
    summary: dict
    plot_path: str | None
    summary_path: str
    matched_first_rollouts: dict[int, bool] = field(default_factory=dict)
    resumed: list[str] = field(default_factory=list)


def logged(history: list[dict], key: str) -> list[float]:
    """The values of `key` over the log rows that have it, in step order."""
    return [row[key] for row in history if row.get(key) is not None]


def last_k_mean(history: list[dict], key: str = "reward", k: int | None = 10) -> float | None:
    """Mean of `key` over the last `k` log rows that have it (fewer if the run logged fewer; every row when `k` is
    None); None if no row has it."""
    values = logged(history, key)
    return statistics.fmean(values[-k:] if k else values) if values else None


def step_noise(values: Sequence[float]) -> float | None:
    """Per-step noise of a logged series: std of the step-to-step differences / sqrt(2), which a slow trend (the
    learning) barely moves; None with fewer than 3 values."""
    if len(values) < 3:
        return None
    return statistics.stdev(b - a for a, b in zip(values, values[1:], strict=False)) / math.sqrt(2)


def summarize(runs: Sequence[RunResult], last_k: int = 10, baseline: str = "bf16") -> dict:
    """Per run: last-k and whole-run mean reward, their differences to the `baseline` arm at the same seed (None
    without a baseline run), the per-step reward noise, and the run-mean of each `RATIO_COLUMNS` key. Per arm: mean
    over seeds of the last-k reward, mean difference to the baseline, and the seed-to-seed spread (max - min over
    seeds; None with one seed: not measured, which a 0 would hide). `last_k_used` is the number of steps actually averaged (fewer when runs logged fewer).

    Raises:
        ValueError: `last_k` < 1.
    """
    if last_k < 1:
        raise ValueError(f"last_k must be >= 1, got {last_k}")
    reward = {(r.arm, r.seed): last_k_mean(r.history, "reward", last_k) for r in runs}
    whole = {(r.arm, r.seed): last_k_mean(r.history, "reward", None) for r in runs}
    rows = []
    for r in runs:
        base, base_whole = reward.get((baseline, r.seed)), whole.get((baseline, r.seed))
        mine, mine_whole = reward[(r.arm, r.seed)], whole[(r.arm, r.seed)]
        row = {
            "arm": r.arm,
            "seed": r.seed,
            "steps": len(logged(r.history, "reward")),
            "reward_last_k": mine,
            "reward_mean": mine_whole,
            "diff_vs_baseline": None if base is None or mine is None else mine - base,
            "diff_mean_vs_baseline": None if base_whole is None or mine_whole is None else mine_whole - base_whole,
            "reward_step_noise": step_noise(logged(r.history, "reward")),
            "config": r.config,
        }
        row.update({col: last_k_mean(r.history, key, k=None) for col, key in RATIO_COLUMNS.items()})
        rows.append(row)
    arms = {}
    for arm in dict.fromkeys(r.arm for r in runs):  # first-seen order
        values = [row["reward_last_k"] for row in rows if row["arm"] == arm and row["reward_last_k"] is not None]
        diffs = [row["diff_vs_baseline"] for row in rows if row["arm"] == arm and row["diff_vs_baseline"] is not None]
        noise = [row["reward_step_noise"] for row in rows if row["arm"] == arm and row["reward_step_noise"] is not None]
        arms[arm] = {
            "mean": statistics.fmean(values) if values else None,
            "mean_diff_vs_baseline": statistics.fmean(diffs) if diffs else None,
            "spread": max(values) - min(values) if len(values) > 1 else None,
            "reward_step_noise": statistics.fmean(noise) if noise else None,
            "num_seeds": len(values),
        }
    steps = [row["steps"] for row in rows if row["steps"]]
    series = [run_series(r.arm, r.seed, r.history, r.fingerprints) for r in runs]
    verdicts = [asdict(v) for v in compare_arms(series, baseline, last_k)]
    return {"last_k": last_k, "last_k_used": min([last_k, *steps]), "baseline": baseline, "runs": rows, "arms": arms,
            "verdicts": verdicts, "machines": sorted({describe_machine(r.machine, load=False) for r in runs})}


SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "temperature")


def _why_unmatched(runs: Sequence[RunResult]) -> str:
    """Why step-1 rollouts differ across arms: the arms sample differently (expected), or nothing explains it."""
    differ = [k for k in SAMPLING_FIELDS if len({json.dumps((r.config or {}).get(k)) for r in runs}) > 1]
    if differ:
        return (f"Expected: the arms sample differently ({', '.join(differ)} differ), so their rollouts differ from "
                f"step 1 and reward differences mix the sampling change with the scoring arm.")
    return ("Unexpected: the arms share their sampling settings; check that the recipes share model, data and "
            "generation settings (a nondeterministic kernel can also do this).")


def _fmt(x, signed=False, digits=4):
    return "-" if x is None else (f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}")


def print_summary(summary: dict, name: str, stream=None) -> None:
    """Print `summary`: on a terminal a rich table (one row per run, then one per arm); otherwise (a log file, a pipe)
    the markdown table of `render_markdown`, whose lines are never cut to a terminal width. Then the verdict."""
    stream = stream or sys.stdout
    if stream.isatty():
        _print_rich(summary, name, stream)
    else:
        print(f"{name}:\n\n{render_markdown(summary)}", file=stream)
    print(render_verdicts(summary.get("verdicts", []), summary["baseline"], summary["last_k_used"]), file=stream)


def _print_rich(summary: dict, name: str, stream) -> None:
    from rich.console import Console
    from rich.table import Table

    k, base = summary["last_k_used"], summary["baseline"]
    table = Table(title=f"{name}: mean reward over the last {k} logged steps (ratio columns: mean over all steps)")
    table.add_column("arm", overflow="fold", min_width=11)
    for col in ["seed", "reward", f"- {base}", "step noise", *RATIO_COLUMNS, "seed spread"]:
        table.add_column(col, justify="right", overflow="fold")  # fold, never "…": a narrow window loses no digit
    for row in summary["runs"]:
        ratios = [_fmt(row[c]) for c in RATIO_COLUMNS]
        table.add_row(row["arm"], str(row["seed"]), _fmt(row["reward_last_k"]),
                      _fmt(row["diff_vs_baseline"], True), _fmt(row["reward_step_noise"]), *ratios, "")
    table.add_section()
    for arm, stats in summary["arms"].items():
        table.add_row(arm, f"{stats['num_seeds']} seed(s)", _fmt(stats["mean"]), _fmt(stats["mean_diff_vs_baseline"], True),
                      _fmt(stats["reward_step_noise"]), *[""] * len(RATIO_COLUMNS), _fmt(stats["spread"]))
    Console(file=stream).print(table)


def render_markdown(summary: dict, command: str | None = None) -> str:
    """The comparison as markdown (for the docs): one row per run, then one per arm."""
    k, base = summary["last_k_used"], summary["baseline"]
    lines = [f"`{command}`\n" if command else "",
             f"Trained on: {'; '.join(summary['machines'])}.\n" if summary.get("machines") else "",
             f"Reward: mean over the last {k} logged steps and over the whole run; differences to `{base}` at the "
             f"same seed; step noise = std of step-to-step reward changes / sqrt(2). Ratio columns: run means.\n",
             "| arm | seed | steps | reward last-k | - " + base + " | reward whole run | - " + base + " | step noise | "
             + " | ".join(RATIO_COLUMNS) + " |",
             "|---" * (8 + len(RATIO_COLUMNS)) + "|"]
    for row in summary["runs"]:
        lines.append(f"| {row['arm']} | {row['seed']} | {row['steps']} | {_fmt(row['reward_last_k'], digits=3)} | "
                     f"{_fmt(row['diff_vs_baseline'], True, 3)} | {_fmt(row['reward_mean'], digits=3)} | "
                     f"{_fmt(row['diff_mean_vs_baseline'], True, 3)} | {_fmt(row['reward_step_noise'], digits=3)} | "
                     + " | ".join(_fmt(row[c], digits=3) for c in RATIO_COLUMNS) + " |")
    lines += ["", f"| arm | seeds | reward last-k, mean over seeds | - {base} | seed-to-seed spread | step noise |",
              "|---|---|---|---|---|---|"]
    for arm, stats in summary["arms"].items():
        lines.append(f"| {arm} | {stats['num_seeds']} | {_fmt(stats['mean'], digits=3)} | "
                     f"{_fmt(stats['mean_diff_vs_baseline'], True, 3)} | {_fmt(stats['spread'], digits=3)} | "
                     f"{_fmt(stats['reward_step_noise'], digits=3)} |")
    return "\n".join(line for line in lines if line != "") + "\n"


def _start_wandb(name: str, arm: str, seed: int, run_dir: Path):
    import wandb

    os.environ.setdefault("WANDB_MODE", "offline")
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "grpo-ratio"),
        group=name,
        name=f"{arm}-s{seed}",
        dir=str(run_dir),
        config={"arm": arm, "seed": seed, "comparison": name},
    )


def _differences(stored, asked) -> str:
    """The recipe keys and override flags (both values) in which two run fingerprints (`main`'s JSON) differ."""
    def fields(text) -> dict:
        try:
            data = json.loads(text or "{}")  # a run.json of an older version may hold none
        except ValueError:  # a fingerprint given in-process as plain text
            return {"fingerprint": text}
        return {**(data.get("recipe") or {}), "flags": " ".join(data.get("overrides") or []) or "none"}
    old, new = fields(stored), fields(asked)
    return "; ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted({*old, *new})
                     if old.get(k) != new.get(k))


def _finished_run(arm: str, seed: int, run_dir: Path, fingerprint) -> RunResult | None:
    """The run stored in `run_dir` when it finished with the same `fingerprint`; None when there is none to resume.

    Raises:
        FileExistsError: `run_dir` holds a run of another configuration (never overwritten).
    """
    meta_path = run_dir / "run.json"
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("fingerprint") != fingerprint:
        differs = _differences(meta.get("fingerprint"), fingerprint)
        raise FileExistsError(f"{run_dir} holds a run of another configuration ({differs}); use another --name or "
                              f"--output_root, or delete that folder")
    if not meta.get("outputs_saved", meta.get("completed")):
        return None  # started, never finished: train it again (a gate-stopped arm's outputs are saved: kept)
    rollouts = json.loads((run_dir / "first_rollouts.json").read_text())
    history = json.loads((run_dir / "log_history.json").read_text())
    config = {**meta["config"], "weights_dtype": meta.get("weights_dtype")}  # how the plot names the arm
    return RunResult(arm, seed, history, rollouts["prompts"], rollouts["completions"], str(run_dir), config,
                     read_fingerprints(run_dir), meta.get("machine"))


FINGERPRINTS_FILE = "rollout_fingerprints.json"


def read_fingerprints(run_dir: str | Path) -> list[str] | None:
    """The per-step rollout fingerprints stored in `run_dir` (None for a run without them, e.g. recorded before
    they were stored)."""
    path = Path(run_dir) / FINGERPRINTS_FILE
    return json.loads(path.read_text())["fingerprints"] if path.is_file() else None


def _run_one(arm: str, seed: int, build: Callable, name: str, run_dir: Path, fingerprint, progress) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = build(arm, seed, run_dir)
    if trainer.args.seed != seed:
        raise ValueError(f"build({arm!r}, {seed}, ...) returned a trainer with args.seed={trainer.args.seed}")
    weights = dtype_name(next(trainer.accelerator.unwrap_model(trainer.model).parameters()).dtype)
    meta = {"arm": arm, "seed": seed, "fingerprint": fingerprint, "config": run_config(trainer.args),
            "weights_dtype": weights, "machine": machine_record(), "completed": False}
    update_run_record(run_dir, fresh=True, **meta)  # the trainer adds its "train_ended" (run_record.py)
    recorder = RolloutRecorder(trainer)
    trainer.add_callback(recorder)
    trainer.add_callback(progress)
    wandb_run = _start_wandb(name, arm, seed, run_dir) if "wandb" in trainer.args.report_to else None
    set_seed(seed)  # same RNG state at the first generation in every arm (see the module docstring)
    try:
        trainer.train()
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    result = RunResult(arm, seed, list(trainer.state.log_history), recorder.prompts, recorder.completions,
                       str(run_dir), {**meta["config"], "weights_dtype": weights}, recorder.fingerprints,
                       meta["machine"])
    if Path(trainer.args.output_dir).resolve() != run_dir.resolve():  # else the trainer wrote it (run_record.py)
        write_log_history(run_dir, result.history)
    (run_dir / "first_rollouts.json").write_text(
        json.dumps({"prompts": result.first_prompts, "completions": result.first_completions}, indent=1)
    )
    (run_dir / FINGERPRINTS_FILE).write_text(json.dumps(
        {"what": "sha256 of each optimizer step's prompts and completions (index i = step i + 1)",
         "fingerprints": result.fingerprints}, indent=1))
    # last: every output is saved (resuming the comparison keeps this arm); the run is complete unless the ratio gate
    # stopped it, which run.json then says first (completed false, gate_stop), as `grpo-ratio train` does
    update_run_record(run_dir, completed=gate_stop(trainer) is None, outputs_saved=True)
    del trainer, recorder
    gc.collect()  # one model at a time: free the last run's model and copies before the next
    return result


def run_comparison(arms: Sequence[str], seeds: Sequence[int], build: Callable, name: str = "comparison",
                   output_root: str | Path = "runs/compare", last_k: int = 10, baseline: str = "bf16", show: bool = True,
                   fingerprints: dict[str, object] | None = None, steps_per_run: int | None = None) -> Comparison:
    """Train every (arm, seed), seed-major, and compare them; finished runs already in the folder are read back.

    Args:
        arms: arm labels (distinct), passed to `build`.
        seeds: training seeds (data order and sampling).
        build: `build(arm, seed, run_dir) -> RatioGRPOTrainer` whose `args.seed == seed` and `args.output_dir ==
            run_dir`; everything else (task, model, recipe) is up to it. For W&B, give it `report_to=["wandb"]`.
        name: comparison name: the output folder and the W&B group.
        output_root: parent folder of `name`.
        last_k: logged steps averaged for the summary reward.
        baseline: arm the differences are taken to (`bf16`: TRL as shipped); it need not be among `arms`, but then
            no difference is computed (the command line refuses that).
        show: print the summary table.
        fingerprints: per arm, what identifies its configuration (e.g. the parsed recipe); a finished run is resumed
            only when its stored fingerprint matches. None: the arm label alone.
        steps_per_run: for the progress line's ETA (default: read from the first trainer's `max_steps`).

    Returns:
        A `Comparison`; `matched_first_rollouts[seed]` says whether all arms drew identical step-1 completions.

    Raises:
        ValueError: repeated arms or seeds, or `build` returned a trainer with another seed.
        FileExistsError: an (arm, seed) folder holds a run of another configuration.
    """
    if len(set(arms)) != len(arms) or len(set(seeds)) != len(seeds):
        raise ValueError(f"arms and seeds must be distinct, got arms={list(arms)}, seeds={list(seeds)}")
    out = Path(output_root) / name
    progress = Progress(name, len(arms) * len(seeds), steps_per_run or 0)
    runs, resumed = [], []
    for i, (seed, arm) in enumerate(((s, a) for s in seeds for a in arms), start=1):
        run_dir = out / f"{arm}-s{seed}"
        fingerprint = (fingerprints or {}).get(arm, arm)
        done = _finished_run(arm, seed, run_dir, fingerprint)
        if done is not None:
            runs.append(done)
            resumed.append(f"{arm}-s{seed}")
            progress.skip_run()
            continue
        progress.begin_run(i - len(resumed), f"({arm} s{seed})")
        runs.append(_run_one(arm, seed, _with_steps(build, progress), name, run_dir, fingerprint, progress))
    summary = summarize(runs, last_k=last_k, baseline=baseline)
    matched = {s: len({json.dumps(r.first_completions) for r in runs if r.seed == s}) == 1 for s in seeds}
    summary["matched_first_rollouts"] = {str(s): m for s, m in matched.items()}
    summary_path = out / "summary.json"
    out.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=1))
    drawn = plot_comparison(runs, out / "comparison.png", title=f"{name}: {len(arms)} arms x {len(seeds)} seeds")
    if show:
        print_summary(summary, name)
        if resumed:
            print(f"Read back finished runs (not trained again): {', '.join(resumed)}")
        print(f"Step-1 rollouts identical across arms, per seed: {matched}")
        if not all(matched.values()):
            print(_why_unmatched(runs))
        print(f"Summary: {summary_path}" + (f"\nPlot: {out / 'comparison.png'}" if drawn else ""))
    return Comparison(runs, summary, str(out / "comparison.png") if drawn else None, str(summary_path), matched,
                      resumed)


def _with_steps(build: Callable, progress: Progress) -> Callable:
    """`build`, teaching `progress` the number of steps per run from the first trainer it makes."""

    def wrapped(arm, seed, run_dir):
        trainer = build(arm, seed, run_dir)
        if not progress.steps_per_run:
            progress.steps_per_run = trainer.args.max_steps
        return trainer

    return wrapped


def load_recipe(recipe: str, seed: int, run_dir: Path, overrides: Sequence[str] = ()):
    """`(script_args, training_args, model_args)` of `recipe` with the command-line `overrides`, then this run's
    seed, output_dir and run_name. A fresh parser per call: TrlParser keeps a recipe's values as its defaults."""
    run_args = ["--seed", str(seed), "--output_dir", str(run_dir), "--run_name", f"{Path(recipe).stem}-s{seed}"]
    argv = ["--config", recipe, *overrides, *run_args]
    return make_parser(trainer_of(argv)).parse_args_and_config(argv)


def recipe_builder(recipes: dict[str, str], overrides: Sequence[str] = ()) -> Callable:
    """A `build(arm, seed, run_dir)` for `run_comparison` that trains `recipes[arm]` (see `load_recipe`)."""

    def build(arm, seed, run_dir):
        script_args, training_args, model_args = load_recipe(recipes[arm], seed, run_dir, overrides)
        return build_trainer(script_args, training_args, model_args)

    return build


def _parsed_fields(parsed) -> dict:
    """Every field of the parsed (script, training, model) arguments except the per-run ones, as plain values."""
    per_run = {"seed", "output_dir", "run_name", "logging_dir"}
    fields = {}
    for group in parsed:
        for key, value in vars(group).items():
            if key not in per_run and not key.startswith("_"):
                fields[key] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    return fields


def check_overrides(recipes: dict[str, str], overrides: Sequence[str], probe_dir: Path) -> dict[str, dict]:
    """Parse every recipe with and without `overrides`; refuse an override of a field the recipes differ in (the
    arm labels would name what did not run). Returns each arm's parsed fields with the overrides.

    Raises:
        ValueError: an override changes a field that tells the arms apart.
    """
    plain = {arm: _parsed_fields(load_recipe(r, 0, probe_dir)) for arm, r in recipes.items()}
    final = {arm: _parsed_fields(load_recipe(r, 0, probe_dir, overrides)) for arm, r in recipes.items()}
    defining = {k for k in next(iter(plain.values())) if len({json.dumps(p.get(k)) for p in plain.values()}) > 1}
    changed = sorted(k for k in defining if any(plain[a].get(k) != final[a].get(k) for a in recipes))
    if changed:
        values = "; ".join(f"{arm}: " + ", ".join(f"{k}={plain[arm].get(k)!r}" for k in changed) for arm in recipes)
        raise ValueError(f"--{changed[0]} overrides what tells the arms apart ({values}); the results would be "
                         f"labelled with arms that did not run. Remove the override, or make a recipe per arm.")
    return final


def main(argv: Sequence[str] | None = None) -> Comparison | None:
    parser = argparse.ArgumentParser(prog="grpo-ratio compare", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", help="recipe YAMLs, one per arm (label = file name)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds")
    parser.add_argument("--name", default="comparison", help="comparison name: output folder and W&B group")
    parser.add_argument("--output_root", default="runs/compare", help="parent folder of NAME")
    parser.add_argument("--last_k", type=int, default=10, help="logged steps averaged for the summary reward")
    parser.add_argument("--baseline", default="bf16", help="arm the differences are taken to (one of the arms)")
    parser.add_argument("--render", default=None, metavar="SUMMARY_JSON",
                        help="print the markdown table of a finished comparison's summary.json and exit")
    args, overrides = parser.parse_known_args(argv)
    if args.render:
        summary = json.loads(Path(args.render).read_text())
        print(render_markdown(summary, summary.get("command")), end="")
        return None
    if not args.recipes:
        parser.error("--recipes is required (or --render SUMMARY_JSON)")
    recipes = {Path(r).stem: r for r in args.recipes}
    if len(recipes) != len(args.recipes):
        parser.error(f"--recipes: two recipes share a file name (the arm label): {args.recipes}")
    missing = [r for r in args.recipes if not Path(r).is_file()]
    if missing:
        parser.error(f"--recipes: no such file: {', '.join(missing)}")
    per_run = [f for f in ("--seed", "--output_dir", "--run_name") if any(o.split("=")[0] == f for o in overrides)]
    if per_run:  # load_recipe sets them per (arm, seed): an override would be silently replaced
        parser.error(f"{per_run[0]} is set per run by compare (--seeds, --output_root/--name); remove it")
    if args.last_k < 1:
        parser.error(f"--last_k must be >= 1, got {args.last_k}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")
    if args.baseline not in recipes:
        parser.error(f"--baseline {args.baseline!r} is not an arm; the arms are: {', '.join(recipes)}")
    try:  # parse every recipe first: a bad key, a bad value or a mislabelling override fails before any training
        check_overrides(recipes, overrides, Path(args.output_root) / args.name / "check")
    except ValueError as err:
        parser.error(str(err))
    # a run is resumed only for the same recipe values and overrides (what the user asked for; comments may change)
    fingerprints = {arm: json.dumps({"recipe": yaml.safe_load(Path(r).read_text()), "overrides": list(overrides)},
                                    sort_keys=True) for arm, r in recipes.items()}
    try:
        comparison = run_comparison(list(recipes), args.seeds, recipe_builder(recipes, overrides), name=args.name,
                                    output_root=args.output_root, last_k=args.last_k, baseline=args.baseline,
                                    fingerprints=fingerprints)
    except FileExistsError as err:  # a folder of another configuration: found before any training
        parser.error(str(err))
    command = "python trainers/compare.py " + " ".join(sys.argv[1:] if argv is None else argv)
    comparison.summary["command"] = command
    Path(comparison.summary_path).write_text(json.dumps(comparison.summary, indent=1))
    return comparison
