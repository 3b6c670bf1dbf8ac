"""Draw docs/img/reading.png, the picture of docs/reading.md, from committed result files only.

    python scripts/reading_figure.py            # rewrites docs/img/reading.png

Left: the two ratios of each arm on SmolLM2-135M-Instruct (arithmetic, 2 steps; results/ratio_smollm2_arithmetic.json):
share of tokens out of [0.9, 1.1] for new/old (what PPO's clip reads) and old/sampler (what importance-sampling
correction reads). Right: truncated sampling (GSM8K prompts; results/ratio_smollm2.json): old/sampler out of band
before and after `renormalize`, with the mean kept mass.
"""

from __future__ import annotations

import json
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _first_rows(path: Path, table: str) -> list[tuple[dict, dict]]:
    runs = json.loads(path.read_text())["runs"]
    return [(r["setting"], next(row for row in r["rows"] if "loss" in row)) for r in runs if r["table"] == table]


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = _first_rows(ROOT / "results" / "ratio_smollm2_arithmetic.json", "precision")
    trunc = _first_rows(ROOT / "results" / "ratio_smollm2.json", "truncation")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = [s["old_logprob_mode"] for s, _ in arms]
    x = range(len(names))
    new_old = [100 * r["ratio/new_old/oob_rate"] for _, r in arms]
    old_sampler = [100 * r["ratio/old_sampler/oob_rate"] for _, r in arms]
    left.bar([i - 0.2 for i in x], new_old, 0.4, label="new/old (PPO clip reads it)")
    left.bar([i + 0.2 for i in x], old_sampler, 0.4, label="old/sampler (IS correction reads it)")
    left.set_xticks(list(x), names)
    left.set_ylabel("% of tokens out of [0.9, 1.1]")
    left.set_title("Each arm moves the gap, it does not remove it\n(SmolLM2, arithmetic, bf16 training, first inner "
                   "step)", fontsize=9)
    left.legend(fontsize=8)
    settings = [s["name"] for s, _ in trunc]
    y = range(len(settings))
    raw = [100 * r["ratio/old_sampler/oob_rate"] for _, r in trunc]
    fixed = [100 * r["ratio/old_sampler_corrected/oob_rate"] for _, r in trunc]
    right.bar([i - 0.2 for i in y], raw, 0.4, label="old/sampler, raw", color="tab:red")
    right.bar([i + 0.2 for i in y], fixed, 0.4, label="after renormalize", color="tab:green")
    for i, (_, r) in enumerate(trunc):
        right.annotate(f"kept mass {r['ratio/kept_mass_mean']:.3f}", (i, raw[i]), ha="center", va="bottom", fontsize=7)
    right.set_xticks(list(y), settings)
    right.set_ylim(0, max(raw) * 1.2)
    right.set_title("Truncated sampling: the kept mass, then corrected\n(SmolLM2, GSM8K prompts, one step)",
                    fontsize=9)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    draw(ROOT / "docs" / "img" / "reading.png")
    print(f"wrote {ROOT / 'docs' / 'img' / 'reading.png'}")
