"""Two CPU processes (gloo) under the real `accelerate launch`: fp16_clone and the fused fp32_head train and ranks
stay in step; the launch ends with no process left behind (grpo_ratio/testing/ranks.py).

Run: pytest tests/test_distributed.py   (about 1 minute; starts two Python processes per launch)
"""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from grpo_ratio.testing.ranks import run_ranks


@pytest.mark.parametrize("mode", ["fp16_clone", "fp32_head"])
def test_two_process_run(tmp_path, mode):
    script = Path(__file__).parent / "two_process_train.py"
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(tmp_path), mode]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    # raises if the launch runs past 600 s or leaves a process behind (both killed, ranks in their own sessions too)
    (proc,) = run_ranks([cmd], timeout=600, envs=[env])
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


# a launcher that starts a "rank" in a session of its own (as torch elastic does), writes its pid, then ends (or
# hangs): killing the launcher alone leaves the rank running
_LAUNCHER = textwrap.dedent("""
    import pathlib, subprocess, sys, time
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    pathlib.Path(sys.argv[2]).write_text(str(rank.pid))
    if sys.argv[1] == "hang":
        time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_rank_that_outlives_its_launcher_is_killed_and_reported(tmp_path):
    # subprocess.run returned here with the "rank" still running (alive 38 minutes later in the hung test)
    with pytest.raises(RuntimeError, match=r"run_ranks: 1 process\(es\) of the launch outlived it and were killed") as err:
        run_ranks([[sys.executable, "-c", _LAUNCHER, "end", str(tmp_path / "pid")]], timeout=60)
    rank = int((tmp_path / "pid").read_text())
    assert f"[{rank}]" in str(err.value) and not _alive(rank)


def test_a_launch_past_its_timeout_is_killed_whole(tmp_path):
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks([[sys.executable, "-c", _LAUNCHER, "hang", str(tmp_path / "pid")]], timeout=15)
    assert time.monotonic() - start < 40
    assert not _alive(int((tmp_path / "pid").read_text()))  # the rank in its own session died with the launcher


_END_RANK = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from grpo_ratio.testing.ranks import end_rank
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + __import__("sys").argv[1], rank=0, world_size=1)
    model = DistributedDataParallel(torch.nn.Linear(2, 2))
    try:
        end_rank()
    except RuntimeError as err:
        print("REFUSED", err)
    print("STILL_INITIALIZED", dist.is_initialized())
    del model
    end_rank()
    print("ENDED", dist.is_initialized())
""")


def test_end_rank_refuses_while_a_ddp_model_is_alive_and_ends_after():
    # a DDP model alive at the group's end would make its Reducer the group's last owner (the hang's cause)
    from test_ratios import _free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    (proc,) = run_ranks([[sys.executable, "-c", _END_RANK, str(_free_port())]], timeout=120, envs=[env])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("REFUSED end_rank: 1 DistributedDataParallel model(s) still referenced; drop every")
    assert lines[1:] == ["STILL_INITIALIZED True", "ENDED False"]
