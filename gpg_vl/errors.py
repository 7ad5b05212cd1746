"""The one exception type for failures a user can cause and fix.

Entry points catch it and print its message as a single sentence, without a stack trace.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure caused by the user's input (config, data, paths, network); the message names the fix."""


class BadRow(UserError):
    """One data row that cannot be used (a broken image, an empty question, an invalid box, ...).

    `reason` is a short category that bad rows are counted by ("missing image file", "empty question");
    the message names the row and the problem. Training skips such a row and counts it; where a single
    row is all there is (e.g. `load_image` called directly), it reads like any UserError.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SkippedRow(BadRow):
    """A row the task skips by design, not damaged data: it needs what the run lacks (a sentence ground truth
    without a judge). Counted under its reason, outside data.max_bad_fraction's stop."""


def raised(error: BaseException) -> str:
    """`Type: message` of an exception a plugin's own code raised, on one line (for a one-sentence UserError)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class Interrupted(Exception):
    """Ctrl-C during a run: the message says where it stopped and how to continue; the command line prints it
    as one line (no traceback) and exits with 130, as a shell does for SIGINT."""

    exit_code = 130
