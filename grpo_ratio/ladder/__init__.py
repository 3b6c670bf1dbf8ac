"""Ladder: mismatch ladders and the report rule (issue 41; docs/when_it_matters.md). Reads files only.

`definitions.py` (the ladders as data: per source a dial and its corrections, as config overrides), `outcomes.py`
(what each cell's run folder says: held-out reward, its area under the curve, collapse signals, step-1 diagnostics,
cost, the paired verdicts), `rule.py` (the rule a run's step-1 distance gets from the committed ladders, which
`grpo-ratio report` states) and `render.py` (the docs' grid, rule, figures and headline: `python -m grpo_ratio.ladder`).
`benchmarks/ladder.py` runs the cells.
"""

from .definitions import LADDERS, Correction, Distance, Ladder, Setting, ladder


__all__ = ["LADDERS", "Correction", "Distance", "Ladder", "Setting", "ladder"]
