"""A resident copy against per-layer casts (`copy_storage`), side by side in one run: time per old pass, refresh time
per optimizer step and bytes held, and which is cheaper as a function of the old passes per optimizer step.

`fp16_clone` (and `fp32_clone` on bf16-stored weights) needs the policy's weights in another dtype. `resident` keeps a
whole copy (2 bytes per parameter in fp16, 4 in fp32), refreshed once per optimizer step; `per_layer` casts each
module's weights just before it runs in the old pass and frees them after (grpo_ratio.old_pass.copies.PerLayerCast): nothing
held between passes, nothing to refresh, every pass pays the casts (each module's, once per forward chunk). Both run
the same forward on the same casts, so what differs per optimizer step with k old passes is only (a copy is refreshed
at most once per step, and only when a pass uses it: min(k, 1) refreshes per step):

    resident:  min(k, 1) * t_refresh        per_layer:  k * t_casts

where t_casts is the time one old pass spends casting and restoring (measured inside the pass, `PerLayerCast.
cast_seconds`). With k* = t_refresh / t_casts: per-layer casts are cheaper below k* when k* >= 1, and at no k when
k* < 1 (for k <= 1 both scale with k); they always hold less memory. TRL's on-policy default has k = 1 (one generation,
one old pass per optimizer step); k < 1 when a generation serves several optimizer steps (`steps_per_generation` >
gradient accumulation); k > 1 with several generation batches per step. The whole old pass is timed too (the casts'
share of it, and a check that nothing else differs); on a loaded machine its spread is large, the casts' is not.

    python benchmarks/copies.py --model tiny                                   # seconds
    python benchmarks/copies.py --model smollm2 --tokens 32 --json results/copies_smollm2_fp32.json   # minutes
    python benchmarks/copies.py --render results/copies_smollm2_fp32.json     # the markdown table of a result

Each storage scores the same right-padded batch, chunked like TRL's old pass; storages are timed round-robin (machine
load hits both alike), medians of --repeats. A refresh is timed on the resident copy after the policy's weights moved
(an in-place update, as an optimizer step does); the per-layer row checks that its log-probs follow the moved weights
without one. "held" is the bytes kept between old passes; "peak during a pass" the most copy bytes alive at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from grpo_ratio.config import COPY_STORAGES
from grpo_ratio.old_pass.scorer import OldLogprobScorer


def load(name: str, weights: str):
    """(model, label) in the stored dtype `weights` ("fp32" or "bf16")."""
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    if name == "tiny":
        from grpo_ratio.testing import tiny_model

        return tiny_model("llama", dtype=dtype, tie_word_embeddings=True), "tiny llama (2 layers, hidden 64, V=300, tied)"
    from grpo_ratio.models import resolve_model

    model, _ = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct" if name == "smollm2" else name, dtype=dtype)
    return model, "SmolLM2-135M-Instruct" if name == "smollm2" else name


def batch(vocab_size: int, rows: int, prompt_len: int, tokens: int, seed: int = 0):
    """(input_ids, attention_mask) (B, P+T): random tokens, ragged right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (rows, prompt_len + tokens), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)
    for i, n in enumerate(lengths.tolist()):
        mask[i, prompt_len + n:] = 0
    return ids, mask


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _step(model) -> None:
    """What an optimizer step does to the weights: every parameter moves in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + 1e-3)


def run(model, mode: str, ids, mask, tokens: int, batch_size: int, repeats: int) -> dict:
    """Per storage: median seconds per old pass and per refresh, bytes held and peak, plus the bitwise check."""
    dtype = torch.float16 if mode == "fp16_clone" else torch.float32
    scorers = {s: OldLogprobScorer(model, mode, copy_storage=s) for s in COPY_STORAGES}
    score = lambda s, version: scorers[s].score(ids, mask, tokens, batch_size=batch_size, version=version).logps
    first = {s: score(s, 0) for s in COPY_STORAGES}  # warm-up; builds the resident copy
    passes = {s: [] for s in COPY_STORAGES}
    refreshes = []
    version = 0
    for _ in range(repeats):
        for s in COPY_STORAGES:
            passes[s].append(_timed(lambda: score(s, version)))  # noqa: B023 (called at once)
        _step(model)
        version += 1
        resident_copy = scorers["resident"].copies()[0]
        refreshes.append(_timed(lambda: resident_copy.refresh(version)))  # noqa: B023
    moved = {s: score(s, version) for s in COPY_STORAGES}  # after the last step, at its version: no refresh due
    cast = scorers["per_layer"].per_layer_cast(dtype)
    cast_passes = repeats + 2  # the warm-up, the timed passes and the last one: every pass of the per-layer scorer
    out = {}
    for s in COPY_STORAGES:
        out[s] = {"pass_seconds": statistics.median(passes[s]), "pass_range": (min(passes[s]), max(passes[s])),
                  "cast_seconds": cast.cast_seconds / cast_passes if s == "per_layer" else 0.0,
                  "refresh_seconds": statistics.median(refreshes) if s == "resident" else 0.0,
                  "refreshes": scorers[s].copies()[0].num_refreshes if s == "resident" else 0,
                  "held_bytes": scorers[s].extra_bytes(),
                  "peak_bytes": scorers[s].extra_bytes() if s == "resident" else cast.peak_bytes}
    out["equal_before_step"] = bool(torch.equal(first["resident"], first["per_layer"]))
    out["equal_after_steps"] = bool(torch.equal(moved["resident"], moved["per_layer"]))
    return out


def break_even(res: dict) -> float | None:
    """k* = t_refresh / t_casts: per-layer casts are cheaper below k* when k* >= 1, at no k when k* < 1; None when the
    casts took no measurable time (cheaper at every k)."""
    casts = res["per_layer"]["cast_seconds"]
    return None if casts <= 0 else res["resident"]["refresh_seconds"] / casts


def copy_seconds(res: dict, storage: str, k: float) -> float:
    """Seconds per optimizer step that the copy itself costs with k old passes per step: min(k, 1) refreshes of the
    resident copy, or k passes' casts."""
    r = res[storage]
    return min(k, 1.0) * r["refresh_seconds"] + k * r["cast_seconds"]


def render(result: dict) -> str:
    """Markdown of one result (the JSON --json writes)."""
    res = result["storages"]
    lines = [f"`{result['command']}` — {result['label']}, {result['weights']} weights, {result['mode']}, "
             f"B={result['rows']} T={result['tokens']} chunk={result['batch_size']}, {result['params']:,} parameters, "
             f"{result['threads']} threads, median of {result['repeats']}", "",
             "| copy_storage | old pass (s, median [range]) | casts per pass (s) | refresh per optimizer step (s) | "
             "held between passes (MB) | peak during a pass (MB) | copy cost per step at k = 0.5 / 1 / 2 / 4 (s) |",
             "|---|---|---|---|---|---|---|"]
    for s in COPY_STORAGES:
        r = res[s]
        lo, hi = r["pass_range"]
        per_step = " / ".join(f"{copy_seconds(res, s, k):.3f}" for k in (0.5, 1, 2, 4))
        lines.append(f"| {s} | {r['pass_seconds']:.3f} [{lo:.3f}, {hi:.3f}] | {r['cast_seconds']:.3f} | "
                     f"{r['refresh_seconds']:.3f} | {r['held_bytes'] / 2**20:.3f} | {r['peak_bytes'] / 2**20:.3f} | "
                     f"{per_step} |")
    k = break_even(res)
    if k is None:
        verdict = "per-layer casts are cheaper at any number of old passes per optimizer step"
    elif k >= 1:
        verdict = (f"per-layer casts are cheaper below k* = {k:.2f} old passes per optimizer step (TRL's on-policy "
                   f"default is 1), the resident copy above")
    else:
        verdict = (f"the resident copy is cheaper at every k (k* = {k:.2f}: a refresh costs less than the casts of one "
                   f"pass)")
    equal = "bitwise equal" if res["equal_before_step"] and res["equal_after_steps"] else "NOT equal"
    lines += ["", f"Here {verdict}; log-probs of the two {equal} (before and after {result['repeats']} weight "
              f"updates)."]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny', 'smollm2', or a model path / hub id")
    p.add_argument("--weights", choices=["fp32", "bf16"], default="fp32",
                   help="stored weight dtype: fp32 (TRL's default; fp16_clone's copy) or bf16 (fp32_clone's copy)")
    p.add_argument("--rows", type=int, default=8, help="completions B")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="completion tokens T")
    p.add_argument("--batch-size", type=int, default=8,
                   help="rows per forward chunk (per_device_train_batch_size); TRL's old pass has steps_per_generation "
                   "chunks, one by default, and the casts run once per chunk")
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
    mode = "fp16_clone" if a.weights == "fp32" else "fp32_clone"
    ids, mask = batch(model.config.vocab_size, a.rows, a.prompt_len, a.tokens)
    result = {
        "command": "python benchmarks/copies.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "label": label, "weights": a.weights, "mode": mode, "rows": a.rows, "tokens": a.tokens,
        "batch_size": a.batch_size, "repeats": a.repeats, "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
        "storages": run(model, mode, ids, mask, a.tokens, a.batch_size, a.repeats),
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(render(result))


if __name__ == "__main__":
    main()
