"""`grpo-ratio probe determinism`: DetLLM's table on this machine. One prompt, greedy decoding, in several
configurations that each target a source of float nondeterminism; per configuration and per column (the integer
forward's int32 logits, the float model in fp32 and in bf16) the chain hash of the target row's logits over every
step, and for the float columns the first step where the greedy text forks from batch 1.

Configurations: batch 1; batch N with N-1 random co-prompts (left padding, the target padded); the prompt's first
half prefilled then the rest token by token; batch 1 on 1 thread and on 2 threads; and, for the integer column only,
the forward without its float guard and the batch-N run token by token (the integer paths against each other).

The chain hash is h_i = sha256(h_{i-1} || the step's logits as little-endian bytes: int32 for the integer column,
fp32 for the float ones, bf16 logits cast exactly to fp32), first 12 hex digits of the last. Source: N. Barry,
"Eliminating Nondeterminism in LLM Inference with Integer-Only Arithmetic" (2026); the integer forward is
`grpo_ratio.integer` (docs/integer.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time

import torch

from ..integer import convert
from ..integer.sample import left_pad
from . import common
from .common import ProbeError


HELP = "DetLLM's determinism table: int32-logit vs fp32/bf16 hashes across batch, prefill split and threads"
# Sonnet 18 (Shakespeare, 1609; public domain): the prompt DetLLM's demo decodes from
SONNET = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: Rough winds do shake the "
          "darling buds of May, And summer's lease hath all too short a date;")


def add_arguments(p) -> None:
    p.add_argument("--model", default=common.DEFAULT_MODEL,
                   help="local save_pretrained directory, hub id, or 'tiny' / 'tiny:ARCH' (llama, qwen2, qwen3)")
    p.add_argument("--prompt", default=SONNET, help="the prompt decoded (default: the first lines of Sonnet 18)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="greedy steps hashed (default 32)")
    p.add_argument("--batch-size", type=int, default=8, help="rows of the co-batched configuration (default 8)")
    p.add_argument("--calibration-prompts", type=int, default=4,
                   help="built-in prompts the integer conversion calibrates on (default 4)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random co-prompts (default 1234)")
    p.add_argument("--out", default="probe-results", help="output directory (default: ./probe-results)")


def chain_hash(rows: list[torch.Tensor]) -> str:
    """Chain sha256 over the steps' logits (each (V,)), first 12 hex digits."""
    h = b""
    for row in rows:
        row = row.detach().cpu()
        data = row.numpy().tobytes() if row.dtype == torch.int32 else row.float().numpy().tobytes()
        h = hashlib.sha256(h + data).digest()
    return h.hex()[:12]


@contextlib.contextmanager
def threads(n: int | None):
    before = torch.get_num_threads()
    try:
        if n:
            torch.set_num_threads(n)
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def float_greedy(model, rows: list[list[int]], target: int, steps: int, split: int | None = None):
    """Greedy decoding of left-padded `rows` by the float model with its KV cache (positions from the mask); split =
    prefill the first `split` prompt tokens, then the rest one at a time. Returns (target's logits per step, its
    tokens)."""
    ids, valid = left_pad(rows, 0)
    mask = valid.long()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cut = ids.size(1) if split is None else ids.size(1) - (len(rows[target]) - split)
    out = model(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], position_ids=pos[:, :cut], use_cache=True)
    past = out.past_key_values
    for t in range(cut, ids.size(1)):
        out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
    logits, tokens = [], []
    last_pos = pos[:, -1:]
    for step in range(steps):
        row = out.logits[:, -1]
        logits.append(row[target].clone())
        top = row.max(-1, keepdim=True).values
        tok = torch.where(row == top, torch.arange(row.size(-1)), row.size(-1)).amin(-1)  # ties to the lowest id
        tokens.append(int(tok[target]))
        if step + 1 == steps:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        last_pos = last_pos + 1
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=last_pos, past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
    return logits, tokens


@torch.no_grad()
def int_greedy(int_model, rows: list[list[int]], target: int, steps: int, split: int | None = None,
               guard: bool = True, token_by_token: bool = False):
    """The same for the integer forward: prefill (whole, split, or token by token), then greedy decoding."""
    ids, valid = left_pad(rows, 0)
    cache = int_model.new_cache(len(rows))
    cut = ids.size(1) if split is None else ids.size(1) - (len(rows[target]) - split)
    if token_by_token:
        cut = 1
    logits = int_model(ids[:, :cut], valid[:, :cut], cache, guard=guard)[:, -1]
    for t in range(cut, ids.size(1)):
        logits = int_model(ids[:, t:t + 1], valid[:, t:t + 1], cache, guard=guard)[:, -1]
    out, tokens = [], []
    for step in range(steps):
        out.append(logits[target].clone())
        tok = torch.where(logits == logits.amax(-1, keepdim=True), torch.arange(logits.size(-1)),
                          logits.size(-1)).amin(-1)
        tokens.append(int(tok[target]))
        if step + 1 == steps:
            break
        logits = int_model(tok[:, None], None, cache, guard=guard)[:, 0]
    return out, tokens


def configurations(prompt: list[int], batch_size: int, seed: int, vocab: int) -> list[dict]:
    """The table's rows: name, rows, target row, split, threads, and which columns run it."""
    g = random.Random(seed)
    co = [[g.randrange(3, vocab) for _ in range(g.randrange(2, 2 * len(prompt) + 2))] for _ in range(batch_size - 1)]
    batch = co[: len(co) // 2] + [prompt] + co[len(co) // 2:]
    both = ("int", "fp32", "bf16")
    return [
        dict(name="batch 1", rows=[prompt], target=0, columns=both),
        dict(name=f"batch {batch_size}, {batch_size - 1} random co-prompts, left padding", rows=batch,
             target=len(co) // 2, columns=both),
        dict(name="prefill half, then token by token", rows=[prompt], target=0, split=len(prompt) // 2,
             columns=both),
        dict(name="batch 1, 1 thread", rows=[prompt], target=0, threads=1, columns=both),
        dict(name="batch 1, 2 threads", rows=[prompt], target=0, threads=2, columns=both),
        dict(name="integer: no float guard", rows=[prompt], target=0, guard=False, columns=("int",)),
        dict(name=f"integer: batch {batch_size}, every token fed alone", rows=batch, target=len(co) // 2,
             token_by_token=True, columns=("int",)),
    ]


def first_fork(tokens: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


def measure(model, int_model, prompt: list[int], steps: int, batch_size: int, seed: int) -> dict:
    """Every configuration in every column: {"rows": [{name, int, fp32, bf16: {hash, fork}}], "unique": {...}}."""
    bf16 = None
    rows = []
    for conf in configurations(prompt, batch_size, seed, int_model.vocab_size):
        row = {"configuration": conf["name"]}
        with threads(conf.get("threads")):
            for column in conf["columns"]:
                start = time.perf_counter()
                if column == "int":
                    logits, tokens = int_greedy(int_model, conf["rows"], conf["target"], steps, conf.get("split"),
                                                conf.get("guard", True), conf.get("token_by_token", False))
                else:
                    if column == "bf16" and bf16 is None:
                        import copy

                        bf16 = copy.deepcopy(model).to(torch.bfloat16)
                    logits, tokens = float_greedy(model if column == "fp32" else bf16, conf["rows"], conf["target"],
                                                  steps, conf.get("split"))
                row[column] = {"hash": chain_hash(logits), "tokens": tokens, "seconds": time.perf_counter() - start}
        rows.append(row)
    unique, forks = {}, {}
    for column in ("int", "fp32", "bf16"):
        present = [r[column] for r in rows if column in r]
        unique[column] = len({c["hash"] for c in present})
        for c in present:
            c["fork_step"] = first_fork(c["tokens"], present[0]["tokens"])
        forks[column] = min((c["fork_step"] for c in present if c["fork_step"] is not None), default=None)
    return {"rows": rows, "unique_hashes": unique, "first_fork": forks}


def markdown(payload: dict) -> str:
    """The table of a `determinism.json` payload ({"info", "rows", "unique_hashes", "first_fork"})."""
    result, info = payload, payload["info"]
    lines = [f"# Determinism: {info['model']} ({info['steps']} greedy steps)", "",
             "| configuration | int32 logits | fp32 logits | bf16 logits | fp32 fork | bf16 fork |",
             "| --- | --- | --- | --- | --- | --- |"]

    def cell(row, column, key):
        if column not in row:
            return "-"
        value = row[column][key]
        return "none" if value is None else str(value)

    for row in result["rows"]:
        lines.append(f"| {row['configuration']} | {cell(row, 'int', 'hash')} | {cell(row, 'fp32', 'hash')} | "
                     f"{cell(row, 'bf16', 'hash')} | {cell(row, 'fp32', 'fork_step')} | "
                     f"{cell(row, 'bf16', 'fork_step')} |")
    u, f = result["unique_hashes"], result["first_fork"]
    lines.append(f"| **unique hashes** | **{u['int']}** | **{u['fp32']}** | **{u['bf16']}** | "
                 f"{'none' if f['fp32'] is None else f['fp32']} | {'none' if f['bf16'] is None else f['bf16']} |")
    lines += ["", "A fork is the first greedy step whose token differs from batch 1's in the same column (none: the "
              "text never forked in these steps although the logits' hash may differ).",
              f"Integer conversion: {info['conversion_s']:.1f} s ({info['calibration_prompts']} calibration prompts). "
              "The float columns run transformers' eager forward on this CPU.", ""]
    return "\n".join(lines)


def run(args) -> list:
    if args.max_new_tokens < 1:
        raise ProbeError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.batch_size < 2:
        raise ProbeError(f"--batch-size must be >= 2 (batch 1 is always measured), got {args.batch_size}")
    model, tokenizer = common.load_model(args.model, torch.float32)
    if model.config.model_type not in ("llama", "qwen2", "qwen3"):
        raise ProbeError(f"--model {args.model!r}: model_type {model.config.model_type!r}; the integer forward "
                         "supports llama, qwen2, qwen3")
    prompt = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not prompt:
        raise ProbeError("--prompt is empty after tokenization")
    calib = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"])
             for p in common.BUILTIN_PROMPTS[: max(1, args.calibration_prompts)]]
    int_model = convert(model, calib)
    result = measure(model, int_model, prompt, args.max_new_tokens, args.batch_size, args.seed)
    info = {"model": args.model, "model_type": model.config.model_type, "steps": args.max_new_tokens,
            "batch_size": args.batch_size, "prompt_tokens": len(prompt), "seed": args.seed,
            "conversion_s": int_model.info["conversion_s"], "calibration_s": int_model.info["calibration_s"],
            "calibration_prompts": int_model.info["calibration_prompts"], "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    payload = {"info": info, **result}
    return common.write_results(args.out, "determinism", payload, markdown(payload))
