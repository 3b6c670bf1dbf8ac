"""The walkthrough notebook runs top to bottom on the real SmolLM2 (slow: about 10 minutes on 2 CPU cores).

Run: pytest -m slow tests/test_notebook.py
"""

from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_walkthrough_notebook_executes(tmp_path, monkeypatch):
    gsm8k = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"  # the project's copy; else the built-in prompts
    if gsm8k.is_file():
        monkeypatch.setenv("GSM8K_TEST_JSONL", str(gsm8k))  # the kernel inherits the environment
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / "walkthrough.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "| bf16" in outputs  # the probe's table was printed
    assert "'reward'" in outputs and "ratio/new_old/oob_rate" in outputs  # ratio metrics next to the reward
    assert (ROOT / "runs" / "notebook" / "arms" / "comparison.png").exists()
