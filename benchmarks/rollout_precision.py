"""Rollout speed of each `rollout_precision` copy beside the policy's, in one run, with the copy's (re-)make cost and
its distance to the policy (grpo_ratio/sampler/precision.py, docs/rollout_precision.md).

Per model (a tiny Qwen2 of `grpo_ratio.testing`, and SmolLM2-135M-Instruct via `grpo_ratio.models.resolve_model`,
offline) and per value of `rollout_precision`:
- make / re-make: wall seconds of the copy's first build (from the policy's weights), and of a re-make after the
  policy's weights moved (what the trainer pays once per generation: `ratio/rollout_copy_seconds`);
- rollout tok/s: `--batch` prompts of `--prompt-tokens` tokens, `--new-tokens` sampled tokens each (no EOS stop),
  drawn as the trainer draws them (the policy's `generate` redirected to the copy, the recorder attached; the integer
  sampler for `integer`); `--repeats` rounds after one untimed warm-up round, each round timing every row once in
  turn; the fastest call per row (on a shared machine the least disturbed one; the median is in the JSON too), and
  the speed against the policy's fastest call;
- |log q - log p|: the mean absolute difference between the recorded sampler log-probs and the fp32 policy's
  teacher-forced log-probs of the same tokens (the old/sampler distance at the first step, in nats).
`policy` is the policy's own `generate` in fp32 (TRL's `bf16=False`) and `policy_bf16` under bf16 autocast (TRL's
`bf16=True` on CPU: emulated bf16 on a CPU without native bf16).

    python benchmarks/rollout_precision.py --out results/rollout_precision.json
    python benchmarks/rollout_precision.py --render results/rollout_precision.json   # the markdown table

Source: NVIDIA, "FP8-RL" (arXiv 2601.18150): FP8 rollouts, up to 44% rollout throughput with TIS/MIS, on GPUs with
FP8 kernels. Fake quantization here computes in the policy's dtype: it models the mismatch, not FP8's speed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch


TEMPERATURE = 1.0


def _policy_logps(policy, out: torch.Tensor, P: int) -> torch.Tensor:
    """(B, T) fp32 log-probs of the completion tokens of `out` (B, P + T) under the fp32 policy, teacher-forced."""
    with torch.no_grad():
        logits = policy(out).logits[:, P - 1:-1].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, out[:, P:, None]).squeeze(-1)


def _draw(policy, copy, prompts: torch.Tensor, new_tokens: int, autocast: bool):
    """(sequences (B, P + T), recorded log-probs (B, T)) of one generate call drawn as the trainer draws it."""
    from grpo_ratio.sampler.generate import SamplerLogprobRecorder, finalize_from_completions, recording_sampler

    recorder = SamplerLogprobRecorder(support_size_only=True)
    mask = torch.ones_like(prompts)
    integer = copy is not None and copy.is_integer
    if copy is None:
        context = recording_sampler(policy, recorder)
    else:
        context = copy.drawing(policy, 2, new_tokens, None if integer else recorder)  # synced at version 2
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), context, cast:
        out = policy.generate(input_ids=prompts, attention_mask=mask, do_sample=True, temperature=TEMPERATURE,
                              top_k=0, top_p=1.0, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
    completion = out[:, prompts.size(1):].tolist()
    if integer:
        return out, copy.integer.record(completion).logprobs
    return out, finalize_from_completions(recorder, completion, 0).logprobs


def measure_model(name: str, policy, vocab: int, args) -> dict:
    """The rows of one model: {precision: {make_s, remake_s, seconds, tokens_per_s, vs_policy, mean_abs_log_ratio,
    copy_bytes}}. The timed calls go round-robin over the rows (`--repeats` rounds after one warm-up round), so a
    load change on a shared machine hits every row alike; `vs_policy` is the median over rounds of the policy's
    seconds over the row's in the same round."""
    from grpo_ratio.integer.sample import IntSampling
    from grpo_ratio.modes import INTEGER_MODE, ROLLOUT_PRECISIONS
    from grpo_ratio.sampler.precision import IntegerRollouts, RolloutCopy

    torch.manual_seed(0)
    policy.eval()
    prompts = torch.randint(2, vocab, (args.batch, args.prompt_tokens))
    names = [n for n in ("policy", "policy_bf16", *ROLLOUT_PRECISIONS[1:]) if not args.only or n in args.only or
             n == "policy"]
    rows, copies = {}, {}
    for precision in names:
        copy, make, remake = None, None, None
        if precision not in ("policy", "policy_bf16"):
            integer = None
            if precision == INTEGER_MODE:
                integer = IntegerRollouts(IntSampling(temperature=TEMPERATURE), eos_token_id=None, pad_token_id=0)
            copy = RolloutCopy(precision, policy, integer)
            start = time.perf_counter()
            copy.sync(1, prompts.tolist())
            make = time.perf_counter() - start
            start = time.perf_counter()
            copy.sync(2)  # the weights "moved" (a new WeightsVersion): what each generation pays in training
            remake = time.perf_counter() - start
        copies[precision] = copy
        rows[precision] = {"make_s": make, "remake_s": remake, "copy_bytes": None if copy is None else copy.num_bytes(),
                           "times": []}
    last = {}
    for round_ in range(args.repeats + 1):
        for precision in names:
            gc.collect()  # no collection of an earlier row's garbage inside this row's timed call
            start = time.perf_counter()
            last[precision] = _draw(policy, copies[precision], prompts, args.new_tokens, precision == "policy_bf16")
            if round_:  # the first round warms up
                rows[precision]["times"].append(time.perf_counter() - start)
        print(f"{name}: round {round_} done", file=sys.stderr, flush=True)
    for precision in names:
        summarize(rows[precision], rows["policy"]["times"], args.batch * args.new_tokens)
        x = rows[precision]
        out, recorded = last[precision]
        x["mean_abs_log_ratio"] = (recorded - _policy_logps(policy, out, prompts.size(1))).abs().mean().item()
        print(f"{name} {precision}: {x}", file=sys.stderr, flush=True)
    return rows


def summarize(row: dict, policy_times: list[float], tokens: int) -> None:
    """The speed of a row from its timed calls: the fastest call (`seconds`, `tokens_per_s`: on a shared machine the
    least disturbed one), the median call, and `vs_policy` = the policy's fastest call over the row's."""
    row["seconds"] = min(row["times"])
    row["median_seconds"] = statistics.median(row["times"])
    row["tokens_per_s"] = tokens / row["seconds"]
    row["vs_policy"] = min(policy_times) / row["seconds"]


def measure(args) -> dict:
    from grpo_ratio.machine import machine_record
    from grpo_ratio.testing import tiny_model

    torch.set_num_threads(args.threads)
    result = {"batch": args.batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "machine": machine_record(),
              "torch": torch.__version__, "models": {}}
    started = time.perf_counter()
    if not args.skip_tiny:
        result["models"]["tiny qwen2 (grpo_ratio.testing)"] = measure_model("tiny", tiny_model("qwen2"), 300, args)
    if not args.skip_smollm2:
        from grpo_ratio.models import resolve_model

        model, tokenizer = resolve_model(args.model, torch.float32, require_chat_template=False)
        small = argparse.Namespace(**{**vars(args), "batch": args.large_batch, "new_tokens": args.large_new_tokens,
                                      "repeats": args.large_repeats})
        result["models"][args.model] = measure_model("smollm2", model, len(tokenizer), small)
        result["large"] = {"batch": small.batch, "new_tokens": small.new_tokens, "repeats": small.repeats}
    result["total_s"] = time.perf_counter() - started
    return result


def render(path: str) -> str:
    from grpo_ratio.machine import describe_machine

    r = json.loads(Path(path).read_text())
    lines = []
    for model, rows in r["models"].items():
        size = r.get("large", r) if model.startswith("HuggingFaceTB") else r
        lines += [f"{model}: {size['batch']} prompts x {size['new_tokens']} sampled tokens (prompt "
                  f"{r['prompt_tokens']} tokens), the fastest of {size['repeats']} rounds (every row timed once per round, in turn).", "",
                  "| rollout_precision | rollout tok/s | vs policy (fp32) | make s | re-make s | copy MB "
                  "| mean abs log q/p |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, x in rows.items():
            make = "-" if x["make_s"] is None else f"{x['make_s']:.3f}"
            remake = "-" if x["remake_s"] is None else f"{x['remake_s']:.3f}"
            mb = "-" if x["copy_bytes"] is None else f"{x['copy_bytes'] / 2**20:.1f}"
            label = {"policy": "policy (fp32)", "policy_bf16": "policy (bf16 autocast)"}.get(name, name)
            lines.append(f"| {label} | {x['tokens_per_s']:.1f} | {x['vs_policy']:.2f}x | {make} | "
                         f"{remake} | {mb} | {x['mean_abs_log_ratio']:.2e} |")
        lines.append("")
    lines.append(f"{r['threads']} threads, eager, {describe_machine(r['machine'])}; one run of {r['total_s']:.0f} s. "
                 f"The fp32 policy and the fake-quantized copies (int8 / int4 / int2, computing in fp32, the "
                 f"policy's dtype) do the same work: the spread of their speeds is this machine's noise. The integer "
                 f"sampler runs the eager integer forward (docs/integer.md).")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--large-batch", type=int, default=2, help="SmolLM2's batch (smaller: the run stays a few minutes)")
    p.add_argument("--large-new-tokens", type=int, default=8)
    p.add_argument("--large-repeats", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="a subset of the rows (policy, policy_bf16, bf16, ...)")
    p.add_argument("--skip-smollm2", action="store_true", help="the tiny model only")
    p.add_argument("--skip-tiny", action="store_true", help="SmolLM2 only")
    p.add_argument("--out", default="results/rollout_precision.json")
    p.add_argument("--render", default=None, help="print the markdown table of a result file and exit")
    args = p.parse_args(argv)
    if args.render:
        print(render(args.render), end="")
        return 0
    result = measure(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(render(args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
