"""The measured tables in docs/ are generated from committed results (scripts/update_docs.py), never typed by hand."""

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_generated_doc_tables_are_up_to_date():
    proc = subprocess.run([sys.executable, "scripts/update_docs.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------------------------------
# prose numbers: every number the prose of a measured doc states must be held by the generated tables beside it

import re  # noqa: E402

import pytest  # noqa: E402


GENERATED = re.compile(r"<!-- BEGIN generated: .+? -->\n(.*?)<!-- END generated -->", re.S)
NOT_PROSE = [re.compile(p, re.S) for p in (r"<!-- BEGIN generated: .+? -->.*?<!-- END generated -->",
                                           r"```.*?```", r"`[^`\n]*`", r"\]\([^)]*\)", r"https?://\S+",
                                           r"github\.com/\S+", r"<!--.*?-->")]
NUMBER = re.compile(r"(?<![\w.\-/=^])[-−+]?\d+(?:\.\d+)?%?(?![\w.]\d|[\w])")
# numbers that are settings, rules or citations, not measurements of this project (with the reason)
NOT_MEASURED = {
    "docs/reading.md": {"0.9", "1.1",  # the default band [0.9, 1.1]
                        "1%", "0.97", "95%",  # thresholds of the report's rules; the interval level
                        "0", "1", "2", "3", "10"},  # exactly 0 / 1; seeds and steps the verdict needs
    "docs/arms.md": {"2", "4", "16", "3", "10", "150",  # recipe settings; seeds and steps the verdict needs; the
                     "1"},  # batch-logprob-gap report's steps; num_iterations / "exactly 1"
}


def prose_numbers(text: str) -> list[str]:
    """Numbers in the prose of a markdown doc: outside generated blocks, code, links and comments."""
    for pattern in NOT_PROSE:
        text = pattern.sub(" ", text)
    return [m.group(0).replace("−", "-") for m in NUMBER.finditer(text)]


def _value(token: str) -> tuple[float, bool, int]:
    """(value, is a percentage, decimals) of a number token."""
    pct = token.endswith("%")
    digits = token.rstrip("%")
    return float(digits), pct, len(digits.split(".")[1]) if "." in digits else 0


def held(number: str, tables: str) -> bool:
    """Whether a table number, rounded to the prose number's decimals, equals it (a percentage also matches the
    table's fraction: 9.7% is held by 0.097)."""
    value, pct, decimals = _value(number)
    for token in NUMBER.findall(tables.replace("−", "-")):
        t, t_pct, _ = _value(token)
        if pct and not t_pct:
            t, t_pct = 100 * t, True
        if t_pct == pct and abs(round(t, decimals) - value) < 1e-9:
            return True
    return False


def test_held_reads_percentages_and_rounding():
    tables = "| fp32_clone | 0.097 | +0.012 | 5.9% |"
    assert held("9.7%", tables) and held("6%", tables) and held("+0.012", tables)
    assert not held("+0.013", tables) and not held("9.8%", tables)  # the arms.md prose
    assert prose_numbers("a `9.9` b 7.6% of tokens, [x](y-1.2) p99 1.5B step-1 −0.022") == ["7.6%", "-0.022"]


@pytest.mark.parametrize("doc", sorted(NOT_MEASURED))
def test_prose_numbers_are_held_by_the_generated_tables(doc):
    text = (ROOT / doc).read_text()
    tables = "\n".join(GENERATED.findall(text))
    assert tables, f"{doc} has no generated table"
    stray = [n for n in prose_numbers(text) if n not in NOT_MEASURED[doc] and not held(n, tables)]
    assert not stray, f"{doc}: prose numbers no generated table holds: {stray}"
