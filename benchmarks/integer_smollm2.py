"""Quality and cost of the integer forward (`grpo_ratio.integer`, docs/integer.md) on SmolLM2-135M, side by side with
the fp32 model in one run: perplexity on a committed held-out text, decode tokens/s at batch 1 and 8, and the
conversion's time (calibration included).

- Text: problems 8-31 of GSM8K's test split (question, then answer), from `tests/data/gsm8k_test_first32.jsonl`
  (the first 32 lines of openai/grade-school-math, grade_school_math/data/test.jsonl, commit 3101c7d5; MIT,
  `tests/data/GSM8K_LICENSE`), the first --tokens tokens, scored in independent windows of --window tokens (each
  window's first token is context only). The integer model's log-probs are its own integer ones (`grpo_ratio.integer.sample.token_logprobs`, 2^-16
  nats); fp32's are `log_softmax` of its logits.
- Calibration: the first --calibration problems of the test split (`tests/data/gsm8k_test_first8.jsonl`, problems
  0-7: never scored).
- Decode: a --prompt-tokens prompt (batch 8: 8 different ones), --decode-steps greedy steps after the prefill, timed
  per step; fp32 = transformers' eager forward with its KV cache; integer = `IntModel.forward` with its int8 cache,
  the float guard off (the guard is a check: its cost is the `guarded` column).

    python benchmarks/integer_smollm2.py --out results/integer_smollm2.json
    python benchmarks/integer_smollm2.py --render results/integer_smollm2.json   # the markdown table

Sources: N. Barry, "Eliminating Nondeterminism in LLM Inference with Integer-Only Arithmetic" (2026): WikiText2
perplexity 20.72 (int8) vs 20.95 (fp16) on Qwen3-0.6B; I-LLM (arXiv 2405.17849).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "gsm8k_test_first32.jsonl"
CALIBRATION = ROOT / "tests" / "data" / "gsm8k_test_first8.jsonl"  # problems 0-7: calibration, never scored


def held_out_ids(tokenizer, n: int) -> list[int]:
    rows = [json.loads(line) for line in TEXT.read_text().splitlines() if line.strip()][8:]
    text = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows)
    return tokenizer(text, add_special_tokens=False)["input_ids"][:n]


def calibration_ids(tokenizer, n: int) -> list[torch.Tensor]:
    rows = [json.loads(line) for line in CALIBRATION.read_text().splitlines() if line.strip()][:n]
    return [torch.tensor(tokenizer(f"{r['question']}\n{r['answer']}", add_special_tokens=False)["input_ids"])
            for r in rows]


@torch.no_grad()
def perplexities(model, int_model, ids: list[int], window: int, chunk: int) -> dict:
    from grpo_ratio.integer.sample import IntSampling, token_logprobs

    nll_f, nll_i, n, agree = 0.0, 0.0, 0, 0
    for a in range(0, len(ids) - 1, window):
        w = torch.tensor([ids[a:a + window]])
        if w.size(1) < 2:
            break
        target = w[:, 1:]
        lf = torch.log_softmax(model(w).logits[:, :-1].double(), -1)
        nll_f -= lf.gather(-1, target.unsqueeze(-1)).sum().item()
        cache = int_model.new_cache(1)
        logits = torch.cat([int_model(w[:, b:b + chunk], None, cache, guard=False)
                            for b in range(0, w.size(1), chunk)], 1)[:, :-1]
        lp = token_logprobs(logits, target, IntSampling())
        nll_i -= lp.sum().item() / 65536
        agree += (logits.argmax(-1) == lf.argmax(-1)).sum().item()
        n += target.numel()
        print(f"perplexity: {n} tokens scored, nll fp32 {nll_f / n:.4f} int {nll_i / n:.4f}, top-1 agreement "
              f"{agree / n:.3f}", file=sys.stderr, flush=True)
    return {"tokens": n, "fp32": math.exp(nll_f / n), "int": math.exp(nll_i / n), "top1_agreement": agree / n}


def _prompt_rows(tokenizer, batch: int, length: int) -> list[list[int]]:
    """`batch` different prompts of exactly `length` tokens: consecutive slices of the held-out text."""
    ids = held_out_ids(tokenizer, batch * length)
    return [ids[i * length:(i + 1) * length] for i in range(batch)]


@torch.no_grad()
def decode_rates(model, int_model, rows: list[list[int]], steps: int) -> dict:
    """Tokens per second of `steps` greedy decode steps after the prefill (rows equal-length: no padding)."""
    ids = torch.tensor(rows)
    B = ids.size(0)
    out = model(ids, use_cache=True)
    past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(tok, past_key_values=past, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    fp32 = B * steps / (time.perf_counter() - start)
    rates = {"fp32": fp32}
    for name, guard in (("int", False), ("int_guarded", True)):
        cache = int_model.new_cache(B)
        logits = int_model(ids, None, cache, guard=guard)[:, -1]
        start = time.perf_counter()
        for _ in range(steps):
            tok = logits.argmax(-1, keepdim=True)
            logits = int_model(tok, None, cache, guard=guard)[:, -1]
        rates[name] = B * steps / (time.perf_counter() - start)
    return rates


def measure(args) -> dict:
    from grpo_ratio.integer import convert
    from grpo_ratio.machine import machine_record
    from grpo_ratio.models import resolve_model

    torch.manual_seed(0)
    model, tokenizer = resolve_model(args.model, torch.float32, require_chat_template=False)
    model.eval()
    calib = calibration_ids(tokenizer, args.calibration)
    start = time.perf_counter()
    int_model = convert(model, calib)
    conversion = time.perf_counter() - start
    print(f"converted in {conversion:.1f} s", file=sys.stderr, flush=True)
    ids = held_out_ids(tokenizer, args.tokens)
    ppl = perplexities(model, int_model, ids, args.window, args.chunk)
    decode = {f"batch_{b}": decode_rates(model, int_model, _prompt_rows(tokenizer, b, args.prompt_tokens),
                                         args.decode_steps) for b in (1, 8)}
    return {"model": args.model, "text": str(TEXT.relative_to(ROOT)), "window": args.window,
            "calibration": {"prompts": len(calib), "tokens": int(sum(c.numel() for c in calib)),
                            "calibration_s": int_model.info["calibration_s"], "conversion_s": conversion},
            "perplexity": ppl, "gap": ppl["int"] / ppl["fp32"] - 1, "decode_tokens_per_s": decode,
            "decode_steps": args.decode_steps, "prompt_tokens": args.prompt_tokens,
            "machine": machine_record(), "torch": torch.__version__, "threads": torch.get_num_threads()}


def render(path: str) -> str:
    r = json.loads(Path(path).read_text())
    p, c, d = r["perplexity"], r["calibration"], r["decode_tokens_per_s"]
    lines = [f"Perplexity on {p['tokens']} tokens of `{r['text']}` (windows of {r['window']}), "
             f"{r['model']}; conversion {c['conversion_s']:.1f} s (calibration {c['calibration_s']:.1f} s on "
             f"{c['prompts']} other GSM8K problems, {c['tokens']} tokens).", "",
             "| | fp32 | integer | gap |", "| --- | --- | --- | --- |",
             f"| perplexity | {p['fp32']:.3f} | {p['int']:.3f} | {100 * r['gap']:+.2f}% |",
             f"| top-1 agreement with fp32 | | {100 * p['top1_agreement']:.1f}% | |"]
    for b in ("batch_1", "batch_8"):
        x = d[b]
        lines.append(f"| decode tok/s, {b.replace('_', ' ')} | {x['fp32']:.1f} | {x['int']:.2f} "
                     f"(guarded {x['int_guarded']:.2f}) | {x['int'] / x['fp32']:.3f}x |")
    lines += ["", f"Decode: {r['decode_steps']} greedy steps after a {r['prompt_tokens']}-token prefill, "
              f"{r['threads']} threads, eager (no compile, no CUDA graphs, no fused kernels) on "
              f"{r['machine'].get('cpu', 'this CPU')} (load {r['machine'].get('load_before', '?')} at the start: the "
              "machine is shared, so the times are noisy, the float ones most)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens scored")
    p.add_argument("--window", type=int, default=512, help="tokens per independent window")
    p.add_argument("--chunk", type=int, default=128, help="integer prefill chunk (the int8 cache carries the rest)")
    p.add_argument("--calibration", type=int, default=4, help="calibration problems (GSM8K test 0-7)")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--out", default="results/integer_smollm2.json")
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
