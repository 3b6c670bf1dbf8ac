"""Old-pass cost of each scoring mode under FSDP2 and DeepSpeed ZeRO-3, side by side: time as a ratio to `bf16` (TRL's
own pass) and the bytes each rank keeps for the mode, on 2 CPU processes (gloo).

One `accelerate launch` per engine and precision (FSDP2 with accelerate's bf16 policy and without; ZeRO-3 with bf16
and fp32), from the configs in recipes/accelerate_configs/. In each, a `RatioGRPOTrainer` takes one step (accelerate
wraps the model), then every mode scores the same right-padded batch, chunked like TRL's old pass, modes timed
round-robin (median of --repeats after a warm-up that builds the shadows). Each mode's log-probs are also compared
with the same mode on an unsharded replica of the gathered weights.

    python benchmarks/sharded_old_pass.py --json results/old_pass_sharded.json   # minutes on 2 CPU cores
    python benchmarks/sharded_old_pass.py --render results/old_pass_sharded.json  # the markdown table

ZeRO-3 runs need `pip install -e ".[deepspeed]"` (skipped otherwise). Extra bytes are what the mode keeps on a rank
between old passes (shadow partitions and buffers); the transient all-gathers of a forward are not counted (for
`fp32_head`/`guided_fp32` under ZeRO-3 bf16 one module's fp32 weights at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from grpo_ratio.config import PRECISION_MODES as MODES
from grpo_ratio.config import SCORER_MODES


ROOT = Path(__file__).resolve().parents[1]
RUNS = (("fsdp2", "bf16"), ("fsdp2", "fp32"), ("zero3", "bf16"), ("zero3", "fp32"))
MODEL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096)  # Llama-shaped, ~5M parameters: big enough to time on a CPU


# ---------------------------------------------------------------------------------------------------------------------
# worker: one engine and precision, inside `accelerate launch`


def small_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def wrapped_trainer(out_dir: str, engine: str, bf16: bool):
    """A bf16-mode trainer after one step: accelerate has wrapped (sharded) the model in place."""
    from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    # one short CPU step: 4 prompts x 4 generations, 8 tokens (the tests' tiny_grpo_args)
    args = RatioGRPOConfig(output_dir=out_dir, use_cpu=engine == "fsdp2", bf16=bf16, per_device_train_batch_size=4,
                           num_generations=4, max_completion_length=8, max_steps=1, logging_steps=1,
                           learning_rate=1e-2, report_to="none", save_strategy="no", seed=0,
                           gradient_checkpointing=False, disable_tqdm=True)
    trainer = RatioGRPOTrainer(model=small_model(), reward_funcs=letter_reward, args=args,
                               train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
    trainer.train()
    return trainer


def scoring_batch(rows: int, prompt_len: int, tokens: int, vocab: int):
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    ids = torch.randint(2, vocab, (rows, prompt_len + tokens), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)  # ragged completions, right-padded
    for i, n in enumerate(lengths.tolist()):
        mask[i, prompt_len + n:] = 0
    return ids, mask


def scorers(trainer, layers):
    """{mode: callable(ids, mask, T, batch_size) -> (B, T) log-probs}: TRL's own pass for bf16, else the scorer."""
    from trl import GRPOTrainer

    from grpo_ratio.old_pass.scorer import OldLogprobScorer
    from grpo_ratio.old_pass.sharding.engines import sharded_policy

    policy = trainer.accelerator.unwrap_model(trainer.model)
    out = {"bf16": lambda ids, mask, T, bs: GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, trainer.model, ids, mask, T, batch_size=bs)[0]}
    built = {}
    for mode in SCORER_MODES:
        scorer = OldLogprobScorer(policy, mode, layers=layers if mode == "guided_fp32" else None,
                                  policy_autocast=trainer.accelerator.autocast,
                                  sharded=sharded_policy(trainer.accelerator, policy))
        built[mode] = scorer
        out[mode] = lambda ids, mask, T, bs, s=scorer: s.score(ids, mask, T, batch_size=bs).logps
    return out, built


def policy_bytes(policy, engine: str) -> tuple[int, int]:
    """(this rank's bytes of the policy's parameters, number of parameters)."""
    if engine == "fsdp2":
        from grpo_ratio.old_pass.sharding.fsdp2 import reshard_all

        reshard_all(policy)
        local = [p.to_local() for p in policy.parameters()]
        return sum(t.numel() * t.element_size() for t in local), sum(p.numel() for p in policy.parameters())
    params = list(policy.parameters())
    return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params), sum(p.ds_numel for p in params)


def replica_gaps(trainer, engine, compute_dtype, layers, logps, ids, mask, T, bs) -> dict[str, float]:
    """max |mode - the same mode on an unsharded replica of the gathered weights| over valid tokens, per mode."""
    from grpo_ratio.testing.sharded import full_fp32_weights, replica_scorer

    policy = trainer.accelerator.unwrap_model(trainer.model)
    weights = full_fp32_weights(policy, engine)  # collective
    valid = mask[:, -T:].bool()  # (B, T)
    gaps = {}
    for mode in SCORER_MODES:
        reference = replica_scorer(policy, weights, mode, compute_dtype, layers=layers if mode == "guided_fp32"
                                   else None, policy_autocast=trainer.accelerator.autocast)
        gaps[mode] = (logps[mode] - reference.score(ids, mask, T, batch_size=bs).logps)[valid].abs().max().item()
    return gaps


def worker(a) -> None:
    import torch.distributed as dist

    from grpo_ratio.testing.sharded import patch_accelerate_for_cpu_sharding

    patch_accelerate_for_cpu_sharding()
    trainer = wrapped_trainer(a.out + ".run", a.engine, a.precision == "bf16")
    layers = [0]  # the first quarter of 4 decoder layers
    run, built = scorers(trainer, layers)
    ids, mask = scoring_batch(a.rows, a.prompt_len, a.tokens, MODEL["vocab_size"])
    with torch.no_grad():
        logps = {m: f(ids, mask, a.tokens, a.batch_size) for m, f in run.items()}  # warm-up: builds the shadows
        times = {m: [] for m in MODES}
        for _ in range(a.repeats):  # round-robin, so machine load hits every mode alike
            for mode, f in run.items():
                dist.barrier()
                t0 = time.perf_counter()
                f(ids, mask, a.tokens, a.batch_size)
                times[mode].append(time.perf_counter() - t0)
    compute = built["fp32_clone"].sharded.compute_dtype
    gaps = replica_gaps(trainer, a.engine, compute, layers, logps, ids, mask, a.tokens, a.batch_size)
    results = {m: {"seconds": statistics.median(times[m]), "max_abs_vs_replica": gaps.get(m),
                   "extra_bytes": 0 if m == "bf16" else built[m].extra_bytes()} for m in MODES}
    own_bytes, num_params = policy_bytes(trainer.accelerator.unwrap_model(trainer.model), a.engine)
    run_result = {"engine": a.engine, "precision": a.precision, "compute_dtype": str(compute).replace("torch.", ""),
                  "world_size": dist.get_world_size(), "num_params": num_params,
                  "policy_bytes_per_rank": own_bytes, "modes": results}
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, run_result)
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(per_rank, indent=1))


# ---------------------------------------------------------------------------------------------------------------------
# driver: one launch per engine and precision


def launch(engine: str, precision: str, a, tmp: Path) -> list[dict]:
    from grpo_ratio.testing.ranks import run_ranks
    from grpo_ratio.testing.sharded import cpu_launch_config

    recipe = ROOT / "recipes" / "accelerate_configs" / f"{engine}.yaml"
    config = cpu_launch_config(str(recipe), tmp, bf16=precision == "bf16")
    out = tmp / f"{engine}_{precision}.json"
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", config, __file__, "--worker",
           "--engine", engine, "--precision", precision, "--out", str(out), "--rows", str(a.rows), "--prompt-len",
           str(a.prompt_len), "--tokens", str(a.tokens), "--batch-size", str(a.batch_size), "--repeats",
           str(a.repeats)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1",
           "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    (proc,) = run_ranks([cmd], timeout=3600, envs=[env], cwd=tmp)  # nothing left behind, even on a timeout
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} {precision} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def render(result: dict) -> str:
    """Markdown table of a result (the JSON --json writes): one row per engine, precision and mode."""
    lines = [f"`{result['command']}` — {result['label']}, B={result['rows']} T={result['tokens']} "
             f"chunk={result['batch_size']}, guided layers [0] of 4, {result['world_size']} CPU processes "
             f"(gloo, 1 thread each), median of {result['repeats']}", "",
             "| engine | weights / compute | mode | time / bf16 | extra bytes per rank | extra B/param/rank "
             "| max abs diff vs unsharded replica |", "|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        engine = {"fsdp2": "FSDP2", "zero3": "ZeRO-3"}[run["engine"]]
        regime = f"{'bf16 on' if run['precision'] == 'bf16' else 'bf16 off'} / {run['compute_dtype']}"
        t_bf16 = run["modes"]["bf16"]["seconds"]
        for mode, r in run["modes"].items():
            diff = "—" if r["max_abs_vs_replica"] is None else f"{r['max_abs_vs_replica']:.1e}"
            lines.append(f"| {engine} | {regime} | {mode} | {r['seconds'] / t_bf16:.2f}x | {r['extra_bytes']:,} | "
                         f"{r['extra_bytes'] / run['num_params']:.2f} | {diff} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="completions B per rank")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="completion tokens T")
    p.add_argument("--batch-size", type=int, default=4, help="rows per forward chunk (per_device_train_batch_size)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="write the result to this JSON file")
    p.add_argument("--render", default=None, help="print the markdown table of a result JSON and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--precision", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return
    if a.worker:
        from grpo_ratio.testing.ranks import end_rank

        worker(a)
        end_rank()  # the trainer gone with worker(): the gloo group ends without a deadlock at exit
        return
    try:
        import deepspeed  # noqa: F401

        runs = RUNS
    except ImportError:
        print('deepspeed is not installed (pip install -e ".[deepspeed]"): ZeRO-3 rows skipped', file=sys.stderr)
        runs = tuple(r for r in RUNS if r[0] != "zero3")
    with tempfile.TemporaryDirectory() as tmp:
        per_run = [launch(engine, precision, a, Path(tmp)) for engine, precision in runs]
    for ranks in per_run:  # every rank keeps the same bytes (2 ranks, even shards up to padding)
        assert len({json.dumps({m: r["extra_bytes"] for m, r in x["modes"].items()}) for x in ranks}) == 1
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": f"python benchmarks/sharded_old_pass.py {argv_text}".strip(),
              "label": "Llama-shaped, 4 layers, hidden 256, V=4096, untied", "rows": a.rows, "tokens": a.tokens,
              "batch_size": a.batch_size, "repeats": a.repeats, "world_size": per_run[0][0]["world_size"],
              "torch": torch.__version__, "runs": [ranks[0] for ranks in per_run]}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()
