"""`python -m grpo_ratio.ladder grid|rule|headline|figures|thresholds|summary ROOT`: the docs' generated blocks from
committed ladder results (docs/when_it_matters.md), files only.

    python -m grpo_ratio.ladder grid results/ladders             # verdicts per source x setting x correction
    python -m grpo_ratio.ladder rule results/ladders             # the rule
    python -m grpo_ratio.ladder headline results/ladders         # the README's sentence
    python -m grpo_ratio.ladder figures results/ladders          # image links (--write: draw every figure first)
    python -m grpo_ratio.ladder thresholds results/ladders/thresholds
    python -m grpo_ratio.ladder summary results/ladders/staleness   # rewrite one ladder's ladder.json
"""

from __future__ import annotations

import argparse
import sys

from .outcomes import find_ladders, write_summary
from .render import render_figures, render_grid, render_headline, render_rule, render_thresholds, write_figures
from .rule import load_summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_ratio.ladder", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["grid", "rule", "headline", "figures", "thresholds", "summary"])
    parser.add_argument("root", help="the folder of ladder folders (results/ladders), or one ladder folder (summary)")
    parser.add_argument("--write", action="store_true", help="figures: draw each ladder's figure before linking it")
    parser.add_argument("--docs", default="docs", help="figures: the folder the links are relative to")
    args = parser.parse_args(argv)
    if args.what == "summary":
        print(write_summary(args.root))
    elif args.what == "figures":
        if args.write:
            for folder in find_ladders(args.root):
                write_figures(folder, folder)
        print(render_figures(args.root, args.docs), end="")
    elif args.what == "thresholds":
        print(render_thresholds(args.root), end="")
    else:
        render = {"grid": render_grid, "rule": render_rule, "headline": render_headline}[args.what]
        print(render(load_summaries(args.root)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
