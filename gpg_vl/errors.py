"""The one exception type for failures a user can cause and fix.

Entry points catch it and print its message as a single sentence, without a stack trace.
"""

from __future__ import annotations


class UserError(Exception):
    """A failure caused by the user's input (config, data, paths, network); the message names the fix."""
