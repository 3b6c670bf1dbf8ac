"""The measured tables in docs/ are generated from committed results (scripts/update_docs.py), never typed by hand."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_generated_doc_tables_are_up_to_date():
    proc = subprocess.run([sys.executable, "scripts/update_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
