"""The mismatch in the peers' units (k1/k3 KL, chi-square, log-PPL, PPL ratio, ESS) per scoring arm: healthy values.

One short real `RatioGRPOTrainer.train()` per arm (same seed, bf16 autocast, transformers generate, untruncated
sampling), on the tiny test model (`--model tiny`, seconds per arm) or on SmolLM2-135M-Instruct with the arithmetic task
(`--model smollm2`, minutes per arm). The IS-weight keys need an IS weight in the loss, so one more arm runs `bf16` with
`is_correction="tis"`. docs/reading.md renders the table from the committed JSON:

    python benchmarks/mismatch_units.py --model tiny --out results/mismatch_units_tiny.json        # ~2 min, 2 cores
    python benchmarks/mismatch_units.py --model smollm2 --steps 4 --out results/mismatch_units_smollm2.json
    python benchmarks/mismatch_units.py --render results/mismatch_units_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

ARMS = [dict(old_logprob_mode=m) for m in ("bf16", "fp32_clone", "fp16_clone", "fp32_head", "sampler")]
ARMS.append(dict(old_logprob_mode="bf16", is_correction="tis"))
# (column, key): the new keys docs/reading.md gives healthy values for
COLUMNS = [
    ("new/old k1", "ratio/new_old/kl_k1"), ("new/old k3", "ratio/new_old/kl_k3"),
    ("new/old chi2_token", "ratio/new_old/chi2_token"),
    ("old/sampler k1", "ratio/old_sampler/kl_k1"), ("old/sampler k3", "ratio/old_sampler/kl_k3"),
    ("old/sampler log_ppl_abs_diff", "ratio/old_sampler/log_ppl_abs_diff"),
    ("old/sampler ppl_ratio", "ratio/old_sampler/ppl_ratio"), ("old/sampler chi2_token", "ratio/old_sampler/chi2_token"),
    ("old/sampler chi2_seq", "ratio/old_sampler/chi2_seq"), ("IS ESS", "ratio/is_weight_ess"),
    ("IS raw p1", "ratio/is_weight_raw/p1"), ("IS raw p99", "ratio/is_weight_raw/p99"),
]


def _name(arm: dict) -> str:
    return arm["old_logprob_mode"] + (f" + is_correction={arm['is_correction']}" if "is_correction" in arm else "")


def _setup(model_name: str, steps: int):
    """(model, tokenizer, dataset, rewards, size args) of the tiny test model or of SmolLM2 on arithmetic."""
    if model_name == "tiny":
        from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer

        return (tiny_model("qwen2"), tiny_tokenizer(), tiny_prompts(8), letter_reward,
                dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-2))
    from grpo_ratio.models import resolve_model
    from grpo_ratio.tasks import load_task

    model, tokenizer = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    dataset, rewards = load_task("arithmetic", num_examples=2 * steps)
    return (model, tokenizer, dataset, rewards,
            dict(per_device_train_batch_size=8, num_generations=8, max_completion_length=32, learning_rate=1e-6))


def run_arm(arm: dict, model_name: str, steps: int) -> list[dict]:
    """The log rows of one arm's run (`steps` optimizer steps, logged every step)."""
    from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer

    model, tokenizer, dataset, rewards, size = _setup(model_name, steps)
    with tempfile.TemporaryDirectory() as out:
        args = RatioGRPOConfig(output_dir=out, use_cpu=True, bf16=True, max_steps=steps, logging_steps=1, seed=0,
                               report_to="none", save_strategy="no", gradient_checkpointing=False,
                               disable_tqdm=True, **size, **arm)
        trainer = RatioGRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=dataset,
                                   processing_class=tokenizer)
        trainer.train()
    return [row for row in trainer.state.log_history if "loss" in row]


def render(path: str) -> str:
    """Markdown: per arm, the mean over logged steps of each column's key ("–" where the arm does not log it)."""
    data = json.loads(Path(path).read_text())
    lines = ["| arm | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for run in data["runs"]:
        cells = []
        for _, key in COLUMNS:
            values = [row[key] for row in run["rows"] if row.get(key) is not None]
            cells.append(f"{statistics.fmean(values):.3g}" if values else "–")
        lines.append(f"| {run['arm']} | " + " | ".join(cells) + " |")
    s = data["settings"]
    lines += ["", f"{s['model']}, {s['steps']} steps per arm, bf16 autocast, untruncated sampling, seed 0; mean over the "
                  f"logged steps. Command: `{s['command']}`."]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--render", metavar="JSON", help="print the markdown table of a committed JSON and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(args.render))
        return
    runs = [{"arm": _name(arm), "config": arm, "rows": run_arm(arm, args.model, args.steps)} for arm in ARMS]
    command = f"python benchmarks/mismatch_units.py --model {args.model} --steps {args.steps}"
    data = {"settings": {"model": "tiny Qwen2 (2 layers, hidden 64)" if args.model == "tiny"
                         else "SmolLM2-135M-Instruct, arithmetic", "steps": args.steps, "command": command},
            "runs": runs}
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    tmp = Path(tempfile.mkdtemp()) / "mismatch_units.json"
    tmp.write_text(json.dumps(data))
    print(render(str(tmp)))


if __name__ == "__main__":
    main()
