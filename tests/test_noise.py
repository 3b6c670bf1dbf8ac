"""Noise around a run (issue 40, item 8): the console prints a few ratio keys while every key stays logged; the set-up
script drops pip's notices; W&B's offline banner only where W&B is a target; the tested transformers range."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from trainer_fixtures import tiny_grpo_args, tiny_trainer


ROOT = Path(__file__).parents[1]


def _printed_rows(text: str) -> list[dict]:
    import ast

    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{") and "'loss'" in line]


def test_the_console_prints_trls_keys_and_a_few_ratio_keys_while_every_key_is_logged(tmp_path, capsys):
    from grpo_ratio.diagnostics.console import CONSOLE_RATIO_KEYS, RatioPrinterCallback

    trainer = tiny_trainer(tmp_path, max_steps=2, top_p=0.8, truncation_correction="renormalize", is_correction="tis")
    assert sum(isinstance(c, RatioPrinterCallback) for c in trainer.callback_handler.callbacks) == 1
    trainer.train()
    printed = _printed_rows(capsys.readouterr().out)
    logged = [r for r in trainer.state.log_history if "loss" in r]
    assert len(printed) == len(logged) == 2
    for shown, row in zip(printed, logged):
        ratio = [k for k in row if k.startswith("ratio/")]
        assert len(row) > 70 and len(ratio) > 45  # everything is logged (was: everything printed, ~75 keys)
        ours = {k for k in shown if k.startswith("ratio/") and k != "ratio/*"}
        assert ours == {k for k in CONSOLE_RATIO_KEYS if k in row} and len(ours) <= len(CONSOLE_RATIO_KEYS)
        assert shown["ratio/*"] == f"+{len(ratio) - len(ours)} more in log_history.json"
        assert {k for k in row if not k.startswith("ratio/")} - {"step"} == set(shown) - ours - {"ratio/*"}
        assert len(shown) < 40
    assert json.loads((tmp_path / "log_history.json").read_text()) == trainer.state.log_history


def test_the_progress_bar_prints_the_same_trimmed_row_and_leaves_the_row_whole(capsys):
    from tqdm.auto import tqdm
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from grpo_ratio.diagnostics.console import RatioPrinterCallback, RatioProgressCallback

    row = {"loss": 0.5, "reward": 0.25, "ratio/new_old/oob_rate": 0.01, "ratio/new_old/p1": 0.9,
           "ratio/old_sampler/kl_k3": 1e-3, "total_flos": 7.0}
    args, state, control = TrainingArguments("out", report_to="none"), TrainerState(), TrainerControl()
    bar = RatioProgressCallback()
    bar.training_bar = tqdm(total=1, disable=False)
    bar.on_log(args, state, control, logs=dict(row))
    printer = RatioPrinterCallback()
    shared = dict(row)
    printer.on_log(args, state, control, logs=shared)
    out = _printed_rows(capsys.readouterr().out)
    expected = {"loss": "0.5", "reward": "0.25", "ratio/new_old/oob_rate": "0.01", "ratio/*": "+2 more in log_history.json"}
    assert out == [expected, expected]
    assert shared == {k: v for k, v in row.items() if k != "total_flos"}  # as PrinterCallback leaves the row


def test_setup_drops_pips_location_notices_and_keeps_the_rest(tmp_path):
    # scripts/setup.sh's pip wrapper on a stand-in `.venv/bin/python` that prints what pip printed 121 times
    script = (ROOT / "scripts" / "setup.sh").read_text()
    start = script.index("pip_q() {")
    function = script[start:script.index("\n}\n", start) + 3]
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\nfor i in 1 2 3; do echo \"WARNING: Location 'https://example.invalid/simple/x/' is "
                    "ignored: it is either a non-existing path or lacks a specific scheme.\" >&2; done\n"
                    "echo 'Successfully installed x'\nexit 0\n")
    fake.chmod(0o755)
    run = subprocess.run(["bash", "-c", f"set -euo pipefail\n{function}\npip_q install x"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["Successfully installed x"] and run.stderr == ""
    assert "PIP=pip_q" in script and script.count("-m pip") == 1  # every pip call goes through the filter


def test_wandb_offline_mode_is_set_only_for_a_wandb_target(tmp_path, monkeypatch):
    # transformers prints "Running in WANDB offline mode" at import whenever WANDB_MODE=offline is set: the package
    # sets it only with report_to naming wandb, and the README's snippet does the same
    from grpo_ratio.cli.train import configure_reporting

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    args = tiny_grpo_args(tmp_path, report_to="none")
    configure_reporting(args)
    assert "WANDB_MODE" not in os.environ
    configure_reporting(tiny_grpo_args(tmp_path, report_to=["wandb"]))
    assert os.environ["WANDB_MODE"] == "offline"
    readme = (ROOT / "README.md").read_text().splitlines()
    (line,) = [i for i, text in enumerate(readme) if 'os.environ.setdefault("WANDB_MODE"' in text]
    assert readme[line - 1].startswith('if "wandb" in args.report_to:') and readme[line].startswith("    ")


def test_transformers_is_pinned_to_the_tested_range():
    import importlib.metadata as md

    import tomllib
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in deps if Requirement(d).name == "transformers"]
    assert str(spec) in ("<5.26,>=5.19", ">=5.19,<5.26")
    assert md.version("transformers") in spec  # the version this suite runs on is in the range it claims
    assert "`>=5.19,<5.26`" in (ROOT / "README.md").read_text()
