"""House rules that keep the code easy to follow (docs/design.md, "Rules of the house"), checked on the files: no module
over 550 lines, nothing edits `sys.path`, the trainer asks the plan instead of comparing config strings.

Run: pytest tests/test_layout.py
"""

import re
from pathlib import Path


ROOT = Path(__file__).parents[1]
CODE = sorted(p for folder in ("grpo_ratio", "benchmarks", "scripts", "trainers") for p in (ROOT / folder).rglob("*.py"))
MAX_LINES = 550


def test_no_module_over_550_lines():
    long = {str(p.relative_to(ROOT)): n for p in CODE if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
    assert len(CODE) > 50  # the glob found the package


def test_nothing_edits_sys_path():
    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*=|sys\.path\s*\+=")
    assert [str(p.relative_to(ROOT)) for p in CODE + sorted((ROOT / "tests").rglob("*.py"))
            if edits.search(p.read_text())] == []


def test_the_trainer_asks_the_plan():
    # the config strings the plan resolves, compared in the trainer: at most a handful (issue 19 allowed 10)
    source = (ROOT / "grpo_ratio" / "trainer.py").read_text()
    code = source[source.index('"""', 3) + 3:]  # after the module docstring
    compares = re.findall(r"[!=]=\s*\"[^\"]*\"|\bin \(\"", code)  # == "x", != "x", in ("x", ...)
    assert len(compares) <= 10, compares
    assert "PRECISION_MODES[1:]" not in source
