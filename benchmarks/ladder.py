"""Run a mismatch ladder: every (setting, correction, seed) of one source, resumable, on a chosen testbed (issue 41).

    python benchmarks/ladder.py --source staleness                      # tiny testbed, every setting, 3 seeds
    python benchmarks/ladder.py --source truncation --settings top_p_1.0 top_p_0.5 --corrections none renormalize \\
        --seeds 0 --max_steps 2                                         # a smoke
    python benchmarks/ladder.py --source staleness --testbed smollm2 --settings k0 k7 --corrections none ppo_clip
    python benchmarks/ladder.py --source staleness --set learning_rate=1e-3   # any config field, every cell
    python benchmarks/ladder.py --list                                  # the ladders, their settings and corrections

The ladders themselves (dials, corrections, what the rule reads) are data in `grpo_ratio/ladder/definitions.py`; the
testbeds are `TESTBEDS` below, the one place their learning rate, steps and batch live:
- `tiny`: a 2-layer qwen2 (`grpo_ratio.testing.peaked_model`: the random LM head scaled so next-token distributions
  are peaked like a trained model's, start entropy about 1 nat) or the ladder's tiny MoE, the tiny byte-level
  tokenizer, plain-text prompts (64 to train on, 16 held out) and `letter_reward` (share of letters a..m): a policy that
  learns in minutes on two cores. Its mismatch is made by the same code paths as SmolLM2's (staleness: TRL's own old
  pass; truncation: the same `generate` filter and kept sets; precision: the same lower-precision copy), so a
  distance logged at step 1 means the same on both; what differs is how much reward a given distance costs;
- `smollm2`: SmolLM2-135M-Instruct (`grpo_ratio.models.resolve_model`, offline: the converted GGUF) on the built-in
  arithmetic task; 8 problems held out of the training set.

Each setting is one `grpo-ratio compare` (arms = the corrections, matched data order and sampling seeds per seed, the
uncorrected arm its baseline) under `OUTPUT_ROOT/NAME/<setting>/` (NAME: the source, `<source>-smollm2` on SmolLM2):
`<correction>-s<seed>/{log_history,run,rollout_fingerprints,first_rollouts}.json`, plus `cell.json` (the command
that reproduces the cell, its CPU and wall seconds); then `ladder.json` (`grpo_ratio.ladder.outcomes`: held-out reward,
AUC, collapse signals, verdicts, step-1 diagnostics, cost) and the reward-curve figure. A finished cell is read back,
not trained again; a cell folder of another configuration is an error. At the reference setting (no mismatch) only
the uncorrected arm runs (the corrections have nothing to act on there), unless `--corrections` leaves it out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import time
from pathlib import Path

from transformers import TrainerCallback


os.environ.setdefault("HF_HUB_OFFLINE", "1")

from grpo_ratio.ladder import LADDERS, ladder  # noqa: E402
from grpo_ratio.ladder.definitions import staleness_overrides  # noqa: E402
from grpo_ratio.ladder.outcomes import CELL_FILE, write_summary  # noqa: E402
from grpo_ratio.ladder.render import write_figures  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]

# the testbeds: every value the lead may want to change is here, in one place ("kind": which model and data)
TESTBEDS = {
    "tiny": {
        "kind": "tiny",
        "config": dict(
            use_cpu=True, bf16=False,  # fp32: the reference setting has no precision gap of its own
            per_device_train_batch_size=32, num_generations=8,  # 4 prompts x 8 completions per optimizer step
            max_completion_length=16, temperature=1.0,
            max_steps=60, learning_rate=1e-3, lr_scheduler_type="constant", beta=0.0,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            per_device_eval_batch_size=32,  # 4 held-out prompts x 8 completions per evaluation batch
            ratio_attribution="true",  # the attribution's terms at step 1 (one fp32 reference pass per batch)
        ),
        "eval_points": 12,  # evaluations over the run (eval_steps = max_steps // eval_points), plus one at step 0
        "train_prompts": 64,
        "eval_prompts": 8,
        # peaked_model's LM-head scale: 10 starts at about 4.5 nats of entropy and learns letter_reward from ~0.15 to
        # ~1.0 in 20-40 steps at this learning rate; 50 collapses onto a 0.667 plateau within 5 steps (pilot runs,
        # 2-core CPU, 2026-12-06), which leaves no reward for a mismatch to lose
        "head_scale": 10.0,
        "never_eos": True,  # every completion runs to max_completion_length: a continuous letter share
        "threads": 1,  # torch threads per run: two ladders run side by side on a 2-core machine
    },
    "tiny_async": {  # the asynchronous ladder's: the tiny policy as a LoRA, sampled by a real `vllm serve` on CPU
        "kind": "tiny_async",
        "config": dict(
            use_cpu=True, bf16=False, gradient_checkpointing=False,  # fp32 trainer and server: no engine gap
            per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8,  # 4 prompts x 8 / step
            max_completion_length=16, temperature=1.0,
            max_steps=30, learning_rate=5e-3, lr_scheduler_type="constant",
            weight_sync_steps=1,  # the policy reaches the server as a new adapter after every optimizer step
            token_budget=0,  # FixedCountBatcher: per_device_train_batch_size samples per micro-batch
            vllm_server_timeout=120,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        ),
        "eval_points": 8,  # held-out evaluations over the run (HeldOutReward), plus one at step 0
        "eval_generations": 8,
        "train_prompts": 64,
        "eval_prompts": 8,
        "head_scale": 10.0,
        "never_eos": True,
        "lora_rank": 8,  # every linear layer of the blocks (vLLM serves it as an adapter; no head: TRL's sync rule)
        "threads": 1,
    },
    "smollm2_async": {  # SmolLM2 as the asynchronous ladder's policy: a LoRA, the arithmetic task, a real vLLM server
        "kind": "smollm2_async",
        "config": dict(
            use_cpu=True, bf16=False, gradient_checkpointing=False,
            per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,  # 2 prompts x 4 / step
            max_completion_length=32, temperature=1.0,  # 16 tokens leave the arithmetic reward near 0.06 at the start
            max_steps=16, learning_rate=1e-3, lr_scheduler_type="constant",  # benchmarks/async_staleness.py's rate
            weight_sync_steps=1, token_budget=0, vllm_server_timeout=300,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        ),
        "eval_points": 2,  # 8 problems x 4 samples of 32 tokens by HF generate: about a minute per evaluation here
        "eval_generations": 4,
        "train_examples": 1000,
        "eval_prompts": 8,
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "lora_rank": 8,
        "threads": 1,
    },
    "smollm2": {
        "kind": "smollm2",
        "config": dict(
            use_cpu=True, bf16=False,
            per_device_train_batch_size=8, num_generations=4,
            max_completion_length=16, temperature=1.0,
            max_steps=40, learning_rate=1e-5, lr_scheduler_type="constant", beta=0.0,
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            gradient_checkpointing=False,  # TRL turns it on by default; it only slows a CPU step
            per_device_eval_batch_size=16,
            ratio_attribution="8",
        ),
        "eval_points": 5,  # each evaluation generates eval_prompts x num_generations completions: the costly part
        "train_examples": 1000,
        "eval_prompts": 8,
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    },
}


def testbed_config(testbed: str, max_steps: int | None = None, sets: dict | None = None) -> dict:
    """The testbed's config values with `max_steps` and the `--set` values applied, and `eval_steps` from its
    `eval_points` (an evaluation at step 0 and every max_steps // eval_points steps).

    Raises:
        KeyError: an unknown testbed (the known ones named).
    """
    if testbed not in TESTBEDS:
        raise KeyError(f"no testbed {testbed!r}; allowed: {', '.join(TESTBEDS)}")
    bed = TESTBEDS[testbed]
    config = {**bed["config"], **(sets or {})}
    if max_steps is not None:
        config["max_steps"] = max_steps
    if bed["kind"] in ASYNC_KINDS:  # TRL's async trainer has no evaluation loop: HeldOutReward evaluates
        return config
    config.setdefault("eval_strategy", "steps")
    config.setdefault("eval_on_start", True)
    config.setdefault("eval_steps", max(1, config["max_steps"] // bed["eval_points"]))
    return config


def cell_config(source: str, testbed: str, setting: str, correction: str, max_steps: int | None = None,
                sets: dict | None = None) -> dict:
    """The config values of one cell: the testbed's, then the setting's and the correction's overrides (`staleness: k`
    made TRL's steps_per_generation), then the `--set` values again (they win)."""
    base = testbed_config(testbed, max_steps, sets)
    ga = base.get("gradient_accumulation_steps", 1)
    cell = staleness_overrides(ladder(source).overrides(setting, correction), ga,
                               samples_per_step=ga * base["per_device_train_batch_size"])
    return {**base, **cell, **(sets or {})}


ASYNC_KINDS = ("tiny_async", "smollm2_async")  # testbeds of the asynchronous trainer (benchmarks/async_ladder.py)


def datasets(testbed: str):
    """(train set, held-out set, reward funcs) of a testbed: the tiny prompts and `letter_reward`, or the arithmetic
    task with `eval_prompts` problems held out of its training set."""
    bed = TESTBEDS[testbed]
    if bed["kind"] in ("tiny", "tiny_async"):
        from grpo_ratio.testing import letter_reward, tiny_prompts

        return tiny_prompts(bed["train_prompts"]), tiny_prompts(bed["eval_prompts"], start=1000), [letter_reward]
    import random

    from datasets import Dataset

    from grpo_ratio.tasks import load_task
    from grpo_ratio.tasks.arithmetic import make_problem

    train, rewards = load_task("arithmetic", num_examples=bed["train_examples"], seed=0)
    rng, held = random.Random(1), {}
    while len(held) < bed["eval_prompts"]:  # distinct problems, none of them trained on
        question, gold = make_problem(rng, 10, ("+",))
        held[question] = gold
    train = train.filter(lambda row: row["prompt"][-1]["content"] not in held)
    system = train[0]["prompt"][0]
    held_out = Dataset.from_dict({"prompt": [[system, {"role": "user", "content": q}] for q in held],
                                  "answer": list(held.values())})
    return train, held_out, rewards


def _data(testbed: str, arch: str):
    """(model, tokenizer, train set, held-out set, reward funcs) of a synchronous testbed."""
    bed = TESTBEDS[testbed]
    train, held_out, rewards = datasets(testbed)
    if bed["kind"] == "tiny":
        from grpo_ratio.testing import peaked_model, tiny_tokenizer

        model = peaked_model(arch, scale=bed["head_scale"], never_eos=bed.get("never_eos", False))
        return model, tiny_tokenizer(), train, held_out, rewards
    from grpo_ratio.models import resolve_model

    model, tokenizer = resolve_model(bed["model"])
    return model, tokenizer, train, held_out, rewards


class CellRecord(TrainerCallback):
    """Writes the cell's `cell.json` at the end of training: who it is, the command that reproduces it, its CPU
    seconds (`time.process_time`, every thread of this process) and wall seconds; prints them."""

    def __init__(self, run_dir: Path, cell: dict):
        self.run_dir, self.cell = Path(run_dir), cell

    def on_train_begin(self, args, state, control, **kwargs):
        self.cpu, self.wall = time.process_time(), time.monotonic()

    def on_train_end(self, args, state, control, **kwargs):
        cpu, wall = time.process_time() - self.cpu, time.monotonic() - self.wall
        record = {**self.cell, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "steps": state.global_step}
        (self.run_dir / CELL_FILE).write_text(json.dumps(record, indent=1) + "\n")
        c = self.cell
        print(f"[ladder] cell {c['source']}/{c['setting']}/{c['correction']}-s{c['seed']}: CPU {cpu:.1f} s, "
              f"wall {wall:.1f} s, {state.global_step} steps", flush=True)


def cell_command(source: str, testbed: str, setting: str, correction: str, seed: int, max_steps: int | None,
                 sets: dict, output_root: str, name: str | None) -> str:
    """The command line that runs (or reads back) exactly this cell."""
    argv = ["python", "benchmarks/ladder.py", "--source", source, "--testbed", testbed, "--settings", setting,
            "--corrections", correction, "--seeds", str(seed)]
    if max_steps is not None:
        argv += ["--max_steps", str(max_steps)]
    argv += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    if output_root != "results/ladders":
        argv += ["--output_root", output_root]
    if name:
        argv += ["--name", name]
    return shlex.join(argv)


def _builder(source: str, testbed: str, setting: str, max_steps, sets: dict, output_root: str, name):
    def build(correction, seed, run_dir):
        from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer

        lad = ladder(source)
        values = cell_config(source, testbed, setting, correction, max_steps, sets)
        args = RatioGRPOConfig(output_dir=str(run_dir), seed=seed, run_name=f"{setting}-{correction}-s{seed}",
                               **values)
        model, tokenizer, train, held_out, rewards = _data(testbed, lad.arch)
        trainer = RatioGRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=train,
                                   eval_dataset=held_out, processing_class=tokenizer)
        cell = {"source": source, "testbed": testbed, "setting": setting, "correction": correction, "seed": seed,
                "config": values,
                "command": cell_command(source, testbed, setting, correction, seed, max_steps, sets, output_root,
                                        name)}
        trainer.add_callback(CellRecord(run_dir, cell))
        return trainer

    return build


def _parse_sets(items: list[str]) -> dict:
    """`KEY=VALUE` pairs, each VALUE read as JSON when it parses (numbers, true/false, null), else as a string."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def check_fields(source: str, sets: dict) -> None:
    """Refuse, before any training, a ladder whose config field this checkout lacks, or a `--set` key no config
    has.

    Raises:
        ValueError: naming the field; also a `--set` of a field the ladder's settings or corrections set.
    """
    from grpo_ratio import RatioAsyncGRPOConfig, RatioGRPOConfig

    config_cls = RatioAsyncGRPOConfig if ladder(source).trainer == "async" else RatioGRPOConfig
    fields = set(config_cls.__dataclass_fields__)
    need = ladder(source).needs_field
    if need and need not in fields:
        raise ValueError(f"the {source} ladder needs the config field {need!r}, which this checkout does not have yet")
    unknown = sorted(set(sets) - fields)
    if unknown:
        raise ValueError(f"--set {unknown[0]}: {config_cls.__name__} has no such field")
    lad = ladder(source)
    dial = {k for x in (*lad.settings, *lad.corrections) for k in staleness_overrides(x.overrides, 1)}
    dial |= {k for x in (*lad.settings, *lad.corrections) for k in x.overrides}
    if set(sets) & dial:
        raise ValueError(f"--set {sorted(set(sets) & dial)[0]}: the {source} ladder's settings or corrections set "
                         f"it; a cell's label would name what did not run")


def run_ladder(source: str, testbed: str = "tiny", settings=None, corrections=None, seeds=(0, 1, 2),
               max_steps: int | None = None, sets: dict | None = None, output_root: str = "results/ladders",
               name: str | None = None, figures: bool = True, show: bool = True) -> dict:
    """Run (or read back) every cell of a ladder and write its `ladder.json`; returns that summary.

    Args:
        source: a key of `grpo_ratio.ladder.LADDERS`.
        testbed: a key of `TESTBEDS`.
        settings, corrections: subsets (names) of the ladder's; None: all (at the reference setting only the
            uncorrected arm runs, unless `corrections` leaves it out).
        seeds: training seeds (data order and sampling).
        max_steps: overrides the testbed's steps (eval_steps follows).
        sets: extra config values for every cell (`--set KEY=VALUE`).
        output_root, name: the ladder folder is `output_root/name` (name: the source, `<source>-<testbed>` off tiny).
        figures: also draw the reward curves (`grpo_ratio.ladder.render.write_figures`) into the folder.

    Raises:
        KeyError: an unknown source, testbed, setting or correction.
        ValueError: a missing config field (`check_fields`).
        FileExistsError: a cell folder of another configuration.
    """
    from grpo_ratio.cli.compare import run_comparison

    sets = dict(sets or {})
    lad = ladder(source)
    check_fields(source, sets)
    testbed_config(testbed)  # KeyError for an unknown testbed before anything runs
    threads = TESTBEDS[testbed].get("threads")
    if threads:  # a tiny model's ops are too small to share: more threads only spin (70 s vs 4 s CPU for 10 steps)
        import torch

        torch.set_num_threads(threads)
    if (lad.trainer == "async") != (TESTBEDS[testbed]["kind"] in ASYNC_KINDS):
        kind = "an asynchronous" if lad.trainer == "async" else "a synchronous"
        allowed = [t for t, bed in TESTBEDS.items() if (bed["kind"] in ASYNC_KINDS) == (lad.trainer == "async")]
        raise ValueError(f"the {source} ladder runs on {kind} testbed ({', '.join(allowed)}), not {testbed!r}")
    chosen = [lad.setting(s).name for s in settings] if settings else [s.name for s in lad.settings]
    asked = [lad.correction(c).name for c in corrections] if corrections else None
    folder_name = name or (source if testbed in ("tiny", "tiny_async") else f"{source}-{testbed.split('_')[0]}")
    folder = Path(output_root) / folder_name

    def arms_at(setting: str) -> list[str]:
        if asked is None and setting == lad.reference:  # nothing for a correction to act on there, unless asked
            return [lad.uncorrected.name]
        return asked or [c.name for c in lad.corrections]

    def fingerprint(setting: str, correction: str) -> str:
        return json.dumps({"testbed": testbed, "config": cell_config(source, testbed, setting, correction, max_steps,
                                                                     sets), "arch": lad.arch},
                          sort_keys=True, default=str)

    if lad.trainer == "async":
        spec = importlib.util.spec_from_file_location("async_ladder", ROOT / "benchmarks" / "async_ladder.py")
        cells = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cells)
        cells.run_async_cells(lad, testbed, TESTBEDS[testbed], datasets(testbed), [(s, arms_at(s)) for s in chosen], list(seeds), folder, fingerprint,
                        lambda setting, c: cell_config(source, testbed, setting, c, max_steps, sets),
                        lambda setting, c, seed: cell_command(source, testbed, setting, c, seed, max_steps, sets,
                                                              output_root, name))
    for setting in chosen if lad.trainer == "sync" else ():
        arms = arms_at(setting)
        run_comparison(arms, list(seeds), _builder(source, testbed, setting, max_steps, sets, output_root, name),
                       name=setting, output_root=folder, last_k=10, baseline=lad.uncorrected.name, show=show,
                       fingerprints={c: fingerprint(setting, c) for c in arms})
    path = write_summary(folder)
    if figures:
        write_figures(folder, folder)
    if show:
        print_cells(folder)
        print(f"[ladder] summary: {path}")
    return json.loads(path.read_text())


def print_cells(folder: Path) -> None:
    """One line per cell of the folder: its CPU and wall seconds (from its cell.json)."""
    total = 0.0
    for cell_file in sorted(Path(folder).glob(f"*/*/{CELL_FILE}")):
        cell = json.loads(cell_file.read_text())
        total += cell.get("cpu_s") or 0.0
        print(f"[ladder] {cell_file.parent.relative_to(folder)}: CPU {cell.get('cpu_s')} s, wall {cell.get('wall_s')} "
              f"s, {cell.get('steps')} steps")
    print(f"[ladder] CPU time, all cells: {total:.0f} s")


def list_ladders() -> str:
    """The ladders in words: per source its dial, settings (with overrides) and corrections."""
    lines = []
    for lad in LADDERS.values():
        need = f" (needs the config field {lad.needs_field})" if lad.needs_field else ""
        lines.append(f"{lad.source}: {lad.description}{need}; dial {lad.dial}; reference {lad.reference}")
        lines += [f"  setting {s.name}: {s.overrides} - {s.description}" for s in lad.settings]
        lines += [f"  correction {c.name}{' (uncorrected)' if c.uncorrected else ''}: {c.overrides} - {c.description}"
                  for c in lad.corrections]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--source", choices=list(LADDERS), help="which ladder")
    parser.add_argument("--testbed", default="tiny", choices=list(TESTBEDS))
    parser.add_argument("--settings", nargs="+", help="setting names (default: all)")
    parser.add_argument("--corrections", nargs="+", help="correction names (default: all; the reference setting "
                                                        "runs the uncorrected arm only, unless they leave it out)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="training seeds")
    parser.add_argument("--max_steps", type=int, help="steps per run (default: the testbed's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value for every cell, e.g. --set learning_rate=1e-3 (repeatable)")
    parser.add_argument("--output_root", default="results/ladders")
    parser.add_argument("--name", help="the ladder folder's name (default: the source, <source>-<testbed> off tiny)")
    parser.add_argument("--no_figures", action="store_true", help="do not draw the reward curves")
    parser.add_argument("--list", action="store_true", help="print the ladders and exit")
    args = parser.parse_args(argv)
    if args.list:
        print(list_ladders())
        return 0
    if not args.source:
        parser.error("--source is required (or --list)")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds must be distinct, got {args.seeds}")
    try:
        run_ladder(args.source, args.testbed, args.settings, args.corrections, args.seeds, args.max_steps,
                   _parse_sets(args.set), args.output_root, args.name, figures=not args.no_figures)
    except (KeyError, ValueError, FileExistsError) as err:
        parser.error(str(err).strip("'\""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
