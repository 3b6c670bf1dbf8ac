"""Analysis: reads logs after training. `report.py` (`grpo-ratio report`), `advice.py` (its findings), `verdict.py`
(comparison verdicts), `plots.py`, `metric_peers.py` (the peers' nearest keys)."""
