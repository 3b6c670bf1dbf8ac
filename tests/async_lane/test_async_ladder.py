"""The asynchronous ladder's runner (`benchmarks/ladder.py --source async_staleness`, cells in
benchmarks/async_ladder.py) end to end on a 2-step testbed: its own `vllm serve`, `RatioAsyncGRPOTrainer` per cell,
the held-out reward logged by `HeldOutReward`, the cell folders the ladder summary reads, and a second call that
reads every cell back without starting a server."""

import importlib.util
import json
from pathlib import Path

import pytest
from async_lane_utils import requires_vllm


pytestmark = [pytest.mark.async_lane, requires_vllm]
ROOT = Path(__file__).parents[2]


def load_runner():
    spec = importlib.util.spec_from_file_location("ladder_runner", ROOT / "benchmarks" / "ladder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_async_ladder_trains_each_cell_against_its_own_server_and_reads_them_back(tmp_path):
    runner = load_runner()
    runner.TESTBEDS["tiny_async_test"] = {
        "kind": "tiny_async", "head_scale": 10.0, "never_eos": True, "lora_rank": 8, "train_prompts": 8,
        "eval_prompts": 2, "eval_points": 1, "eval_generations": 2,
        "config": dict(use_cpu=True, bf16=False, gradient_checkpointing=False, per_device_train_batch_size=4,
                       gradient_accumulation_steps=1, num_generations=4, max_completion_length=4, max_steps=2,
                       learning_rate=5e-3, weight_sync_steps=1, token_budget=0, vllm_server_timeout=120,
                       logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True),
    }
    kwargs = dict(source="async_staleness", testbed="tiny_async_test", settings=["k0", "k1"], corrections=None,
                  seeds=[0], output_root=str(tmp_path), name="async_staleness", figures=False, show=False)
    summary = runner.run_ladder(**kwargs)
    folder = tmp_path / "async_staleness"
    cells = sorted(p.parent.relative_to(folder).as_posix() for p in folder.glob("*/*/cell.json"))
    # the reference setting runs the uncorrected arm alone; k1 every correction
    assert cells == ["k0/coupled-s0", "k1/coupled-s0", "k1/decoupled-s0", "k1/decoupled_tis-s0"]
    cell = json.loads((folder / "k1" / "decoupled_tis-s0" / "cell.json").read_text())
    assert cell["config"]["max_staleness"] == 1 and cell["config"]["queue_maxsize"] == 2 * 4  # 2 steps of 4
    assert cell["config"]["async_objective"] == "decoupled" and cell["config"]["is_correction"] == "tis"
    assert cell["steps"] == 2 and cell["cpu_s"] > 0
    assert not (folder / "k1" / "decoupled_tis-s0" / ".vllm_lora").exists()  # TRL's adapter scratch: not kept
    assert cell["command"] == ("python benchmarks/ladder.py --source async_staleness --testbed tiny_async_test "
                               f"--settings k1 --corrections decoupled_tis --seeds 0 --output_root {tmp_path} "
                               "--name async_staleness")
    history = json.loads((folder / "k1" / "decoupled_tis-s0" / "log_history.json").read_text())
    evaluations = [r for r in history if "eval_reward" in r]
    assert [r["step"] for r in evaluations] == [0, 2] and all(0 <= r["eval_reward"] <= 1 for r in evaluations)
    trained = [r for r in history if "loss" in r]
    assert len(trained) == 2 and all("ratio/staleness/0/num_tokens" in r or "ratio/staleness/1/num_tokens" in r
                                     for r in trained)
    assert summary["settings"]["k1"]["distance"] == 1.0 and summary["settings"]["k0"]["distance"] == 0.0
    assert summary["settings"]["k1"]["corrections"]["coupled"]["metric"] == "eval_reward"
    before = (folder / "k1" / "coupled-s0" / "log_history.json").read_text()
    assert runner.run_ladder(**kwargs) == summary  # every cell read back: no server, no training
    assert (folder / "k1" / "coupled-s0" / "log_history.json").read_text() == before
