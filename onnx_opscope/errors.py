"""The one exception type users see.

Anything a user can cause (bad path, bad file, unknown provider, wrong input) raises
`OpscopeError`; the CLI prints its message as one line (and its hint, if any) and exits
non-zero. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class OpscopeError(Exception):
    """A user-facing error: `message` is one line, `hint` says what to do about it."""

    def __init__(self, message: str, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest of `choices`, or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def listing(choices: Iterable[str], limit: int = 12) -> str:
    """A short comma list of `choices`, '...and N more' past `limit`."""
    items = sorted(set(choices))
    shown = ", ".join(items[:limit])
    return shown + (f", ...and {len(items) - limit} more" if len(items) > limit else "")
