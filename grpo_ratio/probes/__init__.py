"""Probes of the bf16 batch-shape precision gap (`grpo-ratio probe ...`); see docs/probes.md."""
