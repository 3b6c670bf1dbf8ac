"""Two CPU processes (gloo) under the real `accelerate launch`: fp16_clone and the fused fp32_head train and ranks
stay in step.

Run: pytest tests/test_distributed.py   (about 20 s; starts two Python processes)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("mode", ["fp16_clone", "fp32_head"])
def test_two_process_run(tmp_path, mode):
    script = Path(__file__).parent / "two_process_train.py"
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(tmp_path), mode]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    assert result["checksums"][0] == result["checksums"][1]  # DDP kept both ranks' weights identical
    steps = [row for row in result["history"] if "loss" in row]
    assert len(steps) == 2 and all(row["num_tokens"] > 0 for row in steps)
    # ratio metrics are reduced over both ranks: 2 completions per rank x 2 ranks = 4 completions per step
    assert all(row["ratio/new_old/num_tokens"] == row["completions/mean_length"] * 4 for row in steps)
    if mode == "fp16_clone":
        assert all(row["ratio/fp16_fallback_rows"] == 0 for row in steps)
    else:  # DDP replicates the weights: fp32_head takes the fused path on each rank (no body pass)
        assert result["fused_head"] and all(row["ratio/new_old/mean_abs_log_ratio"] > 0 for row in steps)
