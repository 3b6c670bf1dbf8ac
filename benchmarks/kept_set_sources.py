"""Recorded vs recomputed kept sets, side by side on the same rollouts (transformers `generate`, where both exist).

The "recorded" kept set is what the sampler kept at each step (the `generate` recording); the "recompute" source
re-applies top_k/top_p/min_p to the old policy's own logits after the fact (NeMo-RL's approach, the only one that works
with vLLM server mode or without engine sampling masks). They differ where the trainer's logits and the sampler's put
the boundary elsewhere. For each truncation setting and each precision of the old pass (bf16 autocast: TRL's own pass;
fp32: the fp32 arms) this measures how often the sets differ and what that does to the corrected ratio
p_old,S(g) / q_S(g).

    python benchmarks/kept_set_sources.py --model tiny                       # seconds
    python benchmarks/kept_set_sources.py --model smollm2 --json results/kept_set_sources_smollm2.json   # minutes
    python benchmarks/kept_set_sources.py --render results/kept_set_sources_smollm2.json

Rollouts: the arithmetic task's prompts (built in, no download), sampled once per setting under bf16 autocast (the
sampler of a `bf16=True` TRL run), 64 new tokens at most.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from grpo_ratio.corrections.kept_logprobs import is_top_prefix, kept_set_logprobs, recompute_kept_sets
from grpo_ratio.corrections.kept_sets import SamplingSettings
from grpo_ratio.diagnostics.ratios import RatioStats
from grpo_ratio.sampler.generate import SamplerLogprobRecorder, recording_sampler


SETTINGS = {"top_p=0.8": dict(top_p=0.8), "top_k=20": dict(top_k=20), "min_p=0.1": dict(min_p=0.1),
            "top_k=50, top_p=0.9": dict(top_k=50, top_p=0.9)}


def load(name: str):
    if name == "tiny":
        from grpo_ratio.testing import tiny_model, tiny_tokenizer

        return tiny_model("qwen2"), tiny_tokenizer(), [f"what is {i} + {i + 1} ?" for i in range(8)]
    from grpo_ratio.models import load_tokenizer, resolve_model, resolve_model_path
    from grpo_ratio.tasks import load_task

    model, _ = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", dtype=torch.float32)
    tokenizer = load_tokenizer(resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
    dataset, _ = load_task("arithmetic", num_examples=8, seed=0)
    prompts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in dataset["prompt"]]
    return model, tokenizer, prompts


def rollouts(model, tokenizer, prompts, setting: dict, max_new_tokens: int, seed: int):
    """Sample once under bf16 autocast with the recorder: (input_ids (B, P+T), attention mask, T, SamplerRecord)."""
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    recorder = SamplerLogprobRecorder()
    torch.manual_seed(seed)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), recording_sampler(model, recorder):
        # every truncation field explicit, as TRL passes them: unset ones would come from the model's
        # generation_config (transformers' default top_k=50 among them)
        full = {"top_k": 0, "top_p": 1.0, "min_p": None, **setting}
        out = model.generate(**batch, do_sample=True, max_new_tokens=max_new_tokens, temperature=1.0,
                             pad_token_id=tokenizer.pad_token_id, **full)
    P = batch["input_ids"].size(1)
    completion = out[:, P:]  # (B, T)
    eos = torch.tensor(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                       else [model.generation_config.eos_token_id])
    is_eos = torch.isin(completion, eos)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), completion.size(1))  # (B,)
    mask = torch.arange(completion.size(1))[None] <= first[:, None]  # (B, T) up to and including the first EOS
    record = recorder.finalize(out, mask)
    attention = torch.cat([batch["attention_mask"], mask.long()], dim=1)  # (B, P+T)
    return out, attention, completion.size(1), record, mask


def old_logits(model, input_ids, attention_mask, T: int, precision: str) -> torch.Tensor:
    """(B, T, V) fp32 logits of the completion positions, as TRL's pass computes them (bf16 autocast) or in fp32."""
    context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cpu",
                                                                                                    enabled=False)
    with torch.no_grad(), context:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1).logits
    return logits[:, :-1].float()


def compare_sources(logits, tokens, record, mask, sampling: SamplingSettings) -> dict:
    """Agreement of recomputed and recorded kept sets, and the corrected ratio over each."""
    recomputed, added = recompute_kept_sets(logits, tokens, sampling, mask)
    recorded = record.kept
    valid = mask & (recorded.sizes > 0)  # (B, T)
    same = torch.tensor([torch.equal(recorded.cell_ids(b, t), recomputed.cell_ids(b, t))
                         for b, t in valid.nonzero().tolist()])
    size_diff = (recomputed.sizes - recorded.sizes)[valid].abs().float()
    prefix = is_top_prefix(logits, recorded, mask=valid)[valid].float().mean().item()
    out = {"tokens": int(valid.sum()), "identical_sets": same.float().mean().item(),
           "mean_abs_size_diff": size_diff.mean().item(), "sampled_outside_recomputed": added[valid].float().mean().item(),
           "recorded_is_top_prefix": prefix}
    for name, kept in (("recorded", recorded), ("recompute", recomputed)):
        logp_s = kept_set_logprobs(logits, tokens, kept, 1.0, mask=valid)  # (B, T) log p_old,S(g)
        stats = RatioStats().update(logp_s - record.logprobs, valid).as_metrics("r")
        out[name] = {"corrected_mean": stats["r/mean"], "corrected_oob": stats["r/oob_rate"],
                     "corrected_mean_abs_log": stats["r/mean_abs_log_ratio"]}
    return out


def run(model_name: str, max_new_tokens: int, seed: int) -> dict:
    model, tokenizer, prompts = load(model_name)
    model.eval()
    results = []
    for label, setting in SETTINGS.items():
        ids, attention, T, record, mask = rollouts(model, tokenizer, prompts, setting, max_new_tokens, seed)
        tokens = ids[:, -T:]
        sampling = SamplingSettings(temperature=1.0, **setting)
        for precision in ("bf16", "fp32"):
            logits = old_logits(model, ids, attention, T, precision)
            results.append({"setting": label, "old_pass": precision,
                            **compare_sources(logits, tokens, record, mask, sampling)})
            print(json.dumps(results[-1]), file=sys.stderr)
    return {"model": model_name, "max_new_tokens": max_new_tokens, "seed": seed, "results": results}


def render(payload: dict) -> str:
    lines = [f"`{payload['command']}` — {payload['model']}, {payload['results'][0]['tokens']}+ tokens per setting, "
             f"sampler under bf16 autocast",
             "",
             "| sampling | old pass | tokens | identical sets | mean \\|size diff\\| | sampled token outside recomputed set "
             "| recorded: corrected mean r | recorded: OOB | recompute: corrected mean r | recompute: OOB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["results"]:
        lines.append(f"| {r['setting']} | {r['old_pass']} | {r['tokens']} | {r['identical_sets']:.2%} | "
                     f"{r['mean_abs_size_diff']:.2f} | {r['sampled_outside_recomputed']:.2%} | "
                     f"{r['recorded']['corrected_mean']:.4f} | {r['recorded']['corrected_oob']:.2%} | "
                     f"{r['recompute']['corrected_mean']:.4f} | {r['recompute']['corrected_oob']:.2%} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny | smollm2")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--render", default=None, help="print the markdown table of a result JSON and exit")
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())), end="")
        return 0
    payload = run(a.model, a.max_new_tokens, a.seed)
    payload["command"] = "python benchmarks/kept_set_sources.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(payload, indent=1) + "\n")
    print(render(payload), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
