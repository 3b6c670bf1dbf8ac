"""The CPU side of the GPU check (scripts/gpu_check.sh, issue 31 item 5): the script parses, every pytest node id it
names is collected, `--dry-run` writes its JSON, and without a GPU the real check fails at its first step, saying so.
Not marked `gpu`: these run on every CPU test run, so the check is ready for the first machine with a GPU.

Run: pytest tests/gpu/test_gpu_check.py
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args, timeout=300):
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_node_id_it_names_is_collected():
    nodes = re.findall(r"^\s+(tests/gpu/\S+::\S+)$", SCRIPT.read_text(), flags=re.M)
    assert len(nodes) >= 7 and all(n.split("::")[0].startswith("tests/gpu/test_") for n in nodes)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          *nodes], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    collected = {line.split("[")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == set(nodes)


def test_dry_run_writes_its_json(tmp_path):
    result = _run("--dry-run", "--out", str(tmp_path / "check.json"))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["dry_run"] and report["ok"] and report["steps"]["collect"]["status"] == "passed"
    assert report["steps"]["peak_memory_args"]["status"] == "passed"  # the benchmark accepts the GPU arguments
    assert "--device cuda --shape 1.5b" in report["peak_memory_plan"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the real check runs (bash scripts/gpu_check.sh)")
def test_without_a_gpu_the_check_fails_at_its_first_step(tmp_path):
    result = _run("--out", str(tmp_path / "check.json"))
    assert result.returncode == 1
    report = json.loads((tmp_path / "check.json").read_text())
    assert not report["ok"] and list(report["steps"]) == ["environment"]
    assert "no CUDA device" in report["steps"]["environment"]["output_tail"]
