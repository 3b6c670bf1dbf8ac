"""Whole-step cost of every scoring mode next to stock TRL: median GRPO step time and peak memory as ratios.

What a user pays for `old_logprob_mode` is the whole GRPO step, not the old pass alone: in TRL's on-policy default
(`num_iterations=1`, `steps_per_generation` = gradient accumulation) TRL skips its old pass, and every mode other
than `bf16`, `sampler` and `fp32_head` adds one (`fp32_head` applies its fp32 norm and head to each micro-batch's own
training-forward hidden states instead: no body pass, grpo_ratio/old_pass/fused_head.py). Arms (`ARMS`, one line each): stock `trl.GRPOTrainer`; stock TRL with `cast_lm_head_to_fp32=True`
on an untied copy of the model (TRL documents the option for untied heads only; SmolLM2 ties its head to the input
embedding, so the copy gets its own head, which it trains, and saves to a temporary directory); `RatioGRPOTrainer` in
every mode; and `is_correction="tis"` at `bf16` twice: as the trainer runs it, the IS weight's old log-probs taken from
each training forward (issue 43: no old pass), and as it ran before (`tis_two_pass`: a separate no-grad old pass per
generation). All arms use the values of one recipe (default: the SmolLM2 arithmetic recipe: fp32 weights under bf16
autocast on CPU, 2 prompts x 4 completions of at most 16 tokens per step).

Rounds are interleaved in one process so machine load hits every arm alike: each round builds every arm's trainer in
turn (rotating the order), trains it for --warmup + --steps optimizer steps with the round's seed, and frees it before
the next one. Only one trainer is alive at a time, so an arm's peak memory is its own, copies included.

    python benchmarks/step_cost.py --model tiny --rounds 1                   # under a minute: a smoke run
    python benchmarks/step_cost.py --model smollm2 --rounds 3 --steps 2 --warmup 0 \
        --json results/step_cost_smollm2.json     # 7 arms x 6 steps: hours where a SmolLM2 step takes minutes
    python benchmarks/step_cost.py --render results/step_cost_smollm2.json   # markdown tables of a result
    python benchmarks/step_cost.py --model tiny --rounds 2 --steps 2 --warmup 1 --arms bf16,tis,tis_two_pass \
        --json results/step_cost_tiny_is_reuse.json   # only the arms named (and stock TRL, the reference)
    python benchmarks/step_cost.py --model smollm2 --arms trl,fp32_head,fp32_head_bf16_operands --rounds 1 \
        --steps 2 --warmup 1 --json results/step_cost_smollm2_head_operands.json   # some arms only (the reference
                                                                                  # always runs)
    python benchmarks/step_cost.py --trainer rloo --model smollm2 --rounds 1 --steps 2 --warmup 1 \
        --json results/step_cost_smollm2_rloo.json   # RLOO: stock trl.RLOOTrainer and RatioRLOOTrainer per mode

With `--trainer rloo` every arm is TRL's `RLOOTrainer` (stock) or `RatioRLOOTrainer` on the RLOO recipe (docs/rloo.md),
without the `cast_lm_head_to_fp32` arm (RLOOConfig has no such field). RLOO always runs its old pass, so every mode
replaces TRL's pass instead of adding one, and `fp32_head` keeps a separate pass there (no fused head).

Policy forwards / step: calls of the policy model's forward counted by a forward hook (generate's decoding steps,
old passes in TRL's chunks, training forwards), mean over the timed steps; results from before the count leave the
column out.

Step time: wall seconds from `on_step_begin` to `on_step_end` of one optimizer step (generation, scoring, loss,
backward, optimizer), the first --warmup steps of each trainer left out (one-time costs: optimizer state, building a
copy; with --warmup 0 they stay in the first step, a second or two for SmolLM2). Breakdown: exclusive seconds (a
nested part is subtracted from its parent) spent in methods wrapped for the run:
- generation: `GRPOTrainer._generate_single_turn` (RatioGRPOTrainer records sampler log-probs inside it);
- TRL old pass: `GRPOTrainer._get_per_token_logps_and_entropies` called without grad (old or reference log-probs);
- mode old pass: `grpo_ratio.old_pass.scorer.OldLogprobScorer.score`, less any copy refresh inside it;
- fused head: `grpo_ratio.old_pass.scorer.OldLogprobScorer.head_logprobs` (`fp32_head`'s fp32 norm and head on a micro-batch's
  training-forward hidden states, in place of a body pass);
- copy refresh: `grpo_ratio.old_pass.copies.VersionedCopy.refresh` (weights copied into an fp16/fp32 copy after each update);
- training forward: `GRPOTrainer._get_per_token_logps_and_entropies` called with grad;
- backward: the trainer's `accelerator.backward` (wrapped on the instance);
- optimizer: `Trainer._clip_grad_norm` plus `optimizer.step()` (between the pre/post optimizer-step callbacks);
- other: the step total minus all of the above (rewards, decoding, advantages, loss math, ratio diagnostics, ...).

Peak memory: the kernel's peak resident set size of the process (`VmHWM` in /proc/self/status, reset through
/proc/self/clear_refs before each arm; where that reset is unavailable, a thread sampling the RSS with psutil every
5 ms, which can miss shorter peaks) minus the RSS before the arm's trainer is built: weights, gradients, optimizer
state, copies and activations of that arm, over all its steps (warm-up included). Run at least 2 steps per arm:
AdamW's state appears at the first optimizer step, after that step's backward, so only from the second step on does
a backward's activation peak sit on top of it. Caveats: RSS counts every resident page of the process (Python
objects, the allocator's retained free memory, file pages of memory-mapped weights), not only tensors; large
allocations are made to return to the OS when freed (glibc `mallopt`), so one arm's freed memory does not hide the
next arm's growth.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import yaml  # noqa: E402

# no torch import at module level: rendering a result stays light
from grpo_ratio.machine import PeakRSS, describe_machine, machine_record, release_memory, rss_bytes, steady_malloc  # noqa: E402, E501


# torch, transformers, trl and grpo_ratio are imported where used: rendering a result JSON (scripts/update_docs.py,
# tests/test_docs.py) then costs no heavy import.


ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/smollm2-135m/arithmetic/bf16.yaml"
RECIPES = {"grpo": RECIPE, "rloo": "recipes/smollm2-135m/rloo/arithmetic/bf16.yaml"}  # --trainer's default recipe
CALIBRATION = "recipes/smollm2-135m/calibration.json"
REFERENCE = "trl"  # the arm every ratio is taken against
PARTS = ("generation", "trl_old_pass", "mode_old_pass", "fused_head", "copy_refresh", "train_forward", "backward",
         "optimizer")
OLD_PASSES = ("trl_old_pass", "mode_old_pass")  # passes of the whole body (counted per generation)
ADDED = (*OLD_PASSES, "fused_head", "copy_refresh")  # what a scoring mode adds to TRL's on-policy step


@dataclass(frozen=True)
class Arm:
    """One trainer configuration: `trainer` is "trl" (stock GRPOTrainer) or "ratio" (RatioGRPOTrainer); `fields`
    are config fields set on top of the recipe; `untied` runs it on the untied copy of the model; `guided` adds the
    model's calibrated `guided_fp32_layers`."""

    name: str
    trainer: str
    fields: dict = field(default_factory=dict)
    untied: bool = False
    guided: bool = False
    two_pass: bool = False  # the trainer before issue 43: is_correction's separate no-grad old pass, not the reuse


# One line per arm; the arm named REFERENCE is the denominator of every ratio.
ARMS = (
    Arm(REFERENCE, "trl"),
    Arm("trl_cast_lm_head_to_fp32", "trl", {"cast_lm_head_to_fp32": True}, untied=True),
    Arm("bf16", "ratio", {"old_logprob_mode": "bf16"}),
    Arm("fp32_clone", "ratio", {"old_logprob_mode": "fp32_clone"}),
    Arm("fp16_clone", "ratio", {"old_logprob_mode": "fp16_clone"}),
    Arm("fp32_head", "ratio", {"old_logprob_mode": "fp32_head"}),
    # the sampler's fp32 head (issue 43): the policy's norm, bf16 operands, fp32 accumulation (fused like fp32_head)
    Arm("fp32_head_bf16_operands", "ratio", {"old_logprob_mode": "fp32_head", "fp32_head_operands": "bf16"}),
    Arm("guided_fp32", "ratio", {"old_logprob_mode": "guided_fp32"}, guided=True),
    Arm("sampler", "ratio", {"old_logprob_mode": "sampler"}),  # the rollout's own log-probs: no old pass at all
    # is_correction (TIS) at bf16: the training forward, detached, is the IS weight's old log-probs (issue 43), and
    # the same run with the separate no-grad old pass it replaced (the two are equal bit for bit, tests/test_is_reuse.py)
    Arm("tis", "ratio", {"old_logprob_mode": "bf16", "is_correction": "tis"}),
    Arm("tis_two_pass", "ratio", {"old_logprob_mode": "bf16", "is_correction": "tis"}, two_pass=True),
)
# RLOO always runs its old pass: nothing to reuse there, so no is_correction arms
TRAINER_ARMS = {"grpo": ARMS, "rloo": tuple(a for a in ARMS if "cast_lm_head_to_fp32" not in a.fields
                                           and "is_correction" not in a.fields)}
FORWARDS = "policy_forward"  # calls of the policy's forward (a hook on the model), decoding steps included


def two_pass_class(cls):
    """`cls` (a grpo_ratio trainer) as it was before issue 43: `is_correction` runs its separate no-grad old pass of
    the policy instead of reusing each training forward's log-probs."""
    return type(f"TwoPass{cls.__name__}", (cls,), {"_reuses_training_forward": lambda self: False})


def trainer_classes(trainer: str) -> tuple:
    """(stock config, stock trainer, grpo_ratio config, grpo_ratio trainer) of `--trainer` ("grpo" or "rloo")."""
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer, RatioRLOOConfig, RatioRLOOTrainer

    if trainer == "rloo":
        return RLOOConfig, RLOOTrainer, RatioRLOOConfig, RatioRLOOTrainer
    return GRPOConfig, GRPOTrainer, RatioGRPOConfig, RatioGRPOTrainer


# ---------------------------------------------------------------------------------------------------------------------
# timing: exclusive seconds per part inside each optimizer step


class StepClock:
    """Wall time of each optimizer step and the exclusive seconds and call counts of its parts.

    `steps` holds one dict per finished step: `seconds` (float, wall), `parts` (name -> exclusive seconds, including
    `other` = seconds minus the named parts) and `calls` (name -> number of calls). Calls outside a step are run but
    not counted.
    """

    def __init__(self):
        self.steps: list[dict] = []
        self._step = None
        self._stack: list[list] = []  # [name, start, seconds of nested parts]

    def begin_step(self) -> None:
        self._step = {"start": time.perf_counter(), "parts": defaultdict(float), "calls": Counter()}
        self._stack = []

    def end_step(self) -> None:
        if self._step is None:
            return
        seconds = time.perf_counter() - self._step["start"]
        parts = {name: self._step["parts"].get(name, 0.0) for name in PARTS}
        parts["other"] = seconds - sum(parts.values())
        self.steps.append({"seconds": seconds, "parts": parts, "calls": dict(self._step["calls"])})
        self._step = None

    def count(self, name: str) -> None:
        """Count one call of `name` in the current step, untimed (the policy's forwards)."""
        if self._step is not None:
            self._step["calls"][name] += 1

    def enter(self, name: str) -> None:
        if self._step is not None:
            self._stack.append([name, time.perf_counter(), 0.0])
            self._step["calls"][name] += 1

    def exit(self) -> None:
        if self._step is None or not self._stack:
            return
        name, start, nested = self._stack.pop()
        elapsed = time.perf_counter() - start
        self._step["parts"][name] += elapsed - nested  # exclusive: a nested part counts once, for itself
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextlib.contextmanager
    def part(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit()


_CLOCK: StepClock | None = None  # the clock of the arm being run; class-level wrappers report to it


def _timed(name_of):
    """Decorator: time each call under the part `name_of(*args, **kwargs)` of the active clock."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if _CLOCK is None:
                return fn(*args, **kwargs)
            with _CLOCK.part(name_of(*args, **kwargs)):
                return fn(*args, **kwargs)
        return wrapper
    return decorate


def _logps_part(*args, **kwargs) -> str:
    import torch

    # TRL's helper serves both passes: without grad it is the old (or reference) pass, with grad the training forward
    return "train_forward" if torch.is_grad_enabled() else "trl_old_pass"


def class_parts() -> tuple:
    """(class, method, part) triples wrapped at class level for the run, so calls made through `super()` count too."""
    from trl import GRPOTrainer, RLOOTrainer

    from grpo_ratio.old_pass.copies import VersionedCopy
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    return (
        (GRPOTrainer, "_generate_single_turn", lambda *a, **k: "generation"),
        (GRPOTrainer, "_get_per_token_logps_and_entropies", _logps_part),
        (RLOOTrainer, "_generate_single_turn", lambda *a, **k: "generation"),  # RLOO defines its own
        (RLOOTrainer, "_get_per_token_logps_and_entropies", _logps_part),
        (OldLogprobScorer, "score", lambda *a, **k: "mode_old_pass"),
        (OldLogprobScorer, "head_logprobs", lambda *a, **k: "fused_head"),
        (VersionedCopy, "refresh", lambda *a, **k: "copy_refresh"),  # every copy: module copies, sharded shadows
    )


@contextlib.contextmanager
def instrumented(clock: StepClock):
    """Route the methods of `class_parts()` to `clock` while the block runs; the classes are restored after."""
    global _CLOCK
    parts = class_parts()
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in parts]
    for cls, name, part in parts:
        setattr(cls, name, _timed(part)(cls.__dict__[name]))
    _CLOCK = clock
    try:
        yield clock
    finally:
        _CLOCK = None
        for cls, name, original in originals:
            setattr(cls, name, original)


def step_callback(clock: StepClock):
    """A `TrainerCallback` that opens and closes the clock's steps, and its `optimizer` part around
    `optimizer.step()`."""
    from transformers import TrainerCallback

    class StepCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin_step()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            clock.enter("optimizer")

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.exit()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end_step()

    return StepCallback()


def instrument_trainer(trainer, clock: StepClock) -> None:
    """Per-instance parts: backward (`accelerator.backward`), gradient clipping, and the step callback; the
    trainer's own printing is removed (the benchmark prints one line per arm)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    def wrap(owner, name, part):
        method = getattr(owner, name)
        setattr(owner, name, _timed(lambda *a, **k: part)(method))

    wrap(trainer.accelerator, "backward", "backward")
    wrap(trainer, "_clip_grad_norm", "optimizer")
    trainer.add_callback(step_callback(clock))
    for printer in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(printer)


# ---------------------------------------------------------------------------------------------------------------------
# model, data and trainers


@dataclass
class ModelSpec:
    """What every arm trains: a model directory (and its untied copy), tokenizer, prompts and rewards."""

    label: str
    path: str
    untied_path: str
    tokenizer: object
    dataset: object
    reward_funcs: list
    guided_layers: str  # `guided_fp32_layers` value for the `guided` arm


def untie_head(path: str, dest: str) -> str:
    """Save a copy of the model at `path` whose LM head is its own fp32 parameter (initialised to the input
    embedding it was tied to) into `dest`: TRL's `cast_lm_head_to_fp32` is documented for untied heads only."""
    import torch
    from torch import nn
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.get_output_embeddings().weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.save_pretrained(dest)
    return dest


def _smollm2_spec(workdir: Path, recipe: dict) -> ModelSpec:
    from grpo_ratio.models import load_tokenizer, resolve_model_path
    from grpo_ratio.tasks import load_task

    path = resolve_model_path(recipe.get("model_name_or_path") or "HuggingFaceTB/SmolLM2-135M-Instruct")
    task_keys = {"num_examples": "num_examples", "task_seed": "seed", "max_operand": "max_operand",
                 "operations": "operations"}
    dataset, rewards = load_task(recipe["task"], **{kw: recipe[k] for k, kw in task_keys.items() if k in recipe})
    return ModelSpec("SmolLM2-135M-Instruct", path, untie_head(path, str(workdir / "untied")),
                     load_tokenizer(path), dataset, rewards, str(ROOT / CALIBRATION))


def _tiny_spec(workdir: Path) -> ModelSpec:
    from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer

    path = str(workdir / "tiny")
    tiny_model("llama", tie_word_embeddings=True).save_pretrained(path)  # tied, like SmolLM2 (a Llama)
    return ModelSpec("tiny llama (2 layers, hidden 64, V=300, tied head)", path,
                     untie_head(path, str(workdir / "untied")), tiny_tokenizer(), tiny_prompts(64), [letter_reward],
                     "0")


def load_spec(name: str, workdir: Path, recipe: dict) -> ModelSpec:
    """`ModelSpec` of "smollm2" (the recipe's model and task) or "tiny" (random tiny Llama, plain-text prompts)."""
    return _tiny_spec(workdir) if name == "tiny" else _smollm2_spec(workdir, recipe)


def read_recipe(path: str | Path) -> dict:
    """The key/value pairs of a recipe YAML."""
    return yaml.safe_load(Path(path).read_text())


def arm_config(arm: Arm, spec: ModelSpec, recipe: dict, seed: int, max_steps: int, output_dir: str):
    """The arm's `GRPOConfig` (stock TRL) or `RatioGRPOConfig` (`RLOOConfig` / `RatioRLOOConfig` for a recipe with
    `trainer: rloo`): the recipe's trainer fields, the arm's fields, and what a benchmark changes (no reporting, no
    saving, `max_steps`, `seed`)."""
    stock, _, ours, _ = trainer_classes(recipe.get("trainer", "grpo"))
    cls = stock if arm.trainer == "trl" else ours
    names = {k for k, f in cls.__dataclass_fields__.items() if f.init}
    values = {k: v for k, v in recipe.items() if k in names and k != "old_logprob_mode"}
    values.update(arm.fields)
    if arm.guided:
        values["guided_fp32_layers"] = spec.guided_layers
    values.update(output_dir=output_dir, report_to="none", save_strategy="no", max_steps=max_steps, seed=seed,
                  disable_tqdm=True, model_init_kwargs={"dtype": recipe.get("dtype", "float32")})
    return cls(**values)


def build_trainer(arm: Arm, spec: ModelSpec, recipe: dict, seed: int, max_steps: int, output_dir: str):
    """A fresh trainer of `arm` (the recipe's `trainer`: GRPO by default); the model is loaded from its directory by
    TRL, as `trainers/grpo.py` does."""
    from transformers import set_seed

    args = arm_config(arm, spec, recipe, seed, max_steps, output_dir)
    _, stock, _, ours = trainer_classes(recipe.get("trainer", "grpo"))
    cls = stock if arm.trainer == "trl" else two_pass_class(ours) if arm.two_pass else ours
    set_seed(seed)
    return cls(model=spec.untied_path if arm.untied else spec.path, reward_funcs=spec.reward_funcs, args=args,
               train_dataset=spec.dataset, processing_class=spec.tokenizer)


# ---------------------------------------------------------------------------------------------------------------------
# the benchmark


def run_arm(arm: Arm, spec: ModelSpec, recipe: dict, seed: int, warmup: int, steps: int, workdir: Path) -> dict:
    """Build, train and free one arm's trainer; its steps (seconds, parts, calls) and peak memory (bytes)."""
    from transformers import set_seed

    release_memory()
    before = rss_bytes()
    clock = StepClock()
    with PeakRSS() as peak, instrumented(clock):
        trainer = build_trainer(arm, spec, recipe, seed, warmup + steps, str(workdir / "out"))
        instrument_trainer(trainer, clock)
        # every forward of the policy: generate's decoding steps, old passes, training forwards
        trainer.model.register_forward_hook(lambda *a: clock.count(FORWARDS))
        set_seed(seed)  # modes build copies at different times: from here every arm samples the same first rollouts
        trainer.train()
    del trainer
    release_memory()
    for i, step in enumerate(clock.steps):
        step["warmup"] = i < warmup
    return {"arm": arm.name, "seed": seed, "rss_before": before, "peak_delta": peak.peak - before,
            "rss_after": rss_bytes(), "memory_method": peak.method, "steps": clock.steps}


def run_benchmark(spec: ModelSpec, recipe: dict, arms=ARMS, rounds: int = 3, warmup: int = 1, steps: int = 2,
                  workdir: Path | None = None, log=print, on_run=None) -> list[dict]:
    """Interleaved rounds: each round runs every arm (order rotated by one per round, so no arm always runs first),
    all with seed = round index. Returns one `run_arm` record per (round, arm), with `round` added; `on_run(runs)`
    is called after each, so a long run can save what it has."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="step_cost_"))
    runs = []
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[: r % len(arms)]:
            t0 = time.perf_counter()
            runs.append({"round": r, **run_arm(arm, spec, recipe, r, warmup, steps, workdir)})
            last = runs[-1]
            log(f"round {r + 1}/{rounds} {arm.name}: {time.perf_counter() - t0:.1f} s, steps "
                f"{[round(s['seconds'], 2) for s in last['steps']]}, peak +{last['peak_delta'] / 2**20:.0f} MB")
            if on_run is not None:
                on_run(runs)
    return runs


# ---------------------------------------------------------------------------------------------------------------------
# summary and tables


def _arm_summary(runs: list[dict]) -> dict:
    timed = [s for run in runs for s in run["steps"] if not s["warmup"]]
    gens = sum(s["calls"].get("generation", 0) for s in timed)
    parts = {p: statistics.fmean(s["parts"].get(p, 0.0) for s in timed) for p in (*PARTS, "other")}
    calls = {p: sum(s["calls"].get(p, 0) for s in timed) for p in PARTS}
    return {
        "step_seconds": statistics.median(s["seconds"] for s in timed),  # median over timed steps of all rounds
        "mean_step_seconds": statistics.fmean(s["seconds"] for s in timed),
        "round_medians": {run["round"]: statistics.median(s["seconds"] for s in run["steps"] if not s["warmup"])
                          for run in runs},
        "peak_bytes": statistics.median(run["peak_delta"] for run in runs),
        "parts": parts,  # mean exclusive seconds per step (means, so that the parts add up to the mean step)
        "calls": calls,
        "timed_steps": len(timed),
        "generations": gens,
        "old_passes_per_generation": sum(calls[p] for p in OLD_PASSES) / gens if gens else float("nan"),
        # None in results from before the count (the column is then left out)
        "forwards_per_step": (statistics.fmean(s["calls"].get(FORWARDS, 0) for s in timed)
                              if any(FORWARDS in s["calls"] for s in timed) else None),
        # the old pass and refresh over the rest of the same steps: timed under the same load, so load drift between
        # arms (which moves the step ratios) cancels
        "added_share": sum(parts[p] for p in ADDED) / (statistics.fmean(s["seconds"] for s in timed)
                                                        - sum(parts[p] for p in ADDED)),
    }


def summarize(result: dict) -> dict:
    """Per arm: median step seconds, peak bytes, their ratios to the reference arm (the same run, side by side),
    the per-round range of the time ratio, the mean seconds per part and the counted old passes per generation."""
    by_arm = defaultdict(list)
    for run in result["runs"]:
        by_arm[run["arm"]].append(run)
    summary = {arm: _arm_summary(runs) for arm, runs in by_arm.items()}
    ref = summary[result["reference"]]
    for s in summary.values():
        s["time_ratio"] = s["step_seconds"] / ref["step_seconds"]
        s["memory_ratio"] = s["peak_bytes"] / ref["peak_bytes"]
        per_round = [s["round_medians"][r] / ref["round_medians"][r] for r in s["round_medians"]]
        s["round_time_ratios"] = (min(per_round), max(per_round))
    return summary


def _header(result: dict) -> str:
    c = result["config"]
    stopped = result.get("rounds_requested", result["rounds"]) != result["rounds"]
    rounds = f"{result['rounds']} round(s)" + (f" (stopped early, of {result['rounds_requested']})" if stopped else "")
    trainer = {"grpo": "", "rloo": "TRL's RLOOTrainer, "}[result.get("trainer", "grpo")]
    return (f"`{result['command']}` — {trainer}{result['label']}, {rounds} x {result['steps']} timed "
            f"step(s) per arm (+{result['warmup']} warm-up), {c['per_device_train_batch_size']} completions "
            f"({c['num_generations']} per prompt) of <= {c['max_completion_length']} tokens, {c['dtype']} weights, "
            f"bf16 autocast={c['bf16']}, CPU, {result['threads']} threads, peak memory: {result['memory_method']}; "
            f"{describe_machine(result.get('machine'))}")


def render_cost(result: dict, summary: dict) -> list[str]:
    counted = any(s.get("forwards_per_step") is not None for s in summary.values())  # results from before: no column
    forwards = " policy forwards / step |" if counted else ""
    lines = ["| arm | old body passes / generation |" + forwards + " step (s, median) | step / TRL | per-round range | "
             "old pass + refresh / rest of step | peak MB | peak / TRL |", "|---" * (8 + counted) + "|"]
    for arm, s in summary.items():
        lo, hi = s["round_time_ratios"]
        n = s.get("forwards_per_step")
        forwards = (" - |" if n is None else f" {n:g} |") if counted else ""
        lines.append(f"| {arm} | {s['old_passes_per_generation']:.0f} |{forwards} {s['step_seconds']:.2f} | "
                     f"{s['time_ratio']:.2f}x | {lo:.2f}-{hi:.2f}x | +{s['added_share']:.1%} | "
                     f"{s['peak_bytes'] / 2**20:.0f} | {s['memory_ratio']:.2f}x |")
    return lines


def render_breakdown(summary: dict) -> list[str]:
    cols = ("generation", "old pass", "fused head", "train forward", "backward", "optimizer", "copy refresh", "other")
    lines = ["| arm | " + " | ".join(cols) + " | step (s, mean) |", "|---" * (len(cols) + 2) + "|"]
    for arm, s in summary.items():
        p = s["parts"]
        values = (p["generation"], p["trl_old_pass"] + p["mode_old_pass"], p.get("fused_head", 0.0), p["train_forward"],
                  p["backward"], p["optimizer"], p["copy_refresh"], p["other"])
        total = s["mean_step_seconds"]
        lines.append(f"| {arm} | " + " | ".join(f"{v:.2f} ({v / total:.1%})" for v in values) + f" | {total:.2f} |")
    return lines


def render(result: dict) -> str:
    """Markdown of one result (the JSON --json writes): ratios to stock TRL, then where a step's time goes."""
    summary = summarize(result)
    return "\n".join([_header(result), "", *render_cost(result, summary), "",
                      "Mean seconds per step and share of the step:", "", *render_breakdown(summary)])


def make_result(command: str, spec: ModelSpec, recipe_path: str, recipe: dict, runs: list[dict], rounds: int,
                steps: int, warmup: int, machine: dict | None = None, arms=ARMS) -> dict:
    """The JSON record of a run: command, settings, versions, arms and the (round, arm) records of every complete
    round (`rounds` counts those; `rounds_requested` what was asked for)."""
    import torch
    import trl

    done = [r for r in range(rounds) if sum(run["round"] == r for run in runs) == len(arms)]
    runs = [run for run in runs if run["round"] in done]
    keys = ("per_device_train_batch_size", "num_generations", "max_completion_length", "bf16", "use_cpu", "dtype",
            "activation_checkpointing", "beta", "learning_rate", "temperature")
    return {
        "command": command, "label": spec.label, "recipe": recipe_path, "config": {k: recipe.get(k) for k in keys},
        "rounds": len(done), "rounds_requested": rounds, "steps": steps, "warmup": warmup,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "trl": trl.__version__,
        "memory_method": runs[0]["memory_method"] if runs else None,
        "trainer": recipe.get("trainer", "grpo"), "reference": REFERENCE, "arms": [vars(arm) for arm in arms],
        "runs": runs, "machine": machine,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "tiny"], default="tiny")
    p.add_argument("--trainer", choices=tuple(RECIPES), default="grpo",
                   help="TRL's GRPOTrainer or RLOOTrainer, stock and with grpo_ratio (the default recipe follows it)")
    p.add_argument("--recipe", default=None, help="recipe YAML whose trainer values every arm uses (default: the "
                   "SmolLM2 arithmetic bf16 recipe of --trainer)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each runs every arm")
    p.add_argument("--steps", type=int, default=2, help="timed optimizer steps per arm and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps per arm and round")
    p.add_argument("--arms", default=None, help="comma-separated arm names to run (default: every arm of --trainer); "
                   f"the reference arm {REFERENCE!r} always runs")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    p.add_argument("--render", default=None, help="print the markdown tables of a result JSON and exit")
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return
    steady_malloc()
    a.recipe = a.recipe or RECIPES[a.trainer]
    recipe = read_recipe(ROOT / a.recipe)
    if recipe.get("trainer", "grpo") != a.trainer:
        raise SystemExit(f"--recipe {a.recipe} is a {recipe.get('trainer', 'grpo')} recipe (its `trainer` key); "
                         f"--trainer is {a.trainer}")
    arms = TRAINER_ARMS[a.trainer]
    if a.arms:
        wanted = {REFERENCE, *a.arms.split(",")}
        unknown = wanted - {arm.name for arm in arms}
        if unknown:
            raise SystemExit(f"--arms {', '.join(sorted(unknown))}: no such arm; allowed: "
                             f"{', '.join(arm.name for arm in arms)}")
        arms = tuple(arm for arm in arms if arm.name in wanted)
    command = "python benchmarks/step_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = machine_record()  # before the run's own threads raise the load

    def save(runs):  # after every arm: a long run stopped early keeps its complete rounds
        result = make_result(command, spec, a.recipe, recipe, runs, a.rounds, a.steps, a.warmup, machine, arms)
        if a.json and result["rounds"]:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1))
        return result

    with tempfile.TemporaryDirectory(prefix="step_cost_") as tmp:
        spec = load_spec(a.model, Path(tmp), recipe)
        runs = run_benchmark(spec, recipe, arms, a.rounds, a.warmup, a.steps, Path(tmp),
                             log=lambda m: print(m, file=sys.stderr, flush=True), on_run=save)
    print(render(save(runs)))


if __name__ == "__main__":
    main()
