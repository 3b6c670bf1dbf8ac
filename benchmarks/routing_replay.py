"""What MoE routing replay costs and what it removes: `routing_replay` none / R2 / R3 side by side in one process.

Arms (`ARMS`): `RatioGRPOTrainer` on one MoE model with `routing_replay` = "none", "R2", "R3" and the route metrics on
(`ratio_diagnostics=True`: every pass records its routes, `ratio/route/*`), and `stock`: "none" with
`ratio_diagnostics=False`, where no hook is put on the routers at all (stock TRL's cost). Every arm: TRL's default
old-log-prob path (`old_logprob_mode="bf16"`), bf16 autocast on CPU, `num_iterations=2` (TRL runs its own old pass and
two updates per generation, so R2 has routes to replay), activation checkpointing on (the routers fire again in the
backward recompute), transformers `generate` as the sampler (R3's routes are recorded while it decodes).

Rounds are interleaved so machine load hits every arm alike: each round trains every arm in turn (order rotated by
one per round) for --warmup + --steps optimizer steps with seed = round index, then frees it.

    python benchmarks/routing_replay.py --model tiny --rounds 1 --steps 2        # seconds: a smoke run
    python benchmarks/routing_replay.py --model tiny --rounds 5 --steps 4 --json results/routing_replay_tiny.json
    python benchmarks/routing_replay.py --render results/routing_replay_tiny.json            # cost table
    python benchmarks/routing_replay.py --render-keys results/routing_replay_tiny.json       # route-key table

Models (random weights, built from a config; the tokenizer is `grpo_ratio.testing.tiny_tokenizer`, 300 ids):
`tiny` = `grpo_ratio.testing.tiny_model("qwen3_moe")` (2 MoE layers, 4 experts, top-2, hidden 64); `smollm2` = a
Qwen3-MoE with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads) and 8 experts of width 384, top-2.
Step time: wall seconds from `on_step_begin` to `on_step_end` (generation, old pass, both updates, optimizer), the
--warmup steps left out. Route bytes: the route tensors one generation batch holds ((B, S, L, k) int16: the sampler's
and the old pass's), per position of TRL's padded batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

# torch, transformers and grpo_ratio are imported where used: rendering a result costs no heavy import.

ARMS = {  # arm -> (routing_replay, ratio_diagnostics)
    "stock": ("none", False),
    "none": ("none", True),
    "R2": ("R2", True),
    "R3": ("R3", True),
}
REFERENCE = "none"  # step-time ratios are taken against the measured "none" arm
ROUTE_STATS = ("any_layer", "native_any_layer")
PAIRS = ("sampler_old", "old_new")
OTHER_KEYS = ("ratio/new_old/oob_rate", "ratio/old_sampler/oob_rate")


def build_model(name: str):
    """(model, description) of a benchmark model."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from grpo_ratio.testing import tiny_model

    if name == "tiny":
        return tiny_model("qwen3_moe"), "tiny Qwen3-MoE (grpo_ratio.testing.tiny_model('qwen3_moe'))"
    import torch

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=300, hidden_size=576, intermediate_size=1536, moe_intermediate_size=384,
                            num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, tie_word_embeddings=True,
                            pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model, "Qwen3-MoE of SmolLM2-135M's shape, 8 experts x 384, top-2, random weights"


def trainer_args(arm: str, seed: int, max_steps: int, output_dir: str):
    from grpo_ratio import RatioGRPOConfig

    replay, diagnostics = ARMS[arm]
    return RatioGRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=True, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=16, num_iterations=2, gradient_checkpointing=True, learning_rate=1e-3,
        max_steps=max_steps, logging_steps=1, report_to="none", save_strategy="no", seed=seed, disable_tqdm=True,
        routing_replay=replay, ratio_diagnostics=diagnostics,
    )


def run_arm(arm: str, model_name: str, seed: int, warmup: int, steps: int, workdir: str) -> dict:
    """Train one arm's fresh trainer; its step seconds, logged route metrics and route bytes per position."""
    from transformers import TrainerCallback, set_seed

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    set_seed(seed)
    model, _ = build_model(model_name)
    trainer = RatioGRPOTrainer(model=model, reward_funcs=letter_reward, args=trainer_args(arm, seed, warmup + steps,
                               workdir), train_dataset=tiny_prompts(16), processing_class=tiny_tokenizer())
    trainer.add_callback(Clock())
    set_seed(seed)
    trainer.train()
    generation = trainer._generations.get("train")
    routes = generation.routes if generation is not None else None
    held = [t for t in (routes.sampler, routes.old) if t is not None] if routes is not None else []
    positions = held[0].shape[0] * held[0].shape[1] if held else 0
    keys = [f"ratio/route/{p}/{s}" for p in PAIRS for s in ROUTE_STATS] + list(OTHER_KEYS)
    metrics = {k: [row[k] for row in trainer.state.log_history if k in row] for k in keys}
    out = {"arm": arm, "seed": seed, "step_seconds": times[warmup:], "metrics": {k: v for k, v in metrics.items() if v},
           "route_bytes_per_position": sum(t.numel() * t.element_size() for t in held) / positions if held else 0.0}
    del trainer, model
    gc.collect()
    return out


def model_facts(model_name: str) -> dict:
    from grpo_ratio.routing import moe_layout

    model, description = build_model(model_name)
    layout = moe_layout(model)
    return {"name": model_name, "description": description, "num_layers": layout.num_layers,
            "moe_layers": len(layout.moe_layers), "num_experts": layout.num_experts, "top_k": layout.top_k,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes_per_token": layout.num_layers * layout.top_k * 2}  # (L, k) int16 per position


def run(model_name: str, rounds: int, warmup: int, steps: int, command: str, save=None, log=print) -> dict:
    import torch
    import transformers

    result = {"command": command, "model": model_facts(model_name), "rounds": rounds, "warmup": warmup,
              "steps": steps, "arms": list(ARMS), "reference": REFERENCE, "runs": [],
              "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
                          "torch_threads": torch.get_num_threads()}}
    order = list(ARMS)
    with tempfile.TemporaryDirectory(prefix="routing_replay_") as tmp:
        for r in range(rounds):
            for arm in order[r % len(order):] + order[: r % len(order)]:
                run_ = run_arm(arm, model_name, r, warmup, steps, tmp) | {"round": r}
                log(f"round {r} {arm}: mean step {statistics.fmean(run_['step_seconds']):.3f} s")
                result["runs"].append(run_)
                if save:
                    save(result)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# rendering


def _per_arm(result: dict) -> dict:
    """arm -> {the median over rounds of the round's mean step seconds, the median of per-round ratios to the
    reference, metric means over every logged step, route bytes}. A round's mean spans whole generation cycles (a
    step that generates, then one that reuses the batch) when --steps is even."""
    runs, out = result["runs"], {}
    reference = {r["round"]: statistics.fmean(r["step_seconds"]) for r in runs if r["arm"] == result["reference"]}
    for arm in result["arms"]:
        mine = [r for r in runs if r["arm"] == arm]
        if not mine:
            continue
        ratios = [statistics.fmean(r["step_seconds"]) / reference[r["round"]] for r in mine if r["round"] in reference]
        metrics = {}
        for r in mine:
            for k, v in r["metrics"].items():
                metrics.setdefault(k, []).extend(v)
        out[arm] = {"median": statistics.median(statistics.fmean(r["step_seconds"]) for r in mine),
                    "ratio": statistics.median(ratios) if ratios else None,
                    "metrics": {k: (statistics.fmean(v), min(v), max(v)) for k, v in metrics.items()},
                    "bytes": statistics.fmean(r["route_bytes_per_position"] for r in mine), "rounds": len(mine)}
    return out


def _header(result: dict) -> str:
    m = result["model"]
    return (f"{m['description']}: {m['num_layers']} decoder layers ({m['moe_layers']} MoE), {m['num_experts']} "
            f"experts, top-{m['top_k']}, {m['parameters'] / 1e6:.2f} M parameters; {result['rounds']} interleaved "
            f"rounds x {result['steps']} timed steps per arm ({result['warmup']} warm-up), {result['machine']['cpus']} "
            f"CPUs, torch {result['machine']['torch']}. `{result['command']}`")


def render(result: dict) -> str:
    """Markdown: per arm the median step time, its ratio to `none`, and the route tensors held per position."""
    arms, m = _per_arm(result), result["model"]
    lines = [_header(result), "", "| arm | routing_replay | route hooks | step (s) | x none | "
             "route tensors held per position (bytes) |", "|---|---|---|---|---|---|"]
    for arm, s in arms.items():
        replay, measured = ARMS[arm]
        hooks = "record + replay" if replay != "none" else ("record" if measured else "none")
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.3f}"
        lines.append(f"| {arm} | {replay} | {hooks} | {s['median']:.3f} | {ratio} | {s['bytes']:.0f} |")
    lines += ["", "Step: the mean of a round's timed steps, median over rounds; x none: the median over rounds of the "
                  "round's ratio to `none` (same seed, same round).", f"One route tensor: {m['num_layers']} layers x top-{m['top_k']} x 2 bytes (int16) = "
                  f"{m['bytes_per_token']} bytes per position; a generation batch holds the sampler's and the old "
                  f"pass's (`stock` holds none)."]
    return "\n".join(lines)


def _cell(stats) -> str:
    if stats is None:
        return "-"
    mean, low, high = stats
    return f"{100 * mean:.2f}% ({100 * low:.2f}-{100 * high:.2f})"


def render_keys(result: dict) -> str:
    """Markdown: per route key the run mean (min-max over logged steps) under each measured arm."""
    arms = {a: s for a, s in _per_arm(result).items() if ARMS[a][1]}
    keys = [f"ratio/route/{p}/{s}" for p in PAIRS for s in ROUTE_STATS] + list(OTHER_KEYS)
    lines = [_header(result), "", "| key | " + " | ".join(f"`routing_replay={a!r}`" if a != "none" else "`none`"
                                                        for a in arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for key in keys:
        lines.append(f"| `{key}` | " + " | ".join(_cell(s["metrics"].get(key)) for s in arms.values()) + " |")
    lines += ["", "Share of tokens, mean over every logged step of every round (min-max); '-': not logged for that "
                  "arm."]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each runs every arm")
    p.add_argument("--steps", type=int, default=4, help="timed optimizer steps per arm and round (even: whole "
                                                         "generation cycles, num_iterations=2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per arm and round")
    p.add_argument("--json", default=None, help="also write the result to this JSON file (after every arm)")
    p.add_argument("--render", default=None, help="print the cost table of a result JSON and exit")
    p.add_argument("--render-keys", default=None, help="print the route-key table of a result JSON and exit")
    a = p.parse_args(argv)
    if a.render or a.render_keys:
        result = json.loads(Path(a.render or a.render_keys).read_text())
        print(render(result) if a.render else render_keys(result))
        return
    command = "python benchmarks/routing_replay.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def save(result):
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1))

    result = run(a.model, a.rounds, a.warmup, a.steps, command, save,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(render(result) + "\n\n" + render_keys(result))


if __name__ == "__main__":
    main()
