"""GRPO with an honest importance ratio: one run of `RatioGRPOTrainer` from a recipe (`grpo-ratio train` and the
runnable script `trainers/grpo.py` call `main` here).

    python trainers/grpo.py --config recipes/smollm2-135m/arithmetic/fp32_clone.yaml
    grpo-ratio train --config recipes/smollm2-135m/arithmetic/fp32_clone.yaml         # the same, as a console command
    python trainers/grpo.py --config recipes/smollm2-135m/arithmetic/bf16.yaml --max_steps 3 --seed 1
    accelerate launch --multi_gpu --num_processes 2 trainers/grpo.py --config recipes/smollm2-135m/gsm8k/fp16_clone.yaml

(`--multi_gpu` also on CPU, where it means two gloo processes; `--cpu --num_processes 2` starts two independent
single-process runs instead.)

Every `RatioGRPOConfig` (= `trl.GRPOConfig` + grpo_ratio) field, every `trl.ModelConfig` field and the task fields of
`GRPOScriptArguments` are flags; a flag on the command line overrides the recipe's value. An unknown recipe key, an
unknown scoring mode, a missing data path or an unreadable model fails before any training step.

Writes to `output_dir`: the model (unless `--save_final_model false`), `log_history.json` (TRL's log rows: reward,
`ratio/*`, `clip_ratio/*`, ...) and `run.json` (the fields `grpo-ratio report` reads: mode, correction, sampling;
`"completed": true` once every output of a run that reached its end is written; `"completed": false`,
`"stopped_by_gate"` and `"gate_stop"` (step, check, value) when `ratio_gate_action: stop` stopped it),
both written by the trainer as it trains (`grpo_ratio/diagnostics/run_record.py`), `metrics.png` (those curves per
step) and, with `report_to: [wandb]`, an offline W&B run under `output_dir/wandb` (`WANDB_MODE=offline` unless you set
it; upload later with `wandb sync`).

Exit status: 0 trained to the end; 2 a set-up error (one line `grpo-ratio train: error: ...`); 3 stopped by the ratio
gate (`ratio_gate_action: stop`: the failing check on stderr and in `run.json`, every output saved); 1 any other
error.
A run refuses to start over a finished one (an `output_dir` holding `log_history.json`, and no `run.json` saying
the run was cut short) unless it resumes it (`--resume_from_checkpoint`) or `--overwrite_output_dir true` says to
replace it.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback, set_seed
from trl import ModelConfig, TrlParser, get_peft_config

from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer, RatioRLOOConfig, RatioRLOOTrainer
from grpo_ratio.analysis.plots import plot_metrics, run_title
from grpo_ratio.diagnostics.gate_callback import RatioGateCallback
from grpo_ratio.diagnostics.run_record import (
    GATE_STOP_EXIT_CODE,
    LOG_HISTORY_FILE,
    read_run_record,
    run_finished,
    update_run_record,
)
from grpo_ratio.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from grpo_ratio.tasks import TASKS, load_task


# `trainer` (a recipe key and flag): which TRL trainer a run extends, and its config class (docs/rloo.md)
TRAINERS = {"grpo": (RatioGRPOConfig, RatioGRPOTrainer), "rloo": (RatioRLOOConfig, RatioRLOOTrainer)}
TRAINER_NAMES = tuple(TRAINERS)


@dataclass
class GRPOScriptArguments:
    """Task and data of a run; `None` leaves the task's own default (see `grpo_ratio.tasks`)."""

    trainer: str = field(
        default="grpo",
        metadata={"help": "Which TRL trainer the run extends: 'grpo' (RatioGRPOTrainer, trl.GRPOTrainer) or 'rloo' "
                  "(RatioRLOOTrainer, trl.RLOOTrainer; its config fields, docs/rloo.md).",
                  "choices": list(TRAINER_NAMES)},
    )

    task: str = field(
        default="arithmetic", metadata={"help": "Task: 'arithmetic' (built in) or 'gsm8k'.", "choices": list(TASKS)}
    )
    dataset_path: str | None = field(
        default=None,
        metadata={"help": "gsm8k: a .jsonl file or a folder with train.jsonl/test.jsonl; unset = openai/gsm8k (hub)."},
    )
    dataset_split: str | None = field(default=None, metadata={"help": "gsm8k: 'train' (default) or 'test'."})
    num_examples: int | None = field(
        default=None, metadata={"help": "Rows of the training set (gsm8k: shuffled with task_seed, then cut)."}
    )
    task_seed: int | None = field(
        default=None, metadata={"help": "Seed of the task data (arithmetic problems, gsm8k shuffle), not of training."}
    )
    reward: str | None = field(
        default=None,
        metadata={
            "help": "gsm8k: 'lenient' (default, as in the batch-logprob-gap report, "
            "github.com/GuoCheng24/batch-logprob-gap: the completion's last number) or 'strict' (its last "
            "'#### <integer>')."
        },
    )
    max_operand: int | None = field(default=None, metadata={"help": "arithmetic: operands in [1, max_operand]."})
    operations: str | None = field(default=None, metadata={"help": "arithmetic: operators, e.g. '+' or '+-'."})
    save_final_model: bool = field(
        default=True,
        metadata={"help": "Save the trained model to output_dir (on unless --save_final_model false; the recipes set "
                  "it false)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Train even when output_dir already holds a finished run (its log_history.json), replacing its "
            "outputs. Off: such a run refuses to start, unless --resume_from_checkpoint continues it; give each "
            "seed its own --output_dir instead (e.g. --seed 1 --output_dir runs/.../<arm>-s1)."
        },
    )


# script argument -> keyword of the task loader (`grpo_ratio.tasks.load_task`)
_TASK_KWARGS = {
    "dataset_path": "dataset_path",
    "dataset_split": "split",
    "num_examples": "num_examples",
    "task_seed": "seed",
    "reward": "reward",
    "max_operand": "max_operand",
    "operations": "operations",
}


def task_kwargs(script_args: GRPOScriptArguments) -> dict:
    """The task-loader keywords set in `script_args` (unset ones are left to the task's defaults).

    Raises:
        ValueError: a flag the task does not take, named by its flag (`--dataset_path`), not the loader's keyword.
    """
    values = {kw: getattr(script_args, name) for name, kw in _TASK_KWARGS.items()}
    if script_args.task in TASKS:  # an unknown task is load_task's error
        takes = inspect.signature(TASKS[script_args.task]).parameters
        refused = [f"--{name}" for name, kw in _TASK_KWARGS.items() if values[kw] is not None and kw not in takes]
        if refused:
            accepted = [f"--{name}" for name, kw in _TASK_KWARGS.items() if kw in takes]
            raise ValueError(f"task={script_args.task!r} does not take {', '.join(refused)}; it takes: "
                             f"{', '.join(accepted)}")
    return {kw: v for kw, v in values.items() if v is not None}


def check_output_dir(script_args: GRPOScriptArguments, training_args: RatioGRPOConfig) -> None:
    """Refuse to start a run whose `output_dir` already holds a finished run's `log_history.json`: the recipes name
    one `output_dir` per arm, so re-running one (say with another `--seed`) would silently overwrite the first run's
    log, plot and model. Resuming (`--resume_from_checkpoint`) and `--overwrite_output_dir true` are allowed, and so
    is a run over one that was cut short (its `run.json` says it did not finish: nothing but its partial log to lose,
    as before the trainer wrote its log while training).

    Raises:
        FileExistsError: naming the finished run and the ways on (resuming only where a checkpoint exists).
    """
    finished = Path(training_args.output_dir) / LOG_HISTORY_FILE
    if not finished.is_file() or training_args.resume_from_checkpoint or script_args.overwrite_output_dir:
        return
    try:
        record = read_run_record(finished.parent)
    except ValueError:  # not a run record of ours: a finished run of unknown origin, never overwritten
        record = {}
    if not run_finished(record):
        return
    # resuming needs a checkpoint; the recipes save none (save_strategy "no"), so offer it only where one exists
    checkpoints = sorted(finished.parent.glob("checkpoint-*"))
    resume = (f", --resume_from_checkpoint {checkpoints[-1]} to continue it" if checkpoints else "")
    raise FileExistsError(
        f"output_dir={training_args.output_dir!r} already holds a finished run ({finished}); this run would "
        f"overwrite it. Pass another --output_dir (one per seed, e.g. --seed {training_args.seed} --output_dir "
        f"{training_args.output_dir.rstrip('/')}-s{training_args.seed}){resume} or --overwrite_output_dir true to "
        f"replace it."
    )


def configure_reporting(training_args: RatioGRPOConfig) -> None:
    """With `report_to` naming wandb: offline W&B under `output_dir/wandb`, project `grpo-ratio`, unless the
    environment already says otherwise (`WANDB_MODE`, `WANDB_PROJECT`, `WANDB_DIR`)."""
    if "wandb" not in training_args.report_to:
        return
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_PROJECT", "grpo-ratio")
    if "WANDB_DIR" not in os.environ:
        os.makedirs(training_args.output_dir, exist_ok=True)
        os.environ["WANDB_DIR"] = os.path.abspath(training_args.output_dir)


def build_trainer(script_args, training_args, model_args, callbacks=None) -> RatioGRPOTrainer:
    """Data, model and `RatioGRPOTrainer` of a run, in that order, so that a bad data path fails before the model
    is loaded.

    Raises:
        ValueError: unknown task, or a task keyword the task does not take.
        FileNotFoundError: missing data path or model directory.
        OSError: the model can be found neither locally, on the hub, nor (SmolLM2-135M-Instruct) as GGUF; or its
            tokenizer is unreadable.
    """
    ################
    # Data: the task's prompts and reward functions
    ################
    train_dataset, reward_funcs = load_task(script_args.task, **task_kwargs(script_args))

    ################
    # Model: a local directory (hub cache, hub, or the converted GGUF), loaded by TRL with model_init_kwargs
    ################
    model_path = resolve_model_path(model_args.model_name_or_path or DEFAULT_MODEL, revision=model_args.model_revision)
    tokenizer = load_tokenizer(model_path, require_chat_template=True)  # the tasks' prompts are conversational
    model_init_kwargs = {
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    ################
    # Trainer
    ################
    trainer_class = TRAINERS[script_args.trainer][1]  # RatioGRPOTrainer or RatioRLOOTrainer
    return trainer_class(
        model=model_path,  # a path, not a model object: TRL re-loads it as the reference model when beta != 0
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )


class FirstStepEstimate(TrainerCallback):
    """After the first optimizer step, print how long it took and what the remaining steps will take at that pace
    (the first step also pays the warm-up, so the estimate errs long), on the main process only."""

    def __init__(self, print_fn=print):
        self.print_fn = print_fn

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1 or not state.is_world_process_zero or not hasattr(self, "start"):
            return
        seconds, left = time.perf_counter() - self.start, max(state.max_steps - 1, 0)
        self.print_fn(f"grpo-ratio: step 1 took {seconds:.0f} s; at that pace the other {left} steps take about "
                      f"{_duration(seconds * left)} on this machine (step 1 includes warm-up)")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400 else \
        f"{seconds / 3600:.1f} h"


def wandb_run_dir() -> str | None:
    """Folder of the active W&B run (e.g. `.../wandb/offline-run-...`), or None."""
    import wandb

    return str(Path(wandb.run.dir).parent) if wandb.run is not None else None


def setup(script_args, training_args, model_args) -> RatioGRPOTrainer:
    """Everything before training: never over a finished run, W&B offline by default, a readable run name, the
    seed, then data, model and trainer (`build_trainer`). Raises what they raise (see `build_trainer`)."""
    check_output_dir(script_args, training_args)
    configure_reporting(training_args)
    if training_args.run_name is None:
        training_args.run_name = f"{training_args.old_logprob_mode}-s{training_args.seed}"
    set_seed(training_args.seed)
    return build_trainer(script_args, training_args, model_args, callbacks=[FirstStepEstimate()])


def main(script_args, training_args, model_args, trainer: RatioGRPOTrainer | None = None):
    """Train one run (`setup` first unless `trainer` is the one it built), save its model and plot, and mark its
    run.json completed (the trainer wrote the log history and the rest of run.json as it trained)."""
    trainer = trainer or setup(script_args, training_args, model_args)

    ################
    # Train
    ################
    # Re-seed: scoring modes build different copies in __init__, which may draw from the global RNG; from here on
    # every arm with the same seed draws the same first rollouts (trainers/compare.py relies on it).
    set_seed(training_args.seed)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    stopped_by = gate_stop(trainer)
    if stopped_by is None:
        trainer.accelerator.print("Training completed.")
    elif trainer.accelerator.is_main_process:
        print(f"grpo-ratio train: stopped by the ratio gate at step {trainer.state.global_step}: {stopped_by} failed "
              f"(ratio_gate_action='stop'); outputs are saved, exit status {GATE_STOP_EXIT_CODE}", file=sys.stderr)

    ################
    # Save: model, log history, plot
    ################
    out = Path(training_args.output_dir)
    if script_args.save_final_model:
        trainer.save_model(str(out))
    wandb_dir = wandb_run_dir() if "wandb" in training_args.report_to else None
    if trainer.accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)  # save_strategy "no" and no final save: nothing created it yet
        # log_history.json and run.json's "config" (the fields `grpo-ratio report` reads: which mode, which
        # correction) were written by the trainer (RunRecordCallback); every output is saved now, and the run is
        # complete unless the gate stopped it (then "completed" stays false, as the gate wrote it)
        update_run_record(out, completed=stopped_by is None, outputs_saved=True)
        title = run_title(model_args.model_name_or_path or DEFAULT_MODEL, training_args, trainer.state.global_step,
                          next(trainer.accelerator.unwrap_model(trainer.model).parameters()).dtype)
        band = (training_args.ratio_band_low, training_args.ratio_band_high)
        drawn = plot_metrics({training_args.run_name: trainer.state.log_history}, out / "metrics.png", title, band)
        trainer.accelerator.print(f"Log history: {out / LOG_HISTORY_FILE}")
        if drawn:
            trainer.accelerator.print(f"Plot ({', '.join(drawn)}): {out / 'metrics.png'}")
        if wandb_dir:
            trainer.accelerator.print(f"W&B run: {wandb_dir} (offline runs: upload with `wandb sync {wandb_dir}`)")
    if wandb_dir:
        import wandb

        wandb.finish()  # transformers' WandbCallback leaves the run open
    trainer.end()  # finish accelerate's trackers and the process group
    if stopped_by is not None:  # every process: each runs the gate on the same (gathered) log rows
        raise SystemExit(GATE_STOP_EXIT_CODE)


def gate_stop(trainer) -> str | None:
    """The check that stopped `trainer`'s last `train()` (`RatioGateCallback.stopped_by`, `ratio_gate_action="stop"`),
    or None when no gate stopped it."""
    gates = [c for c in trainer.callback_handler.callbacks if isinstance(c, RatioGateCallback)]
    return next((g.stopped_by for g in gates if g.stopped_by is not None), None)


def make_parser(trainer: str = "grpo") -> TrlParser:
    """`TrlParser` over (GRPOScriptArguments, the trainer's config: RatioGRPOConfig or RatioRLOOConfig,
    trl.ModelConfig): `--config recipe.yaml` plus flags. Abbreviated flags are refused (argparse's default takes
    `--old_logprob_mod` for `--old_logprob_mode`: a typo that trains)."""
    return TrlParser((GRPOScriptArguments, TRAINERS[trainer][0], ModelConfig), allow_abbrev=False)


def trainer_of(argv: list[str]) -> str:
    """The `trainer` a command line asks for, before it is parsed (the config class depends on it): `--trainer X`
    (or `--trainer=X`), else the `--config` recipe's `trainer:` key, else "grpo".

    Raises:
        ValueError: a value not in `TRAINER_NAMES`, naming the field and the allowed values.
    """
    import yaml

    value = None
    for i, token in enumerate(argv):
        if token.startswith("--trainer="):
            value = token.split("=", 1)[1]
        elif token == "--trainer" and i + 1 < len(argv):
            value = argv[i + 1]
    if value is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
        recipe = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text()) or {}
        value = recipe.get("trainer") if isinstance(recipe, dict) else None
    value = "grpo" if value is None else str(value)
    if value not in TRAINERS:
        raise ValueError(f"trainer={value!r} is not allowed; allowed: {', '.join(TRAINER_NAMES)}")
    return value


# what a mistake in the recipe, the flags or the data raises before training starts: printed in one line
SETUP_ERRORS = (ValueError, FileNotFoundError, FileExistsError, OSError, KeyError)


def cli_main(argv: list[str] | None = None) -> None:
    """Parse `argv` (a recipe via `--config` plus flags) and run `main`. A mistake found before training starts
    (a bad value, a missing data path or model, a finished run in output_dir) is printed as one line
    `grpo-ratio train: error: ...` with exit status 2, not a traceback (`GRPO_RATIO_TRACEBACK=1` shows it)."""
    try:
        trainer_name = trainer_of(list(sys.argv[1:] if argv is None else argv))
        script_args, training_args, model_args = make_parser(trainer_name).parse_args_and_config(argv)
        trainer = setup(script_args, training_args, model_args)
    except SETUP_ERRORS as err:
        if os.environ.get("GRPO_RATIO_TRACEBACK") == "1":
            raise
        print(f"grpo-ratio train: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    main(script_args, training_args, model_args, trainer)
