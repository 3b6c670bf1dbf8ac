"""The CPU side of the GPU check (scripts/gpu_check.sh, issues 31 and 39): the script parses, every pytest node id it
names is collected, `--dry-run --collect-only` writes its JSON with python3 found on PATH, `--prepare` refuses wheels
over the 64 MiB that can be carried, without a GPU the real check fails at its first step, saying so, and the
benchmark times its first arm and skips what would not fit. Not marked `gpu`: these run on every CPU test run, so the
check is ready for the first machine with a GPU; the whole dry run (every step, test bodies on the CPU) is `slow`.

Run: pytest tests/gpu/test_gpu_check.py            # the whole dry run: pytest -m slow tests/gpu/test_gpu_check.py
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(*args, timeout=300, python=sys.executable, path="/usr/bin:/bin"):
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp")}
    if python is not None:
        env["PYTHON"] = python
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_node_id_it_names_is_collected():
    nodes = re.findall(r"^\s+(tests/gpu/\S+::\S+)$", SCRIPT.read_text(), flags=re.M)
    assert len(nodes) >= 16 and all(n.split("::")[0].startswith("tests/gpu/test_") for n in nodes)
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          *nodes], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    collected = {line.split("[")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == set(nodes)


def test_dry_run_finds_python3_on_path_and_writes_its_json(tmp_path):
    # was: PYTHON defaulted to .venv/bin/python, else `python`, which a bare image may not have
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    result = _run("--dry-run", "--collect-only", "--out", str(tmp_path / "check.json"), python=None,
                  path=f"{bin_dir}:/usr/bin:/bin")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["dry_run"] and report["ok"] and list(report["steps"]) == ["environment", "collect", "peak_memory_args"]
    assert "grpo_ratio from" in report["steps"]["environment"]["output_tail"]  # imported from the repository
    assert "on cuda, shape 1.5b, 512 completion tokens, within 120 s" in report["steps"]["peak_memory_args"][
        "output_tail"]
    assert report["budget_seconds"] <= 450 and report["seconds"] < report["budget_seconds"]


def test_prepare_refuses_wheels_over_the_carry_limit(tmp_path):
    # pip stands in for PyPI here: its `download` leaves 65 MiB of sparse wheels (the size check reads their sizes)
    shim = tmp_path / "python"
    shim.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2 $3" = "-m pip download" ]; then
  while [ $# -gt 0 ]; do [ "$1" = -d ] && dir=$2; shift; done
  truncate -s 40M "$dir/pyarrow-24.0.0-cp312-cp312-manylinux_2_28_x86_64.whl"
  truncate -s 25M "$dir/pandas-3.1.1-cp312-cp312-manylinux_2_28_x86_64.whl"
  exit 0
fi
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    result = _run("--prepare", str(tmp_path / "wheels"), python=str(shim))
    assert result.returncode == 1
    assert "holds 65.0 MiB of wheels, over the 64 MiB that can be carried" in result.stderr
    assert "65.00 MiB  in 2 wheels (limit 64 MiB)" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the real check runs (bash scripts/gpu_check.sh)")
def test_without_a_gpu_the_check_fails_at_its_first_step(tmp_path):
    result = _run("--out", str(tmp_path / "check.json"))
    assert result.returncode == 1
    report = json.loads((tmp_path / "check.json").read_text())
    assert not report["ok"] and list(report["steps"]) == ["environment"]
    assert "no CUDA device" in report["steps"]["environment"]["output_tail"]


def test_collect_only_needs_dry_run():
    result = _run("--collect-only")
    assert result.returncode == 2 and "--collect-only goes with --dry-run" in result.stderr


@pytest.mark.slow
def test_the_whole_dry_run_passes_on_the_cpu(tmp_path):
    # every step as on the GPU machine (with the interpreter's own packages: no --wheels), test bodies on the CPU
    result = _run("--dry-run", "--out", str(tmp_path / "check.json"), timeout=600)
    report = json.loads((tmp_path / "check.json").read_text())
    assert result.returncode == 0 and report["ok"], json.dumps(report["steps"], indent=1)[-4000:]
    assert report["steps"]["gpu_tests"]["counts"]["passed"] == 5
    assert [r["arm"] for r in report["peak_memory"]["records"]][0] == "trl"


# ---------------------------------------------------------------------------------------------------------------------
# benchmarks/peak_memory.py: the arms under a time budget


def _peak_memory():
    spec = importlib.util.spec_from_file_location("peak_memory", ROOT / "benchmarks" / "peak_memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def test_the_first_arm_is_timed_and_the_rest_run_while_they_fit(monkeypatch):
    bench = _peak_memory()
    monkeypatch.delitem(sys.modules, "peak_memory")
    clock = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])

    def arm_process(cmd, **kwargs):  # each arm "takes" 40 s and writes its record
        clock[0] += 40.0
        name = cmd[cmd.index("--arm") + 1]
        Path(cmd[cmd.index("--arm-json") + 1]).write_text(json.dumps({
            "arm": name, "peak_bytes": 2, "baseline_bytes": 1, "increment_bytes": 1, "seconds": 30.0,
            "completion_length": 8}))
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(bench.subprocess, "run", arm_process)
    logged = []
    records = bench.run_benchmark(8, bench.ARMS[:5], log=logged.append, budget_s=130)
    assert [r["arm"] for r in records] == ["trl", "trl_cast_lm_head_to_fp32", "bf16"]  # 3 x 40 s; a 4th would not fit
    assert records[0]["process_seconds"] == 40.0
    assert logged[-1] == "skipped fp32_clone, fp16_clone: 10 s left of 130 s, an arm takes up to 40 s here"
    assert len(bench.run_benchmark(8, bench.ARMS[:5], log=logged.append)) == 5  # no budget: every arm


def test_the_large_shape_is_never_built_on_the_cpu():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peak_memory.py"), "--shape", "1.5b",
                             "--check-args"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 1 and "--shape 1.5b runs on a GPU only (--device cuda)" in result.stderr
