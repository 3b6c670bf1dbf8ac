"""Peak memory of one GRPO step in every scoring mode next to stock TRL, at a real vocabulary (issue 31, item 1).

TRL 1.16 never builds (rows, T, V) logits: its old pass and training forward project the hidden states through the
LM head in tiles (`trl.kernels.ChunkedLogProbFunction`). grpo_ratio's scoring modes, the fused `fp32_head`, the
kept-set log-probs (with and without autograd) and `ratio_full_vocab` do the same (docs/benchmarks.md, "Memory at a
real vocabulary"); this benchmark measures what a whole step costs against stock TRL's.

The model: a tiny-depth Qwen2 (2 layers, hidden 64) with Qwen2.5's vocabulary, V = 151,936, untied; its head is
50 times the random one with the EOS row zeroed, so that next-token distributions are peaked as a trained model's
and no completion ever ends early: every completion is `--tokens` long. A word-level tokenizer with the same
vocabulary. One prompt x 4 completions per step, bf16 autocast on CPU (TRL's default on this machine).

Each arm runs in its own process (the parent re-runs this file with `--arm`), so no arm inherits another's heap:
the RSS once its trainer is built is the baseline, and the peak RSS during `train()` of one optimizer step
(`max_steps=1`: generation, the old pass where the arm has one, loss, backward and AdamW's first step) minus that
baseline is the arm's increment (`grpo_ratio.machine.PeakRSS`: the kernel's VmHWM after a reset). The goal of issue
31: every arm's increment at most 1.25 x stock TRL's increment plus one fp32 copy of the model.

    nice -n 19 python benchmarks/peak_memory.py --tokens 1024 --json results/peak_memory_1024.json
    python benchmarks/peak_memory.py --render results/peak_memory_1024.json   # the markdown table of a result
    python benchmarks/peak_memory.py --device cuda --shape 1.5b --tokens 1024   # on a GPU (scripts/gpu_check.sh)

On a GPU (`--device cuda`) the increment is `torch.cuda.max_memory_allocated()` during `train()` minus
`torch.cuda.memory_allocated()` once the trainer is built (tensors only: the caching allocator's reserve is not
counted), and `--shape 1.5b` builds a Qwen2.5-1.5B-shaped model (28 layers, hidden 1,536, untied) from its config.

Caveats: RSS counts every resident page of the process, not only tensors; large allocations are made to return to
the OS when freed (glibc `mallopt`, `grpo_ratio.machine.steady_malloc`), so one allocation's freed memory does not
hide the next one's growth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

# no torch import at module level: rendering a result stays light (scripts/update_docs.py, tests/test_docs.py)
from grpo_ratio.machine import PeakRSS, describe_machine, machine_record, release_memory, rss_bytes, steady_malloc  # noqa: E402, E501


VOCAB = 151_936  # Qwen2.5's vocabulary
REFERENCE = "trl"  # the arm every ratio is taken against
GOAL_RATIO = 1.25  # issue 31: increment <= 1.25 x stock TRL's + one fp32 copy of the model
ROWS = 4  # completions per step: one prompt x 4 generations, one micro-batch
# model shapes (Qwen2 configs, untied: TRL's cast_lm_head_to_fp32 needs an untied head); random weights, no Hub
SHAPES = {
    "tiny": {},  # grpo_ratio.testing.tiny_config("qwen2"): 2 layers, hidden 64
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "max_position_embeddings": 32768},  # Qwen2.5-1.5B's shape
}


@dataclass(frozen=True)
class Arm:
    """One trainer configuration: `trainer` is "trl" (stock `trl.GRPOTrainer`) or "ratio" (`RatioGRPOTrainer`);
    `fields` are config fields set on top of the common ones."""

    name: str
    trainer: str
    fields: dict = field(default_factory=dict)


ARMS = (
    Arm(REFERENCE, "trl"),
    Arm("trl_cast_lm_head_to_fp32", "trl", {"cast_lm_head_to_fp32": True}),  # the model's head is untied
    Arm("bf16", "ratio", {"old_logprob_mode": "bf16"}),
    Arm("fp32_clone", "ratio", {"old_logprob_mode": "fp32_clone"}),
    Arm("fp16_clone", "ratio", {"old_logprob_mode": "fp16_clone"}),
    Arm("fp32_head", "ratio", {"old_logprob_mode": "fp32_head"}),
    Arm("guided_fp32", "ratio", {"old_logprob_mode": "guided_fp32", "guided_fp32_layers": "0"}),
    Arm("sampler", "ratio", {"old_logprob_mode": "sampler"}),
    # a kept-set correction on TRL's own pass: the generate recording's kept sets, log-probs over them in the old
    # pass (no grad) and in the training forward (autograd, recomputed in backward)
    Arm("renormalize", "ratio", {"old_logprob_mode": "bf16", "top_p": 0.9, "truncation_correction": "renormalize"}),
)


# ---------------------------------------------------------------------------------------------------------------------
# one arm, in its own process


def vocab_tokenizer(vocab_size: int):
    """A word-level tokenizer of exactly `vocab_size` tokens: <pad> 0, <eos> 1, <unk> 2, the prompts' words, then
    fillers `w<i>`; decoding joins tokens with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo_ratio.testing import tiny_prompts

    words = ["<pad>", "<eos>", "<unk>"]
    words += sorted({w for prompt in tiny_prompts(8)["prompt"] for w in prompt.split()})
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   padding_side="left")


def never_eos_model(vocab_size: int, scale: float = 50.0, eos_token_id: int = 1, shape: str = "tiny"):
    """`grpo_ratio.testing.tiny_model` (Qwen2, 2 layers, hidden 64, untied) at `vocab_size`, its head `scale` times
    the random one (peaked next-token distributions) with the EOS row zero: EOS is never sampled, every completion
    runs to `max_completion_length` (tests/trainer_fixtures.py `peaked_model(never_eos=True)`)."""
    import torch

    from grpo_ratio.testing import tiny_model

    model = tiny_model("qwen2", vocab_size=vocab_size, **SHAPES[shape])
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(scale)
        head[eos_token_id] = 0.0
    return model


def arm_config(arm: Arm, tokens: int, output_dir: str, device: str = "cpu"):
    """The arm's config: the common values (one step of one prompt x 4 completions of exactly `tokens` tokens) and
    the arm's fields, in TRL's `GRPOConfig` for stock arms."""
    from trl import GRPOConfig

    from grpo_ratio import RatioGRPOConfig

    values = dict(output_dir=output_dir, use_cpu=device == "cpu", bf16=True, per_device_train_batch_size=ROWS,
                  num_generations=ROWS, max_completion_length=tokens, max_steps=1, logging_steps=1,
                  learning_rate=1e-6, report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                  gradient_checkpointing=False, **arm.fields)
    return (GRPOConfig if arm.trainer == "trl" else RatioGRPOConfig)(**values)


def run_arm(arm: Arm, tokens: int, device: str = "cpu", shape: str = "tiny") -> dict:
    """Build the arm's trainer, then train one step: the memory before `train()` and the peak during it (bytes):
    the process's RSS on the CPU, the CUDA allocator's tensors on a GPU."""
    import torch
    from transformers import set_seed
    from trl import GRPOTrainer

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts

    if shape != "tiny" and device != "cuda":
        raise SystemExit(f"--shape {shape} runs on a GPU only (--device cuda): its arms would be built and trained "
                         f"on the CPU")
    steady_malloc()
    with tempfile.TemporaryDirectory(prefix="peak_memory_") as tmp:
        set_seed(0)
        with torch.device(device):  # on a GPU the weights are initialised there, not on the CPU and moved
            model = never_eos_model(VOCAB, shape=shape)
        model_fp32_bytes = sum(p.numel() for p in model.parameters()) * 4
        cls = GRPOTrainer if arm.trainer == "trl" else RatioGRPOTrainer
        trainer = cls(model=model, reward_funcs=letter_reward, args=arm_config(arm, tokens, tmp, device),
                      train_dataset=tiny_prompts(8), processing_class=vocab_tokenizer(VOCAB))
        release_memory()
        start = time.perf_counter()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            trainer.train()
            torch.cuda.synchronize()
            peak = CudaPeak(torch.cuda.max_memory_allocated())
        else:
            baseline = rss_bytes()
            with PeakRSS() as peak:
                trainer.train()
        seconds = time.perf_counter() - start
        logged = next(r for r in trainer.state.log_history if "loss" in r)
    return {"arm": arm.name, "baseline_bytes": baseline, "peak_bytes": peak.peak, "increment_bytes": peak.peak - baseline,
            "model_fp32_bytes": model_fp32_bytes, "seconds": round(seconds, 1), "memory_method": peak.method,
            "completion_length": logged.get("completions/mean_length"), "threads": torch.get_num_threads()}


@dataclass(frozen=True)
class CudaPeak:
    """The CUDA allocator's peak of allocated tensor bytes (`torch.cuda.max_memory_allocated`)."""

    peak: int
    method: str = "torch.cuda.max_memory_allocated (tensors; the allocator's reserve not counted)"


# ---------------------------------------------------------------------------------------------------------------------
# the benchmark: every arm in its own process


def run_benchmark(tokens: int, arms=ARMS, log=print, device: str = "cpu", shape: str = "tiny",
                  on_arm=None, budget_s: float | None = None) -> list[dict]:
    """Each arm in a fresh process of this file (`--arm`), one after the other; their records in the order of `arms`.
    `on_arm(records)` is called after each, so a long run keeps the arms it finished.

    `budget_s`: the seconds all arms may take together. The first arm is timed (its whole process: imports, model,
    one step); an arm starts only if 1.25 x the slowest arm so far still fits in what is left, and the arms not
    started are logged as skipped (absent from the records)."""
    records, start, slowest = [], time.perf_counter(), 0.0
    for n, arm in enumerate(arms):
        left = None if budget_s is None else budget_s - (time.perf_counter() - start)
        if left is not None and records and 1.25 * slowest > left:
            log(f"skipped {', '.join(a.name for a in arms[n:])}: {left:.0f} s left of {budget_s:.0f} s, an arm "
                f"takes up to {slowest:.0f} s here")
            break
        began = time.perf_counter()
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            cmd = [sys.executable, __file__, "--arm", arm.name, "--tokens", str(tokens), "--arm-json", out.name,
                   "--device", device, "--shape", shape]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"arm {arm.name} failed:\n{done.stderr[-4000:]}")
            records.append(json.loads(Path(out.name).read_text()))
        records[-1]["process_seconds"] = round(time.perf_counter() - began, 1)
        slowest = max(slowest, records[-1]["process_seconds"])
        if on_arm is not None:
            on_arm(records)
        r = records[-1]
        log(f"{arm.name}: peak {r['peak_bytes'] / 2**20:.0f} MB, +{r['increment_bytes'] / 2**20:.0f} MB over "
            f"{r['baseline_bytes'] / 2**20:.0f} MB, {r['seconds']} s, completions of {r['completion_length']} tokens")
    return records


def summarize(result: dict) -> list[dict]:
    """Per arm: peak and increment (MB), increment / stock TRL's, the goal (MB) and whether the arm is within it."""
    records = {r["arm"]: r for r in result["records"]}
    ref = records[result["reference"]]["increment_bytes"]
    rows = []
    for r in result["records"]:
        goal = GOAL_RATIO * ref + r["model_fp32_bytes"]
        rows.append({"arm": r["arm"], "peak_mb": r["peak_bytes"] / 2**20, "increment_mb": r["increment_bytes"] / 2**20,
                     "ratio": r["increment_bytes"] / ref, "goal_mb": goal / 2**20,
                     "within": r["increment_bytes"] <= goal})
    return rows


def render(result: dict) -> str:
    """Markdown of one result (the JSON `--json` writes): a header naming the run and machine, then one row per arm."""
    first = result["records"][0]
    model = {"tiny": "tiny-depth Qwen2 (2 layers, hidden 64, untied)",
             "1.5b": "Qwen2.5-1.5B-shaped Qwen2 (28 layers, hidden 1,536, untied, random weights)"}
    on = "bf16 on CUDA" if result.get("device") == "cuda" else "bf16 autocast on CPU"
    lines = [f"`{result['command']}` — {model[result.get('shape', 'tiny')]} with V = {result['vocab']:,}, "
             f"{result['rows']} completions of {result['tokens']:,} tokens, one optimizer step per arm, each arm in "
             f"its own process, {on}, {first['threads']} threads, torch {result['torch']}, TRL "
             f"{result['trl']}, peak memory: {first['memory_method']}; {describe_machine(result['machine'])}. "
             f"Goal: increment <= {GOAL_RATIO} x stock TRL's + one fp32 copy of the model "
             f"({first['model_fp32_bytes'] / 2**20:.0f} MB).", "",
             "| arm | peak MB | increment MB | increment / TRL | goal MB | within goal |", "|---|---|---|---|---|---|"]
    done, asked = [r["arm"] for r in result["records"]], result.get("arms_requested", [])
    if len(done) < len(asked):
        lines[0] += f" Stopped after {len(done)} of the {len(asked)} arms asked for (not run: {', '.join(asked[len(done):])})."
    for row in summarize(result):
        lines.append(f"| {row['arm']} | {row['peak_mb']:.0f} | {row['increment_mb']:.0f} | {row['ratio']:.2f}x | "
                     f"{row['goal_mb']:.0f} | {'yes' if row['within'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="completion tokens (every completion runs to this length)")
    p.add_argument("--arms", default=",".join(a.name for a in ARMS), help="comma-separated subset of the arms")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    p.add_argument("--render", default=None, help="print the markdown table of a result JSON and exit")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the arms train: peak RSS on the CPU, the CUDA allocator's peak on a GPU")
    p.add_argument("--shape", choices=tuple(SHAPES), default="tiny", help="the model's shape (V = 151,936 in both)")
    p.add_argument("--check-args", action="store_true", help="validate the arguments, say what would run, and exit")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds for all arms: the first (stock TRL) is timed, the rest run while they fit")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # the child process of one arm
    p.add_argument("--arm-json", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return
    by_name = {arm.name: arm for arm in ARMS}
    if a.arm:
        Path(a.arm_json).write_text(json.dumps(run_arm(by_name[a.arm], a.tokens, a.device, a.shape)))
        return
    import torch
    import trl

    names = a.arms.split(",")
    if REFERENCE not in names:
        raise SystemExit(f"--arms must include {REFERENCE!r}, the reference of every ratio")
    command = "python benchmarks/peak_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = machine_record()  # before the run's own threads raise the load
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {unknown}; allowed: {', '.join(by_name)}")
    if a.shape != "tiny" and a.device != "cuda":
        raise SystemExit(f"--shape {a.shape} runs on a GPU only (--device cuda)")
    if a.check_args:
        budget = "" if a.budget_s is None else f", within {a.budget_s:.0f} s"
        print(f"would run arms {', '.join(names)} on {a.device}, shape {a.shape}, {a.tokens} completion tokens"
              f"{budget}")
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")

    def save(records):  # after every arm (the reference first): a run stopped early keeps what it measured
        result = {"command": command, "device": a.device, "shape": a.shape, "vocab": VOCAB, "rows": ROWS,
                  "tokens": a.tokens, "reference": REFERENCE, "goal_ratio": GOAL_RATIO, "torch": torch.__version__,
                  "trl": trl.__version__, "machine": machine, "arms_requested": names, "records": records}
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        return result

    names = [REFERENCE] + [n for n in names if n != REFERENCE]  # the reference first: every saved table has it
    records = run_benchmark(a.tokens, [by_name[n] for n in names], log=lambda m: print(m, file=sys.stderr, flush=True),
                            device=a.device, shape=a.shape, on_arm=save, budget_s=a.budget_s)
    print(render(save(records)))


if __name__ == "__main__":
    main()
