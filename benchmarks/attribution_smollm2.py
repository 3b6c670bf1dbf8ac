"""Where log(new) - log(sampler) comes from on SmolLM2-135M-Instruct (CPU): the `ratio_attribution` terms per arm.

Four real `RatioGRPOTrainer.train()` runs with the values of the SmolLM2 arithmetic recipe (fp32 weights, bf16
autocast, transformers generate, 2 prompts x 4 completions of at most 16 tokens): old_logprob_mode bf16 / fp32_clone
x top_p 0.8 / 1.0, each with `ratio_attribution=True` and `num_iterations=2` (TRL runs its old pass, so the drift
term is measured). Per run: the mean over the logged steps of each term's mean_abs, share and signed mean, the
identity error and TRL's step_time. Cost: two more runs, bf16 at top_p=0.8 with and without `ratio_attribution`
(same seed and steps), and the ratio of their mean step_time.

    python benchmarks/attribution_smollm2.py --steps 3 --json results/attribution_smollm2.json   # ~11 min, 2 shared cores
    python benchmarks/attribution_smollm2.py --render results/attribution_smollm2.json           # the markdown
    python benchmarks/attribution_smollm2.py --steps 3 --cost-rounds 2 --json results/attribution_smollm2.json
        # the cost alone, again: with/without pairs run alternately, replacing the result's cost (idle machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import yaml  # noqa: E402

# no torch import at module level: rendering a result stays light
from grpo_ratio.analysis.plots import arm_label  # noqa: E402
from grpo_ratio.diagnostics import metric_keys as keys  # noqa: E402
from grpo_ratio.machine import describe_machine, machine_record  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/smollm2-135m/arithmetic/bf16.yaml"
RUNS = [dict(old_logprob_mode=m, top_p=p) for m in ("bf16", "fp32_clone") for p in (0.8, 1.0)]
COST = [dict(old_logprob_mode="bf16", top_p=0.8), dict(old_logprob_mode="bf16", top_p=0.8, ratio_attribution=None)]
TASK_KEYS = {"num_examples": "num_examples", "task_seed": "seed", "max_operand": "max_operand",
             "operations": "operations"}


def read_recipe(path: str | Path) -> dict:
    """The key/value pairs of a recipe YAML."""
    return yaml.safe_load(Path(path).read_text())


def run_one(recipe: dict, fields: dict, steps: int) -> dict:
    """One training run: the recipe's trainer fields, the attribution defaults, then `fields`; its logged rows."""
    from transformers import set_seed

    from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer
    from grpo_ratio.models import load_tokenizer, resolve_model_path
    from grpo_ratio.tasks import load_task

    path = resolve_model_path(recipe["model_name_or_path"])
    dataset, rewards = load_task(recipe["task"], **{kw: recipe[k] for k, kw in TASK_KEYS.items() if k in recipe})
    names = {k for k, f in RatioGRPOConfig.__dataclass_fields__.items() if f.init}
    values = {k: v for k, v in recipe.items() if k in names}
    values.update(ratio_attribution=True, ratio_diagnostics=True, num_iterations=2)
    values.update(fields)
    with tempfile.TemporaryDirectory() as out:
        values.update(output_dir=out, report_to="none", save_strategy="no", max_steps=steps, disable_tqdm=True,
                      model_init_kwargs={"dtype": recipe.get("dtype", "float32")})
        set_seed(values["seed"])
        trainer = RatioGRPOTrainer(model=path, reward_funcs=rewards, args=RatioGRPOConfig(**values),
                                   train_dataset=dataset, processing_class=load_tokenizer(path))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    return {"fields": fields, "seconds": seconds, "rows": [r for r in trainer.state.log_history if "loss" in r]}


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def summarise(run: dict) -> dict:
    """The mean over logged steps of every attribution key, the identity error and step_time (None: never logged)."""
    names = [keys.attribution_key(t, s) for t in keys.ATTRIBUTION_TERMS for s in keys.ATTRIBUTION_STATS]
    return {k: _mean(run["rows"], k) for k in (*names, keys.ATTRIBUTION_IDENTITY_ERROR, "step_time")}


def _cell(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def recorded_terms(data: dict) -> list[str]:
    """The attribution terms a result holds, in `metric_keys.ATTRIBUTION_TERMS` order: all six for a result recorded
    now; five (no `train_precision`) for one recorded before `drift` was split, whose `drift` is new - old at the
    first inner step, today's `train_precision`."""
    summaries = [run["summary"] for run in data["runs"]]
    return [t for t in keys.ATTRIBUTION_TERMS if all(keys.attribution_key(t, "share") in m for m in summaries)]


def _arm(fields: dict) -> str:
    # the benchmark's runs train under bf16 autocast (the recipe's bf16=True): `bf16` is TRL's own pass in bf16
    return arm_label(fields["old_logprob_mode"], bf16=True)


def render(data: dict) -> str:
    s = data["settings"]
    out = [f"Command: `{s['command']}`. {s['model']}, {s['steps']} steps per run, {s['config']}; "
           f"{describe_machine(data.get('machine'))}.", ""]
    terms = recorded_terms(data)
    out += ["| arm | top_p | " + " | ".join(f"{t}: share, mean" for t in terms) + " | identity error |",
            "|---" * (len(terms) + 3) + "|"]
    for run in data["runs"]:
        m = run["summary"]
        cells = [f"{_cell(m[keys.attribution_key(t, 'share')], '.1%')}, "
                 f"{_cell(m[keys.attribution_key(t, 'mean')], '+.4f')}" for t in terms]
        out.append(f"| {_arm(run['fields'])} | {run['fields']['top_p']} | " + " | ".join(cells)
                   + f" | {_cell(m[keys.ATTRIBUTION_IDENTITY_ERROR], '.1e')} |")
    if "train_precision" not in terms:
        out += ["", f"Recorded with the {len(terms)} terms of the time ({', '.join(terms)}): their `drift` is "
                "new - old at the first inner step, which is today's `train_precision` (how the training forward "
                "computes against the old pass); today's `drift`, what moved since the batch was generated, is 0 "
                "there."]
    c = data["cost"]
    if "rounds" in c:  # alternating pairs (--cost-rounds)
        out += ["", "Share: the term's part of the summed |terms|; mean: its signed mean (nats per token); mean over "
                "the steps that logged the attribution (those with a first inner step).", "",
                f"Cost: bf16, top_p=0.8, {c['rounds']} pairs run alternately (with, without), {s['steps']} steps "
                f"each, same seed: mean step_time {c['with']:.1f} s with `ratio_attribution` (every row) vs "
                f"{c['without']:.1f} s without, x{c['ratio']:.2f} (median of the pairs' ratios; per pair "
                f"{', '.join(f'x{r:.2f}' for r in c['pair_ratios'])}); load {c['load_before']:.2f} at the start."]
        return "\n".join(out)
    twin = next(r["summary"]["step_time"] for r in data["runs"] if r["fields"] == COST[0])  # the same configuration
    out += ["", "Share: the term's part of the summed |terms|; mean: its signed mean (nats per token); mean over the "
            "steps that logged the attribution (those with a first inner step).", "",
            f"Cost: bf16, top_p=0.8, mean step_time {c['with']:.1f} s with `ratio_attribution` vs {c['without']:.1f} s "
            f"without: x{c['ratio']:.2f} (one run each, {s['steps']} steps, same seed, on a shared machine). The "
            f"table's bf16 top_p=0.8 run, the same configuration as the first, took {twin:.1f} s per step "
            f"(x{twin / c['without']:.2f}): two runs of one configuration differ x{max(twin, c['with']) / min(twin, c['with']):.1f} "
            "here, so these runs do not resolve the cost."]
    return "\n".join(out)


def cost_only(recipe: dict, args) -> None:
    """`--cost-rounds N`: N (with, without) pairs alternately; their step times replace the cost in `--json`."""
    if not args.json or not Path(args.json).is_file():
        raise SystemExit("--cost-rounds needs --json naming an existing result (its table stays, its cost is replaced)")
    data = json.loads(Path(args.json).read_text())
    load = machine_record().get("load_before")
    pairs = []
    for r in range(args.cost_rounds):
        pair = []
        for fields in COST:
            print(f"cost round {r + 1}/{args.cost_rounds}: {fields}", flush=True)
            run = run_one(recipe, fields, args.steps)
            pair.append(summarise(run)["step_time"])
        pairs.append(pair)
    ratios = [w / wo for w, wo in pairs]
    data["cost_runs"] = [{"fields": f, "step_time": t} for pair in pairs for f, t in zip(COST, pair)]
    data["cost"] = {"rounds": args.cost_rounds, "with": statistics.fmean(p[0] for p in pairs),
                    "without": statistics.fmean(p[1] for p in pairs), "ratio": statistics.median(ratios),
                    "pair_ratios": ratios, "load_before": load,
                    "command": f"python benchmarks/attribution_smollm2.py --steps {args.steps} "
                               f"--cost-rounds {args.cost_rounds} --json {args.json}"}
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(render(data))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--json", help="write the result JSON here")
    parser.add_argument("--render", metavar="JSON", help="print the markdown of a result JSON and exit")
    parser.add_argument("--cost-rounds", type=int, default=0, help="only the cost: this many (with, without) pairs "
                        "run alternately, replacing the cost of the result in --json")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    recipe = read_recipe(ROOT / args.recipe)
    if args.cost_rounds:
        cost_only(recipe, args)
        return
    data = {"settings": {"command": f"python benchmarks/attribution_smollm2.py --steps {args.steps}",
                         "model": "SmolLM2-135M-Instruct, arithmetic", "steps": args.steps, "recipe": args.recipe,
                         "config": f"{recipe['per_device_train_batch_size'] // recipe['num_generations']} prompts x "
                                   f"{recipe['num_generations']} completions, <= {recipe['max_completion_length']} "
                                   "tokens, num_iterations=2, bf16 autocast, generate, seed "
                                   f"{recipe['seed']}"},
            "machine": machine_record(), "runs": [], "cost_runs": []}
    for fields in RUNS + COST:
        print(f"run {fields}", flush=True)
        run = run_one(recipe, fields, args.steps)
        run["summary"] = summarise(run)
        data["runs" if len(data["runs"]) < len(RUNS) else "cost_runs"].append(run)
        if args.json:  # keep what is done if a later run fails
            Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    with_, without = (r["summary"]["step_time"] for r in data["cost_runs"])
    data["cost"] = {"with": with_, "without": without, "ratio": with_ / without}
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(render(data))


if __name__ == "__main__":
    main()
