"""Installing the package the way scripts/setup.sh does: `pip install -e .` from a clone. Slow (a venv and a build,
about a minute): pytest -m slow tests/test_install.py"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
USER_SCRIPT = """import importlib.util
spec = importlib.util.find_spec("grpo_ratio")  # finds without importing: the venv has no dependencies
print(spec.origin)
"""


def test_editable_install_wins_over_a_clone_folder_of_the_same_name(tmp_path):
    # A user clones the repository (folder grpo_ratio) next to their own script. Python puts the script's folder
    # first on sys.path and would take the clone folder as a namespace package unless the install puts the
    # repository root on sys.path (pyproject: package-dir "" = ".", a plain .pth file).
    clone = tmp_path / "grpo_ratio"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".venv*", ".git", "runs", "build", "*.egg-info",
                                                                "__pycache__", ".pytest_cache", ".ruff_cache"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user's shell: only the install counts
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "--no-deps", "-e", str(clone)], capture_output=True,
                             text=True, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    # no setuptools warning: neither the license-table deprecation nor the editable finder's "folders with the same
    # name as your package" caution (pip re-emits both as BuildBackendWarning)
    assert not re.search(r"BuildBackendWarning|DeprecationWarning", install.stdout + install.stderr), install.stderr
    (tmp_path / "user_script.py").write_text(USER_SCRIPT)
    found = subprocess.run([python, str(tmp_path / "user_script.py")], capture_output=True, text=True, check=True,
                           env=env)
    assert found.stdout.strip() == str(clone / "grpo_ratio" / "__init__.py")
