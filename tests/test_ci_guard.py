"""The CI guard (tests/ci_guard.py): with CI=true a session whose selected tests were all skipped fails."""

import pytest


SKIPPED = """
import pytest

def test_needs_an_extra():
    pytest.importorskip("no_such_extra_pkg", reason="needs the extra")

@pytest.mark.skipif(True, reason="needs ../data")
def test_needs_data():
    pass
"""

PASSED_AND_SKIPPED = SKIPPED + """
def test_runs():
    assert 1 + 1 == 2
"""


def _run(pytester, monkeypatch, source, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    pytester.makepyfile(test_lane=source)
    return pytester.runpytest("-p", "ci_guard")


@pytest.mark.parametrize("ci", ["true", "1", "TRUE"])
def test_all_skipped_fails_under_ci(pytester, monkeypatch, ci):
    result = _run(pytester, monkeypatch, SKIPPED, ci)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*CI=true: all 2 selected tests were skipped*needs the extra*needs ../data*"])


@pytest.mark.parametrize("ci", [None, "false", ""])
def test_all_skipped_passes_outside_ci(pytester, monkeypatch, ci):
    result = _run(pytester, monkeypatch, SKIPPED, ci)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(skipped=2)


def test_one_test_that_ran_is_enough(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, PASSED_AND_SKIPPED, "true")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=2)


def test_a_failure_keeps_its_own_status(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, SKIPPED + "\ndef test_fails():\n    assert False\n", "true")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(failed=1, skipped=2)
    assert "tested nothing" not in result.stdout.str()
