"""The logged ratio diagnostics of RatioGRPOTrainer on SmolLM2-135M-Instruct (CPU), one short run per setting.

Two tables, each setting a real `RatioGRPOTrainer.train()` of --steps steps on GSM8K test prompts (same seed, so
every setting samples the same step-1 rollouts; bf16 autocast, transformers generate):
- precision: old_logprob_mode bf16 / fp32_clone / fp16_clone at top_p=1: out-of-band rates of new/old and
  old/sampler, clip flips;
- truncation: an untruncated control, top_p=0.8 and top_k=20, each with truncation_correction=renormalize: mean
  old/sampler ratio before correction vs mean kept mass, and after correction.

    python benchmarks/ratio_smollm2.py --out results/ratio_smollm2.json      # ~15-25 min on 2 CPU cores
    python benchmarks/ratio_smollm2.py --table precision --steps 1           # one table

Writes the JSON (settings, every logged row) and prints markdown tables; docs/ratio_results.md is made from it by
`python benchmarks/ratio_smollm2.py --render results/ratio_smollm2.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

PRECISION = [dict(old_logprob_mode=m) for m in ("bf16", "fp32_clone", "fp16_clone")]
TRUNCATION = [
    dict(name="control (top_p=1.0)", truncation_correction="renormalize"),
    dict(name="top_p=0.8", top_p=0.8, truncation_correction="renormalize"),
    dict(name="top_k=20", top_k=20, truncation_correction="renormalize"),
]
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def run_setting(setting: dict, steps: int, prompts: int, generations: int, tokens: int, data: str,
                task: str = "gsm8k") -> dict:
    from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer
    from grpo_ratio.models import resolve_model
    from grpo_ratio.tasks import load_task

    model, tokenizer = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    if task == "gsm8k":
        dataset, rewards = load_task("gsm8k", dataset_path=data, split="test", num_examples=prompts * steps)
    else:  # arithmetic: rewards vary within a group, so advantages (and clip flips) are non-zero
        dataset, rewards = load_task("arithmetic", num_examples=prompts * steps)
    kwargs = {k: v for k, v in setting.items() if k != "name"}
    kwargs.setdefault("bf16", True)  # bf16 autocast unless the setting says otherwise
    args = RatioGRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0, max_steps=steps, logging_steps=1,
        per_device_train_batch_size=prompts * generations, num_generations=generations,
        max_completion_length=tokens, report_to="none", save_strategy="no", gradient_checkpointing=False,
        disable_tqdm=True, shuffle_dataset=False, **kwargs,
    )
    trainer = RatioGRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=dataset,
                               processing_class=tokenizer)
    t0 = time.perf_counter()
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return {"setting": setting, "seconds": time.perf_counter() - t0, "rows": rows}


def _mean(rows, key):
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else float("nan")


def _fmt(rows, key, spec):
    """Formatted mean of a logged key, or '-' where no row logged it (the metric is absent, not zero)."""
    value = _mean(rows, key)
    return "-" if value != value else format(value, spec)


def render(results: dict) -> str:
    out = [f"Command: `{results['command']}` ({results['config']})", ""]
    prec = [r for r in results["runs"] if r["table"] == "precision"]
    if prec:
        out += ["| old_logprob_mode | tokens | new/old OOB | new/old mean \\|log r\\| | old/sampler OOB | "
                "old/sampler mean r | clip flips | fp16 fallback rows |", "|---|---|---|---|---|---|---|---|"]
        for r in prec:
            rows = r["rows"]
            out.append(
                f"| {r['setting']['old_logprob_mode']} | {int(sum(x['ratio/new_old/num_tokens'] for x in rows))} | "
                f"{_mean(rows, 'ratio/new_old/oob_rate'):.2%} | {_mean(rows, 'ratio/new_old/mean_abs_log_ratio'):.2e} | "
                f"{_mean(rows, 'ratio/old_sampler/oob_rate'):.2%} | {_mean(rows, 'ratio/old_sampler/mean'):.4f} | "
                f"{_fmt(rows, 'ratio/clip_flip_rate', '.2%')} | {_fmt(rows, 'ratio/fp16_fallback_rows', '.0f')} |")
        out.append("")
    trunc = [r for r in results["runs"] if r["table"] == "truncation"]
    if trunc:
        out += ["| sampling | tokens | mean kept mass | old/sampler mean r (raw) | raw OOB | "
                "mean r after renormalize | OOB after renormalize |", "|---|---|---|---|---|---|---|"]
        for r in trunc:
            rows = r["rows"]
            out.append(
                f"| {r['setting']['name']} | {int(sum(x['ratio/old_sampler/num_tokens'] for x in rows))} | "
                f"{_mean(rows, 'ratio/kept_mass_mean'):.4f} | {_mean(rows, 'ratio/old_sampler/mean'):.4f} | "
                f"{_mean(rows, 'ratio/old_sampler/oob_rate'):.2%} | "
                f"{_mean(rows, 'ratio/old_sampler_corrected/mean'):.4f} | "
                f"{_mean(rows, 'ratio/old_sampler_corrected/oob_rate'):.2%} |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", choices=["precision", "truncation", "both"], default="both")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--tokens", type=int, default=48, help="max_completion_length")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="GSM8K JSONL (test split)")
    p.add_argument("--task", choices=["gsm8k", "arithmetic"], default="gsm8k")
    p.add_argument("--out", default="results/ratio_smollm2.json")
    p.add_argument("--render", default=None, help="print the markdown of an existing JSON and exit")
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return
    tables = {"precision": PRECISION, "truncation": TRUNCATION}
    chosen = ["precision", "truncation"] if a.table == "both" else [a.table]
    results = {"command": "python benchmarks/ratio_smollm2.py " + " ".join(argv or []),
               "config": f"{a.steps} step(s) x {a.prompts} prompts x {a.generations} completions, <= {a.tokens} "
                         f"tokens, {a.task} prompts, bf16 autocast, CPU", "runs": []}
    for table in chosen:
        for setting in tables[table]:
            print(f"[{table}] {setting}", flush=True)
            run = run_setting(setting, a.steps, a.prompts, a.generations, a.tokens, a.data, a.task)
            results["runs"].append({"table": table, **run})
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(results, indent=1))  # keep what is done if a later run fails
    print(render(results))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
