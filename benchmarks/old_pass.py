"""Old-pass cost of each scoring mode, side by side in one run: time and extra memory as ratios to `bf16`.

For a model in TRL's default regime (fp32 weights, bf16 autocast) and, with --weights bf16, for bf16-stored weights
(where the fp32 modes need copies). Each mode scores the same right-padded batch of completions, chunked like TRL's
old pass; times are the median of --repeats runs after one warm-up (which also builds any copy).

    python benchmarks/old_pass.py --model tiny                 # seconds
    python benchmarks/old_pass.py --model smollm2 --json results/old_pass_smollm2_fp32.json   # minutes on 2 CPU cores
    python benchmarks/old_pass.py --render results/old_pass_smollm2_fp32.json   # the markdown table of a result

Extra memory is the bytes held by the mode's copies (parameters and buffers), which is what a mode adds to training;
activation memory of one chunk is the same order for every mode and is not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from grpo_ratio.config import PRECISION_MODES
from grpo_ratio.old_pass.scorer import OldLogprobScorer, model_anatomy


def load(name: str, weights: str):
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    if name == "tiny":
        from grpo_ratio.testing import tiny_model

        return tiny_model("qwen2", dtype=dtype), "tiny qwen2 (2 layers, hidden 64, V=300)"
    from grpo_ratio.models import resolve_model

    model, _ = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct" if name == "smollm2" else name, dtype=dtype)
    return model, name


def batch(model, rows: int, prompt_len: int, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (rows, prompt_len + tokens), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)  # ragged completions, right-padded
    for i, n in enumerate(lengths.tolist()):
        mask[i, prompt_len + n:] = 0
    return ids, mask


def run(model, modes, layers, ids, mask, tokens, batch_size, repeats):
    """Median seconds and copy bytes per mode; modes are timed round-robin so machine load hits all alike."""
    scorers = {m: OldLogprobScorer(model, m, layers=layers if m == "guided_fp32" else None) for m in modes}
    for scorer in scorers.values():
        scorer.score(ids, mask, tokens, batch_size=batch_size)  # warm-up; builds copies
    times = {m: [] for m in modes}
    for _ in range(repeats):
        for mode, scorer in scorers.items():
            t0 = time.perf_counter()
            scorer.score(ids, mask, tokens, batch_size=batch_size)
            times[mode].append(time.perf_counter() - t0)
    return {m: (statistics.median(times[m]), scorers[m].extra_bytes()) for m in modes}


def render(result: dict) -> str:
    """Markdown table of one benchmark result (the JSON --json writes)."""
    lines = [f"`{result['command']}` — {result['label']}, {result['weights']} weights, B={result['rows']} "
             f"T={result['tokens']} chunk={result['batch_size']}, guided layers {result['layers']} of "
             f"{result['num_layers']}, {result['threads']} threads, median of {result['repeats']}", "",
             "| mode | time (s) | time / bf16 | extra MB | extra / bf16-size model |", "|---|---|---|---|---|"]
    t_bf16 = result["modes"]["bf16"]["seconds"]
    for mode, r in result["modes"].items():
        lines.append(f"| {mode} | {r['seconds']:.3f} | {r['seconds'] / t_bf16:.2f}x | {r['extra_bytes'] / 2**20:.1f} "
                     f"| {r['extra_bytes'] / result['bf16_model_bytes']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2', or a model path / hub id")
    p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32",
                   help="stored weight dtype: fp32 (TRL's default, trained under bf16 autocast) or bf16")
    p.add_argument("--rows", type=int, default=8, help="completions B")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="completion tokens T")
    p.add_argument("--batch-size", type=int, default=4, help="rows per forward chunk (per_device_train_batch_size)")
    p.add_argument("--layers", default=None, help="guided_fp32 layers, e.g. '0,1,2,3'; default: first quarter")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    p.add_argument("--render", default=None, help="print the markdown table of a result JSON and exit")
    a = p.parse_args(argv)
    if a.render:
        print(render(json.loads(Path(a.render).read_text())))
        return
    torch.manual_seed(0)
    model, label = load(a.model, a.weights)
    model.eval()
    L = len(model_anatomy(model).layers)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else list(range(max(1, L // 4)))
    ids, mask = batch(model, a.rows, a.prompt_len, a.tokens)
    res = run(model, PRECISION_MODES, layers, ids, mask, a.tokens, a.batch_size, a.repeats)
    result = {
        "command": "python benchmarks/old_pass.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "label": label, "weights": a.weights, "rows": a.rows, "tokens": a.tokens, "batch_size": a.batch_size,
        "layers": layers, "num_layers": L, "threads": torch.get_num_threads(), "repeats": a.repeats,
        "torch": torch.__version__, "bf16_model_bytes": sum(t.numel() * 2 for t in model.state_dict().values()),
        "modes": {m: {"seconds": t, "extra_bytes": extra} for m, (t, extra) in res.items()},
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()
