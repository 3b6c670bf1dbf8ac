"""docs/async.md's CPU recipe, as written, against the lane's server: the server command the page gives is the one the
lane starts (its flags and environment), and the page's script line trains 3 steps with `$MODEL` the lane's tiny chat
Llama and `$SERVER` the lane's server (its port is free-picked, not 8000).
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from async_lane_utils import record_staleness, requires_vllm, serve_command, server_env


pytestmark = [pytest.mark.async_lane, requires_vllm]

ROOT = Path(__file__).resolve().parents[2]


def cpu_recipe() -> list[str]:
    """The commands of the page's CPU block (continuation lines joined), without the `export` line."""
    text = (ROOT / "docs" / "async.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    (block,) = [b for b in blocks if "trainers/async_grpo.py --cpu" in b]
    return [line for line in block.replace("\\\n", " ").splitlines() if line and not line.startswith("export ")]


def test_the_page_serves_with_the_lanes_server_command():
    server, _ = cpu_recipe()
    words = shlex.split(server.rstrip("& "))
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    argv = [w for w in words if w not in {f"{k}={v}" for k, v in env.items()}]
    lane = serve_command("$MODEL", 8000)
    assert argv[0] == ".venv-vllm/bin/python" and argv[1:] == lane[1:]  # the lane runs it with the venv's python
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert all(server_env()[k] == v for k, v in env.items())  # what the lane's server runs with


def test_the_pages_script_line_trains_against_the_lanes_server(lora_server, tiny_chat_llama_dir, tmp_path):
    _, script = cpu_recipe()
    assert script.startswith(".venv-vllm/bin/python trainers/async_grpo.py --cpu")
    (tmp_path / "trainers").symlink_to(ROOT / "trainers")  # the line's relative path, run from a scratch directory
    (tmp_path / ".venv-vllm").symlink_to(Path(sys.executable).parents[1])  # this lane's venv
    env = {**os.environ, "MODEL": tiny_chat_llama_dir, "SERVER": lora_server,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "done: 3 steps; per staleness: grpo-ratio report async_out" in proc.stdout

    history = json.loads((tmp_path / "async_out" / "log_history.json").read_text())  # the run record
    steps = [row for row in history if "loss" in row]
    assert len(steps) == 3
    buckets = record_staleness("recipe (`decoupled`, tis)", history)
    assert buckets and 0 in buckets  # step 1 trains on rollouts of the policy it holds
    assert "is_weight_mean" in buckets[0]  # decoupled: the IS weight is logged per staleness
