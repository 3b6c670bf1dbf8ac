"""Pytest plugin (loaded by tests/conftest.py): under CI, a run whose selected tests were all skipped fails.

A lane of `.ci/run` that guards a promise of the README (ZeRO-3, SmolLM2, the notebook, real vLLM) skips its tests
where its extra, venv or data is missing; outside CI that is a pass, which would let CI go green while testing
nothing. With the environment variable `CI=true` (what `.ci/run` and most CI services set), a session in which at
least one test was selected and none passed or failed (every one skipped) exits with status 1 and names the skip
reasons. Runs with some skips and some passes, or with nothing selected (pytest's own status 5), are unchanged.
"""

from __future__ import annotations

import os

import pytest


def ci_enabled() -> bool:
    """Whether the run is a CI run: the environment variable `CI` is `true` or `1` (case-insensitive)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def _skip_reasons(reporter) -> list[str]:
    reasons = []
    for report in reporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        if reason not in reasons:
            reasons.append(reason)
    return reasons


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if not ci_enabled() or exitstatus != pytest.ExitCode.OK:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    ran = [r for key in ("passed", "failed", "error", "xfailed", "xpassed") for r in reporter.stats.get(key, [])]
    skipped = reporter.stats.get("skipped", [])
    if skipped and not ran:
        reasons = "; ".join(_skip_reasons(reporter))
        reporter.write_line(f"CI=true: all {len(skipped)} selected tests were skipped, so this lane tested nothing "
                            f"and fails (skip reasons: {reasons})", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
