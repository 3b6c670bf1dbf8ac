"""Compare old-logprob scoring modes (arms) over seeds, with matched data order and sampling seeds.

    python trainers/compare.py --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_clone,fp16_clone}.yaml \\
        --seeds 0 1 --name arith-arms
    python trainers/compare.py --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_head}.yaml --seeds 0 \\
        --name quick --max_steps 5           # any flag after ours overrides every recipe (TrlParser flags)

Each arm is a recipe (its file name is the arm's label); each (arm, seed) run gets the same seed for data order and
sampling, and the global RNG is re-seeded right before `train()`, so same-seed runs draw identical step-1 rollouts in
every arm (seed 004: "the same seed gives identical step-1 rollouts across arms"); they part only once the arms'
different old log-probs have changed an update. Written under `OUTPUT_ROOT/NAME/`:
- `<arm>-s<seed>/log_history.json`: TRL's log rows of the run; `<arm>-s<seed>/first_rollouts.json`: step-1 prompts
  and completions;
- `comparison.png`: reward, `ratio/new_old/oob_rate`, `ratio/old_sampler/oob_rate`, `ratio/clip_flip_rate` per step
  (the keys that were logged), one line per run;
- `summary.json`, also printed as a table: last-k mean reward per arm and seed, its difference to the baseline arm
  (`bf16`) at the same seed, and per arm the mean over seeds and the seed-to-seed spread (max - min).
With `report_to` naming wandb, every run is a W&B run (offline unless `WANDB_MODE` says otherwise) in group NAME,
named `<arm>-s<seed>`. Final models are not saved. In-process use (tests, notebooks): `run_comparison`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback, set_seed

from grpo_ratio.plots import plot_metrics
from grpo_ratio.scripts.train import build_trainer, make_parser


RATIO_COLUMNS = {  # summary column -> logged key (mean over the run's logged steps)
    "new/old OOB": "ratio/new_old/oob_rate",
    "old/sampler OOB": "ratio/old_sampler/oob_rate",
    "clip flips": "ratio/clip_flip_rate",
}


class FirstRolloutRecorder(TrainerCallback):
    """Keeps the prompts and completions of the first generation batch of `trainer` (TRL's completion log, gathered
    across processes and sized to one generation batch), read at the end of optimizer step 1."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.prompts = None
        self.completions = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.completions is None:
            self.prompts = list(self.trainer._logs["prompt"])
            self.completions = list(self.trainer._logs["completion"])


@dataclass
class RunResult:
    """One (arm, seed) run: its log history and its step-1 rollouts."""

    arm: str
    seed: int
    history: list[dict]
    first_prompts: list
    first_completions: list
    run_dir: str


@dataclass
class Comparison:
    """Everything `run_comparison` produced: the runs, the summary (see `summarize`) and the written files."""

    runs: list[RunResult]
    summary: dict
    plot_path: str | None
    summary_path: str
    matched_first_rollouts: dict[int, bool] = field(default_factory=dict)


def last_k_mean(history: list[dict], key: str = "reward", k: int | None = 10) -> float | None:
    """Mean of `key` over the last `k` log rows that have it (fewer if the run logged fewer; every row when `k` is
    None); None if no row has it."""
    values = [row[key] for row in history if row.get(key) is not None]
    return statistics.fmean(values[-k:] if k else values) if values else None


def summarize(runs: Sequence[RunResult], last_k: int = 10, baseline: str = "bf16") -> dict:
    """Per run: last-k mean reward, its difference to the `baseline` arm at the same seed (None without a baseline
    run), and the run-mean of each `RATIO_COLUMNS` key. Per arm: mean over seeds of the last-k reward, mean
    difference to the baseline, and the seed-to-seed spread (max - min over seeds; 0 with one seed).

    Raises:
        ValueError: `last_k` < 1.
    """
    if last_k < 1:
        raise ValueError(f"last_k must be >= 1, got {last_k}")
    reward = {(r.arm, r.seed): last_k_mean(r.history, "reward", last_k) for r in runs}
    rows = []
    for r in runs:
        base = reward.get((baseline, r.seed))
        mine = reward[(r.arm, r.seed)]
        row = {
            "arm": r.arm,
            "seed": r.seed,
            "reward_last_k": mine,
            "diff_vs_baseline": None if base is None or mine is None else mine - base,
        }
        row.update({col: last_k_mean(r.history, key, k=None) for col, key in RATIO_COLUMNS.items()})
        rows.append(row)
    arms = {}
    for arm in dict.fromkeys(r.arm for r in runs):  # first-seen order
        values = [row["reward_last_k"] for row in rows if row["arm"] == arm and row["reward_last_k"] is not None]
        diffs = [row["diff_vs_baseline"] for row in rows if row["arm"] == arm and row["diff_vs_baseline"] is not None]
        arms[arm] = {
            "mean": statistics.fmean(values) if values else None,
            "mean_diff_vs_baseline": statistics.fmean(diffs) if diffs else None,
            "spread": max(values) - min(values) if values else None,
            "num_seeds": len(values),
        }
    return {"last_k": last_k, "baseline": baseline, "runs": rows, "arms": arms}


def print_summary(summary: dict, name: str) -> None:
    """Print `summary` as a rich table: one row per run, then one per arm (mean over seeds, spread)."""
    from rich.console import Console
    from rich.table import Table

    def fmt(x, signed=False):
        return "-" if x is None else (f"{x:+.4f}" if signed else f"{x:.4f}")

    k, base = summary["last_k"], summary["baseline"]
    table = Table(title=f"{name}: mean reward over the last {k} logged steps (ratio columns: mean over all steps)")
    table.add_column("arm", no_wrap=True, min_width=11)
    for col in ["seed", "reward", f"- {base}", *RATIO_COLUMNS, "seed spread"]:
        table.add_column(col, justify="right")
    for row in summary["runs"]:
        ratios = [fmt(row[c]) for c in RATIO_COLUMNS]
        table.add_row(
            row["arm"], str(row["seed"]), fmt(row["reward_last_k"]), fmt(row["diff_vs_baseline"], True), *ratios, ""
        )
    table.add_section()
    for arm, stats in summary["arms"].items():
        table.add_row(
            arm,
            f"all {stats['num_seeds']}",
            fmt(stats["mean"]),
            fmt(stats["mean_diff_vs_baseline"], True),
            *[""] * len(RATIO_COLUMNS),
            fmt(stats["spread"]),
        )
    Console(width=max(Console().width, 120)).print(table)  # not the 80 columns rich assumes without a terminal


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


def _run_one(arm: str, seed: int, build: Callable, name: str, run_dir: Path) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = build(arm, seed, run_dir)
    if trainer.args.seed != seed:
        raise ValueError(f"build({arm!r}, {seed}, ...) returned a trainer with args.seed={trainer.args.seed}")
    recorder = FirstRolloutRecorder(trainer)
    trainer.add_callback(recorder)
    wandb_run = _start_wandb(name, arm, seed, run_dir) if "wandb" in trainer.args.report_to else None
    set_seed(seed)  # same RNG state at the first generation in every arm (see the module docstring)
    try:
        trainer.train()
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    result = RunResult(
        arm, seed, list(trainer.state.log_history), recorder.prompts, recorder.completions, str(run_dir)
    )
    (run_dir / "log_history.json").write_text(json.dumps(result.history, indent=1))
    (run_dir / "first_rollouts.json").write_text(
        json.dumps({"prompts": result.first_prompts, "completions": result.first_completions}, indent=1)
    )
    del trainer, recorder
    gc.collect()  # one model at a time: free the last run's model and copies before the next
    return result


def run_comparison(
    arms: Sequence[str],
    seeds: Sequence[int],
    build: Callable,
    name: str = "comparison",
    output_root: str | Path = "runs/compare",
    last_k: int = 10,
    baseline: str = "bf16",
    show: bool = True,
) -> Comparison:
    """Train every (arm, seed), seed-major, and compare them.

    Args:
        arms: arm labels (distinct), passed to `build`.
        seeds: training seeds (data order and sampling).
        build: `build(arm, seed, run_dir) -> RatioGRPOTrainer` whose `args.seed == seed` and `args.output_dir ==
            run_dir`; everything else (task, model, recipe) is up to it. For W&B, give it `report_to=["wandb"]`.
        name: comparison name: the output folder and the W&B group.
        output_root: parent folder of `name`.
        last_k: logged steps averaged for the summary reward.
        baseline: arm the differences are taken to (`bf16`: TRL as shipped).
        show: print the summary table.

    Returns:
        A `Comparison`; `matched_first_rollouts[seed]` says whether all arms drew identical step-1 completions.

    Raises:
        ValueError: repeated arms or seeds, or `build` returned a trainer with another seed.
    """
    if len(set(arms)) != len(arms) or len(set(seeds)) != len(seeds):
        raise ValueError(f"arms and seeds must be distinct, got arms={list(arms)}, seeds={list(seeds)}")
    out = Path(output_root) / name
    runs = [_run_one(arm, seed, build, name, out / f"{arm}-s{seed}") for seed in seeds for arm in arms]
    summary = summarize(runs, last_k=last_k, baseline=baseline)
    matched = {s: len({json.dumps(r.first_completions) for r in runs if r.seed == s}) == 1 for s in seeds}
    summary["matched_first_rollouts"] = {str(s): m for s, m in matched.items()}
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=1))
    drawn = plot_metrics({f"{r.arm}-s{r.seed}": r.history for r in runs}, out / "comparison.png")
    if show:
        print_summary(summary, name)
        print(f"Step-1 rollouts identical across arms, per seed: {matched}")
        print(f"Summary: {summary_path}" + (f"\nPlot: {out / 'comparison.png'}" if drawn else ""))
    return Comparison(runs, summary, str(out / "comparison.png") if drawn else None, str(summary_path), matched)


def load_recipe(recipe: str, seed: int, run_dir: Path, overrides: Sequence[str] = ()):
    """`(script_args, training_args, model_args)` of `recipe` with the command-line `overrides`, then this run's
    seed, output_dir and run_name. A fresh parser per call: TrlParser keeps a recipe's values as its defaults."""
    run_args = ["--seed", str(seed), "--output_dir", str(run_dir), "--run_name", f"{Path(recipe).stem}-s{seed}"]
    return make_parser().parse_args_and_config(["--config", recipe, *overrides, *run_args])


def recipe_builder(recipes: dict[str, str], overrides: Sequence[str] = ()) -> Callable:
    """A `build(arm, seed, run_dir)` for `run_comparison` that trains `recipes[arm]` (see `load_recipe`)."""

    def build(arm, seed, run_dir):
        script_args, training_args, model_args = load_recipe(recipes[arm], seed, run_dir, overrides)
        return build_trainer(script_args, training_args, model_args)

    return build


def main(argv: Sequence[str] | None = None) -> Comparison:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", required=True, help="recipe YAMLs, one per arm (label = file name)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds")
    parser.add_argument("--name", default="comparison", help="comparison name: output folder and W&B group")
    parser.add_argument("--output_root", default="runs/compare", help="parent folder of NAME")
    parser.add_argument("--last_k", type=int, default=10, help="logged steps averaged for the summary reward")
    parser.add_argument("--baseline", default="bf16", help="arm the differences are taken to")
    args, overrides = parser.parse_known_args(argv)
    recipes = {Path(r).stem: r for r in args.recipes}
    if len(recipes) != len(args.recipes):
        parser.error(f"--recipes: two recipes share a file name (the arm label): {args.recipes}")
    missing = [r for r in args.recipes if not Path(r).is_file()]
    if missing:
        parser.error(f"--recipes: no such file: {', '.join(missing)}")
    for seed in args.seeds:  # parse every recipe first: a bad key or value fails before any training
        for r in recipes.values():
            load_recipe(r, seed, Path(args.output_root) / args.name / "check", overrides)
    return run_comparison(
        list(recipes),
        args.seeds,
        recipe_builder(recipes, overrides),
        name=args.name,
        output_root=args.output_root,
        last_k=args.last_k,
        baseline=args.baseline,
    )
