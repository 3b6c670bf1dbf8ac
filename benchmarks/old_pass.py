"""Old-pass cost of each scoring mode, side by side in one run: time and extra memory as ratios to `bf16`.

For a model in TRL's default regime (fp32 weights, bf16 autocast) and, with --weights bf16, for bf16-stored weights
(where the fp32 modes need copies). Each mode scores the same right-padded batch of completions, chunked like TRL's
old pass; times are the median of --repeats runs after one warm-up (which also builds any copy).

    python benchmarks/old_pass.py --model tiny                 # seconds
    python benchmarks/old_pass.py --model smollm2 --rows 8 --tokens 64 --repeats 1   # minutes on 2 CPU cores

Extra memory is the bytes held by the mode's copies (parameters and buffers), which is what a mode adds to training;
activation memory of one chunk is the same order for every mode and is not counted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from grpo_ratio.config import SCORING_MODES
from grpo_ratio.scoring import OldLogprobScorer, model_anatomy


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
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model, label = load(a.model, a.weights)
    model.eval()
    L = len(model_anatomy(model).layers)
    layers = [int(x) for x in a.layers.split(",")] if a.layers else list(range(max(1, L // 4)))
    ids, mask = batch(model, a.rows, a.prompt_len, a.tokens)
    res = run(model, SCORING_MODES, layers, ids, mask, a.tokens, a.batch_size, a.repeats)
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    table = Table(title=f"old pass, {label}, {a.weights} weights, B={a.rows} T={a.tokens} chunk={a.batch_size}, "
                        f"guided layers {layers} of {L}")
    for col in ("mode", "time (s)", "time / bf16", "extra MB", "extra / bf16 model"):
        table.add_column(col, justify="right")
    t_bf16 = res["bf16"][0]
    bf16_bytes = sum(t.numel() * 2 for t in model.state_dict().values())  # the policy held in bf16
    for mode, (t, extra) in res.items():
        table.add_row(mode, f"{t:.3f}", f"{t / t_bf16:.2f}x", f"{extra / 2**20:.1f}", f"{extra / bf16_bytes:.2f}x")
    Console(width=140).print(table)
    print(f"policy weights as stored: {params / 2**20:.1f} MB; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
