"""Diagnostics: what is logged during training. `ratios.py` and `mismatch.py` (pure statistics), `metric_keys.py`
(every `ratio/*` key), `ratio_diagnostics.py` (the per-update accumulator), `gate.py` and `gate_callback.py` (the
tolerance gate), `run_record.py` and `run_record_callback.py` (the run.json and log_history.json every trainer leaves
in its output_dir for `grpo-ratio report`)."""
