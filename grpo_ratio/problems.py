"""`Problems`: one error that lists every problem found in a setting (a config, a recipe and its flags, an IS
correction, a gate), so that a user fixes them in one go rather than one per run. Imports nothing of the package:
anyone may raise or collect it (config checks, `grpo_ratio.corrections`, `grpo_ratio.diagnostics.gate`, the command
line's precheck).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class Problems(ValueError):
    """A `ValueError` holding every problem found, one message each (`problems`). Its text is the one message when
    there is one, else "N problems:" and one "- message" line each.

    Args:
        problems: the messages (a single string is one problem).
    """

    def __init__(self, problems: str | Iterable[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(describe(self.problems))


def describe(problems: list[str]) -> str:
    """The text of `Problems(problems)`."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"- {p}" for p in problems)


def messages(err: ValueError) -> list[str]:
    """The problems `err` holds: its `problems` (a `Problems`), else its message."""
    return list(getattr(err, "problems", None) or [str(err)])


def collect(checks: Iterable[Callable[[], object]], error: type[Problems] = Problems) -> None:
    """Run every check (a callable of no argument) and raise one `error` listing each `ValueError` they raised. A
    check that fails otherwise (a `KeyError`, `TypeError`, ...) after another check found a problem is taken as a
    consequence of that problem (a later check reading an invalid value) and skipped; before any, it propagates.

    Raises:
        Problems (or `error`): every problem found, in the order of `checks`.
    """
    found: list[str] = []
    for check in checks:
        try:
            check()
        except ValueError as err:
            found += messages(err)
        except Exception:
            if not found:
                raise
    if found:
        raise error(found)
